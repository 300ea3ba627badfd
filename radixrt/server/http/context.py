"""ServerContext: what the HTTP routes share (args, tenants, tokenizer, TokenizerManager, worker link,
metrics), and the one way a route generates (`ServerContext.generate`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from radixrt import __version__
from radixrt.config.server_args import ServerArgs
from radixrt.config.tenants import TenantConfig
from radixrt.models.resolve import resolve_model
from radixrt.models.tokenizer import eos_token_ids, load_tokenizer
from radixrt.server.http.metrics import REQUEST_TENANT, ServerMetrics
from radixrt.server.http.streaming import collect
from radixrt.server.http.tenants import coarsened, load_tenants, principal_of
from radixrt.server.io_struct import GenerateReqInput
from radixrt.server.request_log import log_request
from radixrt.server.supervisor import WorkerSupervisor
from radixrt.server.tokenizer_manager import TokenizerManager
from radixrt.transport.client import WorkerDeadError
from radixrt.transport.protocol import GetStatsReq, StatsOut, WorkerReady

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 10.0
HEALTH_STATS_MAX_AGE_S = 5.0  # /health refreshes an older reading of the worker's stats (in the background)
RESTART_WARMUP_TIMEOUT_S = 600.0


@dataclass
class ServerContext:
    """One running server: built by ``start``, torn down by ``shutdown``."""

    args: ServerArgs
    model_path: str
    model_name: str
    tokenizer: PreTrainedTokenizerBase
    client: WorkerSupervisor
    info: WorkerReady
    tm: TokenizerManager
    metrics: ServerMetrics
    tenants: TenantConfig | None = None
    ready: bool = False  # set after the warm-up request went through
    started_at: float = field(default_factory=time.time)
    last_stats: StatsOut | None = None  # the worker's latest answer to any stats request, and when
    last_stats_at: float = 0.0
    stats_refresh: asyncio.Task[None] | None = None  # a refresh /health started

    @classmethod
    def start(cls, args: ServerArgs) -> ServerContext:
        """Load the tenants file and the tokenizer, spawn the worker process and wait for its handshake
        (ValueError for a bad tenants file, before the worker starts)."""
        tenants = load_tenants(args.api_key, args.tenants)
        resolved = resolve_model(args.model_path, revision=args.revision)
        model_path = resolved.path
        tokenizer = load_tokenizer(args.tokenizer_path or model_path)
        client = WorkerSupervisor.spawn(args, model_path, eos_token_ids(tokenizer, model_path))
        info = client.info
        name = args.served_model_name or resolved.name
        tm = TokenizerManager(
            tokenizer, client, info.context_len, info.vocab_size, name, args.random_seed, args.max_batch_size
        )
        client.on_death = tm.fail_all
        metrics = ServerMetrics(name, tenants=tenants is not None, spec_algorithm=args.speculative_algorithm)
        tm.listeners.append(metrics.on_finished)
        if args.log_requests:
            tm.listeners.append(log_request)
        client.on_restart = metrics.worker_restarts.inc
        client.warm_up = functools.partial(_warm_up_restarted, tm)
        return cls(args, model_path, name, tokenizer, client, info, tm, metrics, tenants)

    @property
    def context_len(self) -> int:
        return self.info.context_len

    def model_info(self) -> dict[str, Any]:
        """/model_info in SGLang's shape (its frontend reads ``model_path``, bench_serving
        ``tokenizer_path``, sglang-router ``model_type`` and ``architectures``) plus radixrt's facts."""
        i = self.info
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.model_path,
            "served_model_name": self.model_name,
            "is_generation": True,
            "model_type": _model_type(self.model_path),
            "architectures": [i.architecture],
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "preferred_sampling_params": None,
            "architecture": i.architecture,
            "dtype": i.dtype,
            "context_length": i.context_len,
            "vocab_size": i.vocab_size,
            "kv_total_tokens": i.kv_total_tokens,
            "kv_bytes": i.kv_bytes,
            "page_size": i.page_size,
        }

    def generate(self, request: Request, obj: GenerateReqInput) -> AsyncGenerator[Any, None]:
        """``TokenizerManager.generate`` as ``request``'s sender: as its tenant (from the API key), with
        ``cached_tokens`` reported at ``--cache-report-granularity`` unless it is the admin."""
        principal = principal_of(request)
        REQUEST_TENANT.set(principal.tenant)  # NOTE: the tasks serving the request copy it (metrics)
        agen = self.tm.generate(obj, tenant=principal.tenant)
        granularity = self.args.cache_report_granularity
        if principal.admin or granularity == "exact":
            return agen
        return coarsened(agen, granularity)

    async def worker_stats(self) -> StatsOut:
        """The worker's StatsOut (raises WorkerDeadError when it is gone or does not answer)."""
        try:
            out = await asyncio.wait_for(self.tm.control_request(GetStatsReq()), STATS_TIMEOUT_S)
        except TimeoutError:
            raise WorkerDeadError(f"the worker did not answer within {STATS_TIMEOUT_S:.0f}s") from None
        self.last_stats, self.last_stats_at = out, time.monotonic()
        return out

    def health_warnings(self) -> list[str]:
        """What /health adds to an ok answer: a failed disk tier, read from the worker's latest stats.
        Never waits for the worker (a load balancer's probe must stay fast): a reading older than
        HEALTH_STATS_MAX_AGE_S is refreshed in the background for the next probe."""
        store = self.args.hicache_storage_dir
        if store is None:
            return []
        stale = time.monotonic() - self.last_stats_at > HEALTH_STATS_MAX_AGE_S
        if stale and (self.stats_refresh is None or self.stats_refresh.done()):
            self.stats_refresh = asyncio.ensure_future(self._refresh_stats())
        stats = self.last_stats.stats if self.last_stats is not None else {}
        if not stats.get("disk_tier_failed"):
            return []
        return [
            f"disk tier failed: it cannot write under --hicache-storage-dir {store} (the server log says why); "
            "requests are served without it"
        ]

    async def _refresh_stats(self) -> None:
        with contextlib.suppress(WorkerDeadError):
            await self.worker_stats()

    async def server_info(self) -> dict[str, Any]:
        """/server_info: settings, model facts, worker stats and the KV invariant check; SGLang's keys
        (``served_model_name``, ``dp_size``, ``max_total_num_tokens``, ``internal_states``) included."""
        stats = await self.worker_stats()
        settings = self.args.to_dict()
        settings["api_key"] = None if settings.get("api_key") is None else "<set>"
        spec = stats.stats.get("spec_accept_length") if self.args.speculative_algorithm else None
        return {
            **settings,
            "served_model_name": self.model_name,
            "dp_size": 1,  # this server is one data-parallel rank (`--dp-size N` runs N of them)
            "max_total_num_tokens": self.info.kv_total_tokens,
            "internal_states": [{"avg_spec_accept_length": spec}],
            "version": __version__,
            "model_path": self.model_path,
            "model_info": self.model_info(),
            "worker_pid": self.client.pid,
            "worker_restarts": self.client.restarts,
            "ipc_dir": self.client.ipc_dir,
            "uptime_s": time.time() - self.started_at,
            "num_http_requests_in_flight": len(self.tm.states),
            **stats.stats,
            "kv_invariant_message": stats.message,
        }

    async def load(self) -> list[dict[str, int]]:
        """/get_load as SGLang serves it (one entry per DP rank; sglang-router reads ``num_tokens``)."""
        s = (await self.worker_stats()).stats
        running, waiting = int(s.get("num_running_reqs", 0)), int(s.get("num_queue_reqs", 0))
        return [
            {
                "dp_rank": 0,
                "num_reqs": running + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": int(s.get("kv_used_tokens", 0)),
            }
        ]

    def startup_summary(self) -> str:
        i = self.info
        return (
            f"model {self.model_path} ({i.architecture}, {i.dtype}, context {i.context_len}, "
            f"vocab {i.vocab_size}); KV pool {i.kv_total_tokens} tokens, {i.kv_bytes / 2**20:.1f} MiB, "
            f"page size {i.page_size}; worker pid {i.pid}"
        )

    def shutdown(self) -> None:
        self.client.shutdown()


def _warm_up_restarted(tm: TokenizerManager) -> None:
    """One 1-token request through a restarted worker (on the supervisor's thread, its own loop)."""
    obj = GenerateReqInput(text="ping", sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    asyncio.run(asyncio.wait_for(collect(tm.generate(obj)), RESTART_WARMUP_TIMEOUT_S))


def _model_type(model_path: str) -> str | None:
    """``model_type`` of the checkpoint's config.json (None when it has none)."""
    try:
        return str(json.loads((Path(model_path) / "config.json").read_text())["model_type"])
    except (OSError, ValueError, KeyError):
        return None
