"""The HTTP transport of `mlx_dllm serve`: uvicorn (h11) serving the Starlette app on a socket
bound at once, on the thread that calls `serve_forever`.

What the standard library's server lacked, and bursts and idle clients showed: HTTP/1.1 with
keep-alive, a listen backlog of BACKLOG (bursts of clients are queued by the kernel, not reset),
and bounds on what a connection may hold: its request's headers must arrive within
`header_timeout` seconds (of the connection's start, or of the previous answer), its body within
`body_timeout` (app.py), an idle keep-alive connection is closed after `idle_timeout`, and beyond
`max_connections` open connections a new one gets a 503. Every answer the transport writes itself
(a request line or header it cannot parse, the connection cap) is an OpenAI error object.
"""

import asyncio
import concurrent.futures
import json
import logging
import socket
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .fields import error_body
from .limits import Limits

logger = logging.getLogger(__name__)

BACKLOG = 2048


def raw_error(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer carrying an OpenAI error, its connection then closed."""
    body = json.dumps(error_body(message, status)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a connection cap and JSON errors."""

    limits = Limits()

    def connection_made(self, transport):
        super().connection_made(transport)
        self.header_timer = None
        if len(self.connections) > self.limits.max_connections:
            message = (
                f"the server holds {self.limits.max_connections} connections, its most (the "
                "server's --max-connections); try again shortly"
            )
            transport.write(raw_error(503, "Service Unavailable", message))
            transport.close()
            return
        self._arm()

    def _arm(self):
        self._disarm()
        self.header_timer = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _disarm(self):
        if getattr(self, "header_timer", None) is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_late(self):
        self.header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self):
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers came whole
            self._disarm()

    def on_response_complete(self):
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers have as long

    def connection_lost(self, exc):
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            message = "the request could not be read as HTTP/1.1 (a bad request line or header)"
            self.transport.write(raw_error(400, "Bad Request", message))
        self.transport.close()


# Files the process keeps open besides its connections (the model's, the libraries', the logs').
OTHER_FILES = 256


def fit_open_files(max_connections: int) -> None:
    """Raise the process's soft limit on open files to hold `max_connections` connections (macOS
    starts at 256), as far as the hard limit lets; a warning where it cannot."""
    try:
        import resource
    except ImportError:  # not POSIX: the platform's own limit holds
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + OTHER_FILES
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
        if soft < need:
            logger.warning(
                "the open-file limit (%d) holds fewer than --max-connections %d connections; "
                "raise it (ulimit -n) or lower --max-connections",
                soft,
                max_connections,
            )


class HTTPServer:
    """The app on `host`:`port` (bound here: `server_address` is known, a taken port raises
    OSError), served by `serve_forever()` until `shutdown()`; `server_close()` stops accepting
    connections first (the answers in flight still go out)."""

    def __init__(self, app, host: str, port: int, limits: Limits = Limits()):
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = info[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        self.socket = sock
        self.server_address = sock.getsockname()[:2]
        protocol = type("Protocol", (GuardedProtocol,), {"limits": limits})
        config = uvicorn.Config(
            app,
            http=protocol,
            ws="none",
            lifespan="off",
            loop="asyncio",
            log_config=None,
            access_log=False,  # app.py writes one line per request
            timeout_keep_alive=limits.idle_timeout,
            timeout_graceful_shutdown=1,
            backlog=BACKLOG,
        )
        self.uvicorn = uvicorn.Server(config)
        self.loop = None
        self.started = threading.Event()
        self.stopped = threading.Event()

    def serve_forever(self):
        try:
            asyncio.run(self._serve())
        finally:
            self.stopped.set()

    async def _serve(self):
        self.loop = asyncio.get_running_loop()
        self.started.set()
        await self.uvicorn.serve(sockets=[self.socket])

    def server_close(self):
        """Stop accepting connections (those open are answered)."""
        if self.loop is not None and not self.stopped.is_set():

            async def close():
                for server in getattr(self.uvicorn, "servers", ()):
                    server.close()

            try:  # on the loop's thread, which watches the socket
                asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=5)
            except (RuntimeError, concurrent.futures.TimeoutError):  # the loop has ended
                pass
        self.socket.close()

    def shutdown(self):
        """End serve_forever (open connections closed once their answers are out)."""
        self.uvicorn.should_exit = True
        if self.started.is_set():
            self.stopped.wait()
