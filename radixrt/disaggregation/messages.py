"""The control messages between a decode worker and a prefill worker (msgspec over ZeroMQ TCP)."""

from __future__ import annotations

import msgspec


class KVRequest(msgspec.Struct, tag=True):
    """Decode -> prefill: where to write the KV of ``room``'s prompt tokens ``start ..``.

    ``dst_slots`` are the decode pool's slot indices of those tokens; ``dst_ptrs`` the addresses of its
    K buffers then V buffers (one per layer); ``session`` the decode side's transfer-engine session;
    ``layout`` names the pool's geometry and dtype, which must equal the prefill side's.
    """

    room: int
    reply_to: str
    start: int
    dst_slots: list[int]
    dst_ptrs: list[int]
    session: str
    layout: str


class KVDone(msgspec.Struct, tag=True):
    """Prefill -> decode: the KV of ``room`` is written (``ok``), or why not (``status_code``, ``error``).

    ``first_token`` is the token the prefill side sampled after the prompt (its logprob when asked for),
    ``cached_tokens`` the prompt tokens its RadixCache held, ``payload`` the KV bytes themselves with the
    ``fake`` backend (empty with Mooncake, which wrote them into the decode pool already).
    """

    room: int
    ok: bool
    status_code: int = 200
    error: str = ""
    first_token: int = -1
    first_logprob: float | None = None
    cached_tokens: int = 0
    payload: bytes = b""


ControlMessage = KVRequest | KVDone
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(ControlMessage)
