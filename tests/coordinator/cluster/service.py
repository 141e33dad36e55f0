"""FailoverService: a TCP forwarder standing in for a Kubernetes Service in front of several coordinators.

Each new connection goes to the first backend that accepts it, so while coordinator A lives its workers
register and heartbeat through A, and once A is gone their next connection reaches B. The backend list may
be changed while it runs.
"""

from __future__ import annotations

import socket
import threading


class FailoverService:
    def __init__(self, backends: list[str] = ()):
        self.backends = list(backends)  # "host:port", in order of preference
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        for backend in list(self.backends):
            host, port = backend.rsplit(":", 1)
            try:
                upstream = socket.create_connection((host, int(port)), timeout=1)
            except OSError:
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
            self._pipe(client, upstream)
            return
        client.close()  # no backend: the caller sees the connection close, as with no ready endpoint

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self._server.close()
