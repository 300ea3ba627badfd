"""Counters of one side of the disaggregation (merged into the worker's stats snapshot)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PDStats:
    """Tokens and bytes moved, transfer time, failed requests."""

    transfers: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    local_prefix_tokens: int = 0  # decode side: prompt tokens its own RadixCache held (not transferred)

    def on_transfer(self, tokens: int, nbytes: int, seconds: float) -> None:
        self.transfers += 1
        self.tokens += tokens
        self.bytes += nbytes
        self.seconds += seconds

    def snapshot(self, role: str) -> dict[str, float]:
        """``pd_<role>_*`` counters (role: prefill sends, decode receives)."""
        verb = "sent" if role == "prefill" else "received"
        return {
            f"pd_{verb}_transfers": self.transfers,
            f"pd_{verb}_tokens": self.tokens,
            f"pd_{verb}_bytes": self.bytes,
            f"pd_{verb}_seconds": round(self.seconds, 6),
            "pd_failures": self.failures,
            "pd_local_prefix_tokens": self.local_prefix_tokens,
        }
