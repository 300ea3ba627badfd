"""The request fields sglang-router adds in PD mode: ``bootstrap_host``, ``bootstrap_port``,
``bootstrap_room`` (one value, or a list per prompt of a batch), read in the HTTP process."""

from __future__ import annotations

from typing import Any

FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
MAX_ROOM = 2**64  # the router draws rooms as unsigned 64-bit integers


def _neutral(v: Any) -> bool:
    return v is None or v is False or v == "" or (isinstance(v, list) and all(_neutral(x) for x in v))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(name: str, value: Any) -> None:
    for v in value if isinstance(value, list) else [value]:
        if v is None:
            continue
        if name == "bootstrap_host" and not (isinstance(v, str) and v):
            raise ValueError("bootstrap_host: must be a host name or address")
        if name == "bootstrap_port" and not (_is_int(v) and 0 < v < 65536):
            raise ValueError(f"bootstrap_port: must be a port number, got {v!r}")
        if name == "bootstrap_room" and not (_is_int(v) and 0 <= v < MAX_ROOM):
            raise ValueError(f"bootstrap_room: must be an integer in [0, 2**64), got {v!r}")


def take_bootstrap(body: dict[str, Any], mode: str) -> dict[str, Any]:
    """Pop the bootstrap fields from a decoded JSON body and validate them for ``--disaggregation-mode``.

    A normal server (``null``) accepts them only at neutral values (null / false / empty); a prefill or
    decode server needs host and port wherever a room is given. Raises ValueError naming the field."""
    found = {name: body.pop(name) for name in FIELDS if name in body}
    if mode == "null":
        for name, value in found.items():
            if not _neutral(value):
                raise ValueError(
                    f"{name}: this server is not a prefill or decode server (--disaggregation-mode null)"
                )
        return {}
    found = {k: v for k, v in found.items() if not _neutral(v)}
    for name, value in found.items():
        _check(name, value)
    if "bootstrap_room" in found and not {"bootstrap_host", "bootstrap_port"} <= found.keys():
        missing = "bootstrap_host" if "bootstrap_host" not in found else "bootstrap_port"
        raise ValueError(f"{missing}: needed with bootstrap_room (the prefill server's bootstrap address)")
    if "bootstrap_room" not in found and found:
        raise ValueError("bootstrap_room: needed with bootstrap_host / bootstrap_port")
    return found
