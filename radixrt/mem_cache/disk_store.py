"""The persistent disk tier (LMCache-style): chunks of KV in safetensors files under a content key.

A *chunk* is ``chunk_tokens`` consecutive tokens (a multiple of the page size) starting at a multiple of
it. Its key is a chained hash: ``key_0 = H(namespace_root, tokens of chunk 0)``, ``key_c = H(key_{c-1},
tokens of chunk c)``, where ``namespace_root = H(identity, cache namespace)`` and the identity covers the
model (a fingerprint of its config and weights), the compute and stored KV dtypes, the e4m3 scales, the
page size and chunk size, the quantization and the KV shape. So a key names one exact prefix of one
namespace of one model: another model, dtype, page size or tenant computes other keys and never reads
these files. Each identity has its own directory: ``<storage_dir>/<identity>/<key>.safetensors``.

Files hold ``k`` and ``v`` ``[layers, chunk_tokens, kv_heads, head_dim]`` in the stored dtype, and
metadata: format, identity, namespace, key, chunk index, chunk size and a blake2b checksum of the tensor
bytes. A read verifies all of them; a corrupt, truncated or foreign file is ignored with a warning,
removed, and never served.

Writes are asynchronous: ``put`` snapshots the tensors and queues them; a background thread writes each
file to a temporary name and renames it into place (atomic), then evicts least recently used files past
the capacity. Until written, a queued chunk is served from memory. The index lives in memory and is
rebuilt from the directory at start (oldest modification time first), so a restarted server finds
what an earlier one stored.

A directory deleted under the running server (by hand, a cleanup job) is recreated at the next write,
read or stats snapshot, and the chunks indexed in it are forgotten (``lost_chunks``), so the counters
stay true. While it cannot be recreated, or writes fail, the tier is *failed* (``failure``: logged once,
``disk_tier_failed`` in the stats, a warning in ``/health``): requests are served without it, and the
first write that succeeds again clears it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

logger = logging.getLogger(__name__)

FORMAT = "radixrt-kv-1"
CHUNK_TOKENS = 16  # rounded up to a multiple of the page size
MAX_PENDING_BYTES = 256 << 20  # queued writes beyond this are dropped (counted), not buffered
_SAMPLE = 4096  # bytes hashed at three places of every weight tensor for the model fingerprint
_STALE_TMP_S = 3600.0


def chunk_tokens_for(page_size: int) -> int:
    return -(-CHUNK_TOKENS // page_size) * page_size


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p)
    return h.digest()


def model_fingerprint(model_dir: str | Path) -> str:
    """A digest of a checkpoint directory: config.json, every safetensors header, and 3 x 4 KiB of every
    tensor (start, middle, end), so checkpoints of one architecture with other weights differ."""
    d = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    config = d / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    files = sorted(d.glob("*.safetensors"))
    for f in files:
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = fh.read(n)
            h.update(header)
            base = 8 + n
            for name, entry in sorted(json.loads(header).items()):
                if name == "__metadata__":
                    continue
                start, end = entry["data_offsets"]
                for off in {start, max(start, (start + end) // 2), max(start, end - _SAMPLE)}:
                    fh.seek(base + off)
                    h.update(fh.read(min(_SAMPLE, end - off)))
    if not files:  # no safetensors: names and sizes of whatever is there
        for f in sorted(p for p in d.iterdir() if p.is_file()):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy().data).cast("B")


def _checksum(k: torch.Tensor, v: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(_tensor_bytes(k))
    h.update(_tensor_bytes(v))
    return h.hexdigest()


@dataclass(slots=True)
class DiskStats:
    """Counters (chunks and files) since start."""

    written_chunks: int = 0
    loaded_chunks: int = 0
    rejected_files: int = 0
    dropped_writes: int = 0
    evicted_files: int = 0
    write_errors: int = 0
    dir_recreations: int = 0  # the storage directory vanished and was made again
    lost_chunks: int = 0  # indexed chunks that vanished with it


class DiskStore:
    """Content-keyed KV chunks in files; see the module docstring. Thread-safe: the scheduler thread
    calls ``put`` / ``get`` / ``contains``, one background thread writes."""

    def __init__(
        self,
        root: str | Path,
        identity: Mapping[str, object],
        chunk_tokens: int,
        kv_shape: tuple[int, int, int],
        dtype: torch.dtype,
        capacity_bytes: int,
    ) -> None:
        self.identity = hashlib.blake2b(
            json.dumps(identity, sort_keys=True).encode(), digest_size=16
        ).hexdigest()
        self.dir = Path(root) / self.identity
        self.dir.mkdir(parents=True, exist_ok=True)
        self.chunk_tokens = chunk_tokens
        self.layers, self.kv_heads, self.head_dim = kv_shape
        self.dtype = dtype
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = 2 * self.layers * chunk_tokens * self.kv_heads * self.head_dim * dtype.itemsize
        self.stats = DiskStats()
        self.failure: str | None = None  # why the tier cannot write now; None while it can
        self._lock = threading.Lock()
        self._dir_lock = threading.Lock()  # one thread recreates a vanished directory
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._bytes = 0
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending_bytes = 0
        self._queue: queue.Queue[tuple[str, int, str, torch.Tensor, torch.Tensor] | None] = queue.Queue()
        self.rescan()
        self._thread = threading.Thread(target=self._write_loop, name="radixrt-disk-writer", daemon=True)
        self._thread.start()
        logger.info(
            "disk tier %s: %d chunks (%.1f MiB) found, capacity %.1f MiB, %d tokens per chunk",
            self.dir, len(self._index), self._bytes / 2**20, capacity_bytes / 2**20, chunk_tokens,
        )  # fmt: skip

    # -- keys -------------------------------------------------------------------------------------
    def namespace_root(self, cache_salt: str | None) -> bytes:
        return _digest(self.identity.encode(), b"\0", json.dumps(cache_salt).encode())

    def chunk_keys(self, cache_salt: str | None, tokens: Sequence[int], num_chunks: int) -> list[str]:
        """The keys of the first ``num_chunks`` chunks of ``tokens`` in namespace ``cache_salt``."""
        c = self.chunk_tokens
        fmt = f"<{c}q"
        prev = self.namespace_root(cache_salt)
        keys = []
        for i in range(num_chunks):
            prev = _digest(prev, struct.pack(fmt, *tokens[i * c : (i + 1) * c]))
            keys.append(prev.hex())
        return keys

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.safetensors"

    # -- reads and writes -------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def put(self, key: str, chunk: int, cache_salt: str | None, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Queue chunk ``chunk`` (``k``/``v`` ``[layers, chunk_tokens, KVH, D]``, owned by the store from
        now on) for writing; False when it is already stored or queued, or the queue is full."""
        nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        with self._lock:
            if key in self._index or key in self._pending:
                return False
            if self._pending_bytes + nbytes > MAX_PENDING_BYTES:
                self.stats.dropped_writes += 1
                return False
            self._pending[key] = (k, v)
            self._pending_bytes += nbytes
        self._queue.put((key, chunk, self.namespace_root(cache_salt).hex(), k, v))
        return True

    def get(self, key: str, chunk: int, cache_salt: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Chunk ``chunk`` of namespace ``cache_salt`` under ``key``, verified; None when absent or bad."""
        with self._lock:
            queued = self._pending.get(key)
            if queued is not None:
                return queued
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # removed behind our back (another server sharing the directory)
            self._forget(key, delete=False)
            self.check_dir()  # or the whole directory went: forget all of it at once
            return None
        except OSError as exc:
            self._reject(key, f"unreadable ({exc})")
            return None
        kv, problem = self._decode(data, key, chunk, self.namespace_root(cache_salt).hex())
        if kv is None:
            self._reject(key, problem)
            return None
        self.stats.loaded_chunks += 1
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        return kv

    def _decode(
        self, data: bytes, key: str, chunk: int, namespace: str
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, str]:
        try:
            n = int.from_bytes(data[:8], "little")
            if len(data) < 8 + n:
                return None, "truncated header"
            meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
            tensors = safetensors.torch.load(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure means: not servable
            return None, f"not a valid safetensors file ({type(exc).__name__}: {exc})"
        expected = self._meta(key, chunk, namespace)
        for field, want in expected.items():
            if meta.get(field) != want:
                return None, f"{field} {meta.get(field)!r} is not {want!r} (a foreign or misplaced file)"
        k, v = tensors.get("k"), tensors.get("v")
        shape = (self.layers, self.chunk_tokens, self.kv_heads, self.head_dim)
        if k is None or v is None or k.shape != shape or v.shape != shape or k.dtype != self.dtype:
            return None, f"tensors are not k/v {shape} {self.dtype}"
        if v.dtype != self.dtype or _checksum(k, v) != meta.get("checksum"):
            return None, "checksum mismatch (corrupt)"
        return (k, v), ""

    def _reject(self, key: str, why: str) -> None:
        logger.warning("disk tier: ignoring %s: %s", self.path(key).name, why)
        self.stats.rejected_files += 1
        self._forget(key, delete=True)

    def _forget(self, key: str, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        if delete:
            self.path(key).unlink(missing_ok=True)

    # -- the writer thread ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, chunk, namespace, k, v = item
            size = 0
            try:
                size = self._write(key, chunk, namespace, k, v) if self.check_dir() else 0
            except OSError as exc:
                logger.warning("disk tier: writing %s failed: %s", self.path(key).name, exc)
                self._fail(f"writing chunks under {self.dir} fails ({exc})")
            if not size:
                self.stats.write_errors += 1
            elif self.failure is not None:
                logger.warning("disk tier: writes under %s succeed again", self.dir)
                self.failure = None
            with self._lock:
                if size:
                    self._index[key] = size
                    self._bytes += size
                    self.stats.written_chunks += 1
                self._pending.pop(key, None)
                self._pending_bytes -= k.numel() * k.element_size() + v.numel() * v.element_size()
                victims = []
                while self._bytes > self.capacity_bytes and self._index:
                    old, old_size = self._index.popitem(last=False)
                    self._bytes -= old_size
                    victims.append(old)
                self.stats.evicted_files += len(victims)
            for old in victims:
                self.path(old).unlink(missing_ok=True)
            self._queue.task_done()

    def _meta(self, key: str, chunk: int, namespace: str) -> dict[str, str]:
        """A chunk file's identity fields (the safetensors metadata), checked on every read."""
        return {
            "format": FORMAT,
            "identity": self.identity,
            "namespace": namespace,
            "key": key,
            "chunk": str(chunk),
            "tokens": str(self.chunk_tokens),
        }

    def _write(self, key: str, chunk: int, namespace: str, k: torch.Tensor, v: torch.Tensor) -> int:
        meta = {**self._meta(key, chunk, namespace), "checksum": _checksum(k, v)}
        data = safetensors.torch.save({"k": k.contiguous(), "v": v.contiguous()}, metadata=meta)
        tmp = self.dir / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path(key))
        finally:
            tmp.unlink(missing_ok=True)
        return len(data)

    def check_dir(self) -> bool:
        """True when the storage directory is there. One that vanished is recreated and the chunks
        indexed in it are forgotten; False (the tier failed, logged once) when it cannot be recreated."""
        if self.dir.is_dir():
            return True
        with self._dir_lock:
            if self.dir.is_dir():
                return True
            with self._lock:
                lost = len(self._index)
                self._index.clear()
                self._bytes = 0
            self.stats.lost_chunks += lost
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._fail(f"storage directory {self.dir} vanished and cannot be recreated ({exc})")
                return False
            self.stats.dir_recreations += 1
            self.failure = None
            logger.warning(
                "disk tier: storage directory %s vanished (%d chunks lost); recreated it", self.dir, lost
            )
            return True

    def _fail(self, why: str) -> None:
        if self.failure is None:
            logger.error("disk tier failed: %s; requests are served without it", why)
        self.failure = why

    def rescan(self) -> None:
        """Index the directory's files not indexed yet, oldest first (at start: what an earlier server
        stored; later: what another server sharing the directory wrote), then enforce the capacity."""
        if not self.check_dir():
            return
        now = time.time()
        entries = []
        for p in self.dir.iterdir():
            try:
                st = p.stat()
            except OSError:
                continue
            if p.name.startswith("."):
                if p.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                    p.unlink(missing_ok=True)  # left by a writer that died
                continue
            if p.suffix == ".safetensors":
                entries.append((st.st_mtime, p.stem, st.st_size))
        victims = []
        with self._lock:
            for _, key, size in sorted(entries, reverse=True):  # each moves in front of newer ones
                if key not in self._index and key not in self._pending:
                    self._index[key] = size
                    self._index.move_to_end(key, last=False)  # older than what this server touched
                    self._bytes += size
            while self._bytes > self.capacity_bytes and self._index:
                old, size = self._index.popitem(last=False)
                self._bytes -= size
                victims.append(old)
        for old in victims:
            self.path(old).unlink(missing_ok=True)

    # -- lifecycle and accounting -----------------------------------------------------------------
    def flush(self) -> None:
        """Wait until every queued chunk is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    @property
    def num_chunks(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def size_bytes(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def pending_chunks(self) -> int:
        with self._lock:
            return len(self._pending)

    def check_integrity(self, files: bool = False) -> None:
        """Accounting: indexed bytes add up and fit the capacity, queued bytes add up; with ``files``,
        the directory holds exactly the indexed files (only true while no other server shares it)."""
        with self._lock:
            assert self._bytes == sum(self._index.values()), "disk tier: indexed bytes out of date"
            assert self._bytes <= self.capacity_bytes, f"disk tier over capacity: {self._bytes}"
            queued = sum(
                k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._pending.values()
            )
            assert self._pending_bytes == queued, "disk tier: queued bytes out of date"
            keys = set(self._index)
        if files:
            on_disk = {p.stem for p in self.dir.glob("*.safetensors")}
            assert on_disk == keys, f"disk tier: {len(on_disk ^ keys)} files differ from the index"
