"""A TCP forwarder on loopback that a test can take down and bring back: an outage of what it fronts.

A client configured with the proxy's address (the operator's kubeconfig pointing at it, say) sees a
real outage when the test calls `down()`: the listening socket closes, so new connections are refused,
and every open connection (watch streams, pooled keep-alive connections) is cut. `up()` listens on the
same port again. The bytes are forwarded untouched (TLS passes through), so nothing else is faked.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class TcpProxy:
    """Forwards 127.0.0.1:`port` to (`host`, `upstream_port`) while up; refuses and cuts everything while down."""

    def __init__(self, host: str, upstream_port: int) -> None:
        self.upstream = (host, upstream_port)
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self.port = 0
        self.accepted = 0

    def up(self) -> None:
        """Listen (on the first call, on a free port; later on the same one) and forward."""
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self.port = server.getsockname()[1]
        with self._lock:
            self._server = server
        threading.Thread(target=self._accept, args=(server,), name="proxy-accept", daemon=True).start()

    def down(self) -> None:
        """Stop listening (new connections are refused) and cut every open connection."""
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, set()
        if server is not None:
            server.close()
        for conn in conns:
            _cut(conn)

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                _cut(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._server is not server:  # went down meanwhile
                    _cut(client)
                    _cut(upstream)
                    continue
                self._conns |= {client, upstream}
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), name="proxy-pipe", daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns -= {src, dst}
            _cut(src)
            _cut(dst)

    def __enter__(self) -> TcpProxy:
        self.up()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.down()


def _cut(sock: socket.socket) -> None:
    """Shut a socket down both ways (wakes its blocked reader) and close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
