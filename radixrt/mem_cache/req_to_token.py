"""ReqToTokenPool: per running request, the row of KV slot indices of its tokens."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A ``[size + 1, max_context_len]`` int64 table; a running request owns one of the first ``size`` rows.

    The extra last row (``padding_row``) is never handed out and stays all zeros: rows that pad a batch to
    a compiled batch size point at it, so they read and write only the reserved padding slot 0.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.padding_row = size
        self.req_to_token = torch.zeros(size + 1, max_context_len, dtype=torch.int64, device=device)
        self._free_rows: list[int] = list(range(size - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """Take a free row, or None when all are in use."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if row in self._free_rows:
            raise AssertionError(f"ReqToTokenPool: row {row} freed twice")
        self._free_rows.append(row)

    def clear(self) -> None:
        self._free_rows = list(range(self.size - 1, -1, -1))
