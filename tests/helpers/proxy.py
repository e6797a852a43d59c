"""A loopback TCP relay whose open connections a test can cut (a network blip: both ends
see the connection reset while the service keeps running)."""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttableProxy:
    """Relays every connection made to :attr:`address` to ``target`` ("host:port")."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.num_cuts = 0
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                downstream.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [downstream, upstream]
            for source, sink in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(
                    target=self._relay, args=(source, sink), name="proxy-relay", daemon=True
                ).start()

    @staticmethod
    def _relay(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Reset every connection open now (new ones are relayed as before)."""
        with self._lock:
            cut, self._open = self._open, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                s.close()
        self.num_cuts += 1

    def close(self) -> None:
        self._listener.close()
        self.cut()
