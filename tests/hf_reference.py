"""HF transformers as the oracle: greedy continuations and prompt logprobs of a checkpoint."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@functools.lru_cache(maxsize=8)
def hf_model(path: str) -> PreTrainedModel:
    """The fp32 HF model of a checkpoint directory, or of a ``.gguf`` file (transformers' own GGUF load)."""
    p = Path(path)
    if p.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(
    path: str | Path, ids: list[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """HF ``generate`` greedy: never stopping early, or stopping after ``eos_token_id`` when given."""
    model = hf_model(str(path))
    stop = {"eos_token_id": eos_token_id} if eos_token_id is not None else {"min_new_tokens": max_new_tokens}
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **stop,
    )
    return list(out[0, len(ids) :].tolist())


@torch.inference_mode()
def hf_prompt_logprobs(path: str | Path, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from HF's full-sequence forward."""
    model = hf_model(str(path))
    logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@torch.inference_mode()
def hf_next_logprobs(path: str | Path, ids: list[int]) -> torch.Tensor:
    """The full next-token log-distribution after ``ids``."""
    model = hf_model(str(path))
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
