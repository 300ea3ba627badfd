"""What every launcher shares: the log line format, and how long a server's start (warm-up) may take."""

from __future__ import annotations

import logging

WARMUP_TIMEOUT_S = 600.0  # a server's warm-up request (and, under --dp-size, every server's start)


def setup_logging(level: str, tag: str = "http") -> None:
    """Log at ``level`` with the process's ``tag`` in every line (http, node 1, ...)."""
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s [{tag}] %(levelname)s %(name)s: %(message)s", force=True
    )
