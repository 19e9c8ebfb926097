"""A host TCP listener for tests that check what a sandbox can reach (egress, relay caps)."""

from __future__ import annotations

import socket
import threading


class Listener:
    """Listens on a free port of ``host`` and hands each accepted connection to :meth:`handle`,
    one at a time, on a daemon thread, until :meth:`close`."""

    def __init__(self, host: str = "127.0.0.1", backlog: int = 16) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(backlog)
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.handle(conn)

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()
