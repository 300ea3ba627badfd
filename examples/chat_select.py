"""A support chat that routes each user message with ``select`` before replying.

``python examples/chat_select.py`` — roles are rendered with the model's chat template; every turn
extends the same conversation, so each request computes only the new turn (watch ``cached`` grow).
``select`` scores all intents in one batched request; its scores are in ``get_meta_info``.
"""

from __future__ import annotations

import time
from typing import Any

from common import make_backend, parse_args, print_cache_stats

import frontend_lang as sgl

INTENTS = ["repair", "buy a bike", "opening hours", "complaint", "other"]
CONVERSATIONS = [
    ["Hi, my rear brake squeaks.", "Can you fix it today?", "Great, how much will it cost?"],
    ["When are you open on Sunday?", "And do you sell e-bikes?"],
    ["The bike I bought last week is already broken!", "I want my money back."],
]


@sgl.function
def support_chat(s: Any, turns: list[str]) -> list[dict[str, Any]]:
    s += sgl.system(
        "You are the assistant of a bike shop. For every message, first name its intent ("
        + ", ".join(INTENTS)
        + "), then reply in one friendly sentence."
    )
    log = []
    for message in turns:
        s += sgl.user(message)
        s += sgl.assistant(
            "Intent: "
            + sgl.select("intent", choices=INTENTS)
            + "\nReply:"
            + sgl.gen("reply", max_tokens=24, stop="\n")
        )
        meta = s.get_meta_info("intent")
        scores = dict(zip(INTENTS, meta["scores"], strict=True))
        cached = s.get_meta_info("reply")["cached_tokens"]
        log.append(
            {"user": message, "intent": s["intent"], "scores": scores, "reply": s["reply"], "cached": cached}
        )
    return log


def main() -> None:
    ns = parse_args(__doc__)
    started = time.perf_counter()
    backend = make_backend(ns)
    states = support_chat.run_batch([{"turns": t} for t in CONVERSATIONS], temperature=0.7)
    for n, st in enumerate(states, start=1):
        if st.error() is not None:
            print(f"\nconversation {n}: error {st.error()!r}")
            continue
        print(f"\nconversation {n}:")
        for turn in st.ret_value:
            best = sorted(turn["scores"].items(), key=lambda kv: -kv[1])[:2]
            ranked = ", ".join(f"{k} {v:.2f}" for k, v in best)
            print(f"  user: {turn['user']}")
            print(
                f"    intent: {turn['intent']} (top scores: {ranked}); reply prompt cached {turn['cached']} tokens"
            )
            print(f"    reply: {turn['reply'][:70]!r}")
    print_cache_stats(backend, started)
    backend.shutdown()


if __name__ == "__main__":
    main()
