"""The prefill server's bootstrap server (SGLang's ``/route``): where a decode worker finds the prefill
worker's control channel.

``PUT /route`` registers a prefill worker (JSON ``role``, ``rank_ip``, ``rank_port``, ``engine_rank``);
``GET /route?engine_rank=0&target_dp_group=0`` answers ``{"rank_ip", "rank_port"}`` (404 while none is
registered); ``GET /health`` answers 200. It runs on a thread of the prefill worker process, so it goes
down with the worker it describes.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 2.0


class BootstrapServer:
    """``/route`` on ``host:port``, in a daemon thread."""

    def __init__(self, host: str, port: int) -> None:
        self.routes: dict[tuple[int, int], dict[str, Any]] = {}
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urlparse(self.path)
                if url.path == "/health":
                    self._answer(200, {"status": "ok"})
                    return
                if url.path != "/route":
                    self._answer(404, {"error": f"no route {url.path}"})
                    return
                query = parse_qs(url.query)
                try:
                    rank = int(query.get("engine_rank", ["0"])[0])
                    group = int(query.get("target_dp_group", ["0"])[0])
                except ValueError:
                    self._answer(400, {"error": "engine_rank, target_dp_group: integers"})
                    return
                with server._lock:
                    entry = server.routes.get((rank, group))
                if entry is None:
                    self._answer(
                        404, {"error": f"no prefill worker registered for rank {rank} group {group}"}
                    )
                else:
                    self._answer(200, {"rank_ip": entry["rank_ip"], "rank_port": entry["rank_port"]})

            def do_PUT(self) -> None:  # noqa: N802
                if urlparse(self.path).path != "/route":
                    self._answer(404, {"error": "no such route"})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
                    server.register(body)
                except (ValueError, KeyError, TypeError) as exc:
                    self._answer(400, {"error": f"bad registration: {exc}"})
                    return
                self._answer(200, {"status": "ok"})

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                logger.debug("bootstrap: " + format, *args)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="pd-bootstrap", daemon=True)
        self._thread.start()

    def register(self, body: dict[str, Any]) -> None:
        """Record a prefill worker's control channel (the PUT /route body)."""
        if body.get("role", "Prefill") != "Prefill":
            raise ValueError(f"role: only Prefill workers register, got {body.get('role')!r}")
        entry = {"rank_ip": str(body["rank_ip"]), "rank_port": int(body["rank_port"])}
        key = (int(body.get("engine_rank", 0)), int(body.get("dp_group", 0)))
        with self._lock:
            self.routes[key] = entry

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def lookup(host: str, port: int) -> str:
    """The control endpoint (tcp://IP:PORT) of the prefill worker behind bootstrap ``host:port``.

    Raises ConnectionError with the reason when the bootstrap server does not answer it."""
    url = f"http://{host}:{port}/route?engine_rank=0&target_dp_group=0"
    try:
        with urllib.request.urlopen(url, timeout=LOOKUP_TIMEOUT_S) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ConnectionError(
            f"the prefill server's bootstrap server at {host}:{port} did not answer: {exc}"
        ) from exc
    return f"tcp://{body['rank_ip']}:{int(body['rank_port'])}"
