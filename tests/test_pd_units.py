"""The disaggregation's pieces without servers: the bootstrap server's routes, the request fields, the
transfer backends' copies (fake; Mooncake over TCP when importable), slot runs."""

from __future__ import annotations

import importlib.util
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
from server_harness import free_port

from radixrt.disaggregation.bootstrap import BootstrapServer, lookup
from radixrt.disaggregation.request_fields import take_bootstrap
from radixrt.disaggregation.transfer import FakeBackend, TransferBackend, pool_layout, slot_runs
from radixrt.mem_cache.kv_pool import KVPool

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None


def test_bootstrap_routes() -> None:
    port = free_port()
    server = BootstrapServer("127.0.0.1", port)
    try:
        with pytest.raises(ConnectionError, match="did not answer"):
            lookup("127.0.0.1", port)  # 404 until a prefill worker registers
        body = json.dumps({"role": "Prefill", "rank_ip": "10.0.0.7", "rank_port": 4242, "engine_rank": 0})
        put = urllib.request.Request(f"http://127.0.0.1:{port}/route", body.encode(), method="PUT")
        with urllib.request.urlopen(put, timeout=5) as resp:
            assert resp.status == 200
        assert lookup("127.0.0.1", port) == "tcp://10.0.0.7:4242"
        bad = urllib.request.Request(f"http://127.0.0.1:{port}/route", b'{"role": "Decode"}', method="PUT")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad, timeout=5)
        assert err.value.code == 400
    finally:
        server.close()
    with pytest.raises(ConnectionError):
        lookup("127.0.0.1", port)  # gone with its worker


def test_request_fields() -> None:
    boot = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**63 + 5}
    body: dict[str, Any] = {"text": "x", **boot}
    assert take_bootstrap(body, "decode") == boot and body == {"text": "x"}
    assert take_bootstrap({"bootstrap_room": None, "bootstrap_host": ""}, "null") == {}
    assert take_bootstrap({"text": "x"}, "prefill") == {}
    batch = {"bootstrap_host": ["h", "h"], "bootstrap_port": [1, 2], "bootstrap_room": [3, 4]}
    assert take_bootstrap(dict(batch), "prefill") == batch
    cases: list[tuple[dict[str, Any], str, str]] = [
        (boot, "null", "bootstrap_host: this server is not"),
        ({**boot, "bootstrap_room": -1}, "decode", "bootstrap_room: must be"),
        ({**boot, "bootstrap_room": 2**64}, "decode", "bootstrap_room: must be"),
        ({**boot, "bootstrap_room": True}, "decode", "bootstrap_room: must be"),
        ({**boot, "bootstrap_port": 0}, "decode", "bootstrap_port: must be"),
        ({"bootstrap_room": 1, "bootstrap_host": "h"}, "decode", "bootstrap_port: needed"),
        ({"bootstrap_host": "h", "bootstrap_port": 1}, "decode", "bootstrap_room: needed"),
    ]
    for fields, mode, message in cases:
        with pytest.raises(ValueError, match=message):
            take_bootstrap(dict(fields), mode)


def test_slot_runs() -> None:
    assert slot_runs([], []) == []
    assert slot_runs([5, 6, 7, 1, 2], [10, 11, 12, 13, 14]) == [(5, 10, 3), (1, 13, 2)]
    assert slot_runs([1, 2, 3], [1, 5, 6]) == [(1, 1, 1), (2, 5, 2)]


def pools(dtype: torch.dtype = torch.float32) -> tuple[KVPool, KVPool]:
    src, dst = KVPool(64, 3, 2, 8, dtype), KVPool(64, 3, 2, 8, dtype)
    gen = torch.Generator().manual_seed(0)
    for buf in src.k_buffers + src.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    return src, dst


def check_copied(src: KVPool, dst: KVPool, s: list[int], d: list[int]) -> None:
    for layer in range(src.num_layers):
        assert torch.equal(dst.k_buffers[layer][d], src.k_buffers[layer][s])
        assert torch.equal(dst.v_buffers[layer][d], src.v_buffers[layer][s])
    untouched = sorted(set(range(64)) - set(d))
    assert not dst.k_buffers[0][untouched].any()


def move(a: TransferBackend, b: TransferBackend, s: list[int], d: list[int]) -> None:
    payload = a.write(b.session, b.dst_ptrs(), s, d)
    b.accept(d, payload)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_backend_moves_the_rows(dtype: torch.dtype) -> None:
    src, dst = pools(dtype)
    a, b = FakeBackend(src), FakeBackend(dst)
    s, d = [3, 4, 5, 9, 10], [20, 21, 22, 40, 50]
    move(a, b, s, d)
    check_copied(src, dst, s, d)
    with pytest.raises(OSError, match="payload"):
        b.accept(d[:2], a.write("", [], s, d))


def test_layout_names_geometry_and_dtype() -> None:
    assert pool_layout(KVPool(8, 3, 2, 8, torch.float32)) == pool_layout(KVPool(16, 3, 2, 8, torch.float32))
    assert pool_layout(KVPool(8, 3, 2, 8, torch.float32)) != pool_layout(KVPool(8, 3, 2, 8, torch.bfloat16))
    assert pool_layout(KVPool(8, 3, 2, 8, torch.float32)) != pool_layout(KVPool(8, 4, 2, 8, torch.float32))


@pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake-transfer-engine is not installed (radixrt[pd])")
def test_mooncake_backend_moves_the_rows_over_tcp() -> None:
    from radixrt.disaggregation.mooncake import MooncakeBackend

    src, dst = pools()
    a, b = MooncakeBackend(src, "127.0.0.1", None), MooncakeBackend(dst, "127.0.0.1", None)
    try:
        s, d = [3, 4, 5, 9, 10], [20, 21, 22, 40, 50]
        assert a.write(b.session, b.dst_ptrs(), s, d) == b""  # written into dst's memory by the engine
        check_copied(src, dst, s, d)
        with pytest.raises(OSError, match="buffers"):
            a.write(b.session, b.dst_ptrs()[:2], s, d)
    finally:
        a.close()
        b.close()


def test_advertised_ip() -> None:
    """A wildcard bind advertises a concrete address of this machine (peers cannot dial 0.0.0.0)."""
    import ipaddress

    from radixrt.disaggregation.channel import advertised_ip

    assert advertised_ip("127.0.0.1") == "127.0.0.1"
    ip = ipaddress.ip_address(advertised_ip("0.0.0.0"))
    assert not ip.is_unspecified
