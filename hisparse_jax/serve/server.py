"""Running the app: uvicorn with a draining shutdown, in the main thread or in a thread.

`HTTPServer` binds and listens on its socket itself (so `port=0` gets a free port, known
before serving, and a client may connect as soon as the port is printed) and runs uvicorn
over `build_app(state)`; the lifespan's end stops the engine loop (which closes the
engine). SIGTERM or SIGINT starts the drain (`drain`): admission stops (new requests and
/health answer 503), running and queued requests finish, for at most the grace period;
then those left are cancelled (their clients get finish_reason "abort"), their responses
flush, and the server exits; `run()` returns normally, so the process exits 0. A second
signal during the drain exits at once. uvicorn's own signal capture is replaced because it
re-raises the signal after its shutdown (the process would then die of it, not exit 0).

`ServerThread` runs an `HTTPServer` in a background thread (no signal handling): for tests
and for embedding in another program.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import uvicorn

from hisparse_jax.serve.app import ServerState, build_app

log = logging.getLogger("hisparse_jax.serve")
_FLUSH_S = 5.0  # after the grace period: how long cancelled responses get to flush


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with its signal capture replaced by `HTTPServer`'s drain."""

    def __init__(self, config: uvicorn.Config, owner: HTTPServer) -> None:
        super().__init__(config)
        self.owner = owner

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.owner.on_signal) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class HTTPServer:
    """The app of `state` served on (host, port) (module docstring); `grace_period`: the
    seconds a drain waits for the requests in the server."""

    def __init__(self, state: ServerState, *, host: str = "127.0.0.1", port: int = 0,
                 grace_period: float = 30.0, log_level: str = "warning") -> None:
        self.state, self.grace_period = state, grace_period
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.socket.listen(2048)  # connections queue from now on, before uvicorn accepts
        self.host, self.port = host, self.socket.getsockname()[1]
        app = build_app(state, lifespan=self._lifespan)
        config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=int(_FLUSH_S) + 1)
        self.uvicorn = _Uvicorn(config, self)
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: object) -> AsyncIterator[None]:
        self._aloop = asyncio.get_running_loop()
        try:
            yield
        finally:
            await asyncio.to_thread(self.state.loop.stop)

    def run(self) -> None:
        """Serves until a drain ends it (or `shutdown`); returns normally."""
        self.uvicorn.run(sockets=[self.socket])

    def on_signal(self, sig: int, frame: object) -> None:
        """SIGTERM / SIGINT: start the drain; a second one exits at once."""
        if self._drain_task is not None or self._aloop is None:
            self.uvicorn.should_exit = self.uvicorn.force_exit = True
            return
        log.warning("signal %d: draining (grace period %.1f s)", sig, self.grace_period)
        self.state.loop.begin_drain()
        self._aloop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Stops admission, waits up to the grace period for the server's requests, cancels
        the rest, lets their responses flush, then ends the server."""
        loop, state = self.state.loop, self.state
        loop.begin_drain()
        deadline = time.monotonic() + self.grace_period
        while loop.outstanding and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if loop.outstanding:
            log.warning("grace period over: cancelling %d requests", loop.outstanding)
            loop.cancel_all()
        deadline = time.monotonic() + _FLUSH_S
        while (loop.outstanding or state.open_responses) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.uvicorn.should_exit = True

    def shutdown(self) -> None:
        """Ends the server now (from any thread): cancels what runs, no grace period."""
        self.uvicorn.should_exit = True


class ServerThread:
    """An `HTTPServer` run in a daemon thread: `start()` returns once it accepts
    connections; `stop()` shuts it down (the engine loop stops with it)."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self._thread = threading.Thread(target=server.run, name="hisparse-http", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the server to end (a drain, or `stop`); whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 60.0) -> None:
        self.server.shutdown()
        self._thread.join(timeout)
