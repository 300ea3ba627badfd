"""The control channel of one worker: a ZeroMQ PULL socket it binds, PUSH sockets to its peers."""

from __future__ import annotations

import socket

import zmq

from radixrt.disaggregation.messages import DECODER, ENCODER, ControlMessage

# A peer that stopped reading: messages queue up to this many, then a send fails (the request ends).
SEND_HWM = 10_000


def advertised_ip(host: str) -> str:
    """The address peers reach this machine at: ``host`` itself unless it is a wildcard, else the address of
    the interface that routes outward (a UDP ``connect`` sends nothing), else the host name's address
    (which some distributions map to 127.0.1.1: then bind ``--host`` to the address explicitly)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class Channel:
    """Receive control messages on ``endpoint`` (tcp://IP:PORT); send to any peer's endpoint."""

    def __init__(self, host: str) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        ip = advertised_ip(host)
        port = self._pull.bind_to_random_port(f"tcp://{'*' if host in ('0.0.0.0', '::') else ip}")
        self.ip, self.port = ip, port
        self.endpoint = f"tcp://{ip}:{port}"
        self._push: dict[str, zmq.Socket[bytes]] = {}

    def recv_all(self) -> list[ControlMessage]:
        """Every message that arrived, without blocking."""
        out: list[ControlMessage] = []
        while True:
            try:
                raw = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(DECODER.decode(raw))

    def send(self, endpoint: str, msg: ControlMessage) -> bool:
        """Queue ``msg`` to ``endpoint``; False when it cannot be queued (the peer is gone or stuck)."""
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        try:
            sock.send(ENCODER.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def forget(self, endpoint: str) -> None:
        """Close the socket to a peer that stopped answering (a restarted peer listens elsewhere)."""
        sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for sock in self._push.values():
            sock.close()
        self._push.clear()
        self._pull.close()
