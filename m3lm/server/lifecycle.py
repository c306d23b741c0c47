"""What `m3lm serve` does before it serves: hold its port, and stop at once when told to.

The port is bound before the model loads, so that a port in use is a one-line error at once,
not after minutes of loading; nobody can take it while the model loads, and connections to it
are refused (it is not listening yet) until the server is ready. Until uvicorn takes over the
signals, SIGINT (Ctrl-C) and SIGTERM end the start-up: the caller stops the engine process and
exits with one line.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
from collections.abc import Iterator

from m3lm.errors import M3lmError


class Stopped(Exception):
    """A signal ended the start-up."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name} while starting")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening; a port in use is an M3lmError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise M3lmError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            why += ": another server is running there; stop it or choose another --port"
        elif e.errno == errno.EACCES:
            why += ": ports below 1024 need privileges; choose another --port"
        raise M3lmError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Stopped` in the main thread while the block runs."""

    def stop(signum, frame):
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
