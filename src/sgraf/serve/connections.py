"""How `sgraf serve` holds its connections: uvicorn's HTTP/1.1 protocol with three limits added.

uvicorn waits without end for a request's headers: a client that opens a connection and sends
half a request, or nothing, holds it (and a file descriptor) for as long as it likes, and about
a thousand such clients made the server answer nobody and log a traceback per refused accept
("Too many open files"). `GuardedProtocol` (uvicorn's `http=` class) adds:

- a deadline for each request (`HEADER_TIMEOUT_S`: its line, headers and any body), from the
  connection's start or from the first byte of a later request on a kept-alive connection; a
  client that misses it is disconnected, once the answer is sent if one is being computed (a
  body sent a byte at a time had held a connection open; uvicorn's own keep-alive timeout still
  closes idle connections between requests);
- a deadline for an answer to leave (`WRITE_TIMEOUT_S`): a client that stops reading while its
  answer is sent (a full send buffer that does not drain) is disconnected. A client that sent
  requests one after the other and never read the answers had held its connection, and the
  kernel memory of its unsent answer, without end; enough of them held every place. When the
  server stops, such connections are dropped at once (their tasks had outlived the stop and
  logged a traceback each);
- a cap on open connections (`connection_cap`: below the process's file descriptor limit, two
  descriptors a connection: its socket and a file it may be sending), past which a new
  connection is closed at once, with one warning line per `WARN_EVERY_S`;
- uvicorn's answer to a malformed request (bad request line, headers too large, bytes that are
  not HTTP) as JSON with the server's security headers, like every other error.

Beside it, `raise_descriptor_limit` lifts the process's soft descriptor limit towards its hard
one (as servers do: 1,024 is a common default), and `quiet_accept_errors` turns asyncio's
traceback per failed accept (it retries up to its backlog in one go) into one line per
`WARN_EVERY_S`.

Behind a reverse proxy (nginx, Caddy) the proxy buffers whole requests and these limits are
rarely reached; served straight on a public address, they keep slow clients from taking the
server.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

try:
    import resource        # POSIX: the descriptor limit
except ImportError:        # Windows: no such limit to read or raise
    resource = None  # type: ignore[assignment]

logger = logging.getLogger("sgraf.serve")

HEADER_TIMEOUT_S = 10.0    # a request's line and headers must arrive within this
WRITE_TIMEOUT_S = 15.0     # an answer's full send buffer must start draining within this
MAX_CONNECTIONS = 4096     # open connections at most (fewer where the descriptor limit is lower)
DESCRIPTORS_WANTED = 65536 # the soft descriptor limit a server raises itself to, where the hard one allows
SPARE_DESCRIPTORS = 64     # descriptors kept free for the index, the models, logs and the listener
MACOS_OPEN_MAX = 10240     # the most a macOS process may ask for (OPEN_MAX), below its RLIM_INFINITY hard limit
WARN_EVERY_S = 10.0        # at most one "refusing connections" line this often


def connection_cap(limit: int = MAX_CONNECTIONS) -> int:
    """The open connections the server keeps at most: `limit`, or fewer so that the process's
    soft file-descriptor limit (RLIMIT_NOFILE) keeps `SPARE_DESCRIPTORS` free beside the ones it
    has open now, counting two a connection (its socket, and the picture or static file it may be
    sending: at one a connection, clients that stopped reading such files had run the server out
    of descriptors); at least 8."""
    if resource is None:
        return limit
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 32
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(8, min(limit, (soft - open_now - SPARE_DESCRIPTORS) // 2))


def raise_descriptor_limit(wanted: int = DESCRIPTORS_WANTED) -> int:
    """Raises the soft RLIMIT_NOFILE to `wanted` or the hard limit, whichever is lower (never
    lowers it); returns the soft limit now (0 where the system has no such limit)."""
    if resource is None:
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        # macOS refuses more than OPEN_MAX (10,240) whatever the hard limit says: then that
        for attempt in (target, min(target, MACOS_OPEN_MAX)):
            if attempt <= soft:
                break
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (attempt, hard))
                soft = attempt
                break
            except (ValueError, OSError):
                continue
    return soft


class _Sparing:
    """Counts an event and warns of it at most once per `WARN_EVERY_S` (the message's last
    argument: the count so far)."""

    def __init__(self, message: str) -> None:
        self.message, self.count, self.warned = message, 0, 0.0

    def __call__(self, *args: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.warned >= WARN_EVERY_S:
            logger.warning(self.message, *args, self.count)
            self.warned = now


def quiet_accept_errors(loop: Any) -> None:
    """An exception handler for `loop`: asyncio's "socket.accept() out of system resource"
    (no descriptor left) becomes one warning line per `WARN_EVERY_S`, without its traceback;
    everything else goes to the default handler."""
    say = _Sparing("cannot accept connections: %s (%d times so far); the open ones are kept")

    def handler(loop: Any, context: dict[str, Any]) -> None:
        if context.get("message") == "socket.accept() out of system resource":
            say(context.get("exception"))
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _cancelled(timer: Any) -> None:
    """Cancels an event loop timer, if any; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()


def guarded_protocol(security_headers: dict[str, str], cap: int | None = None,
                     header_timeout: float = HEADER_TIMEOUT_S, write_timeout: float = WRITE_TIMEOUT_S) -> type:
    """uvicorn's h11 protocol class with the limits above (see the module docstring).

    Args:
        security_headers: sent with the JSON answer to a malformed request.
        cap: open connections at most (default `connection_cap()`).
        header_timeout: seconds a request's headers may take to arrive.
        write_timeout: seconds an answer's full send buffer may wait for the client to read.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    most = connection_cap() if cap is None else cap
    refused = _Sparing("refusing new connections: %d open, the most sgraf serve keeps (%d refused so far)")
    stalled = _Sparing("dropped a connection whose client read nothing of its answer for %.0f s (%d so far)")

    class GuardedProtocol(H11Protocol):
        _header_timer: Any = None
        _write_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > most:
                refused(most)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):   # the request (or its body) still to come
                self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._stop_write_timer()
            super().connection_lost(exc)

        def pause_writing(self) -> None:       # the transport's buffer is full: the client must read
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._write_late)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stop_write_timer()

        def _stop_write_timer(self) -> None:
            self._write_timer = _cancelled(self._write_timer)

        def _write_late(self) -> None:
            self._write_timer = None
            if self.flow is not None and self.flow.write_paused and not self.transport.is_closing():
                stalled(write_timeout)
                self.transport.abort()              # its unsent answer goes too

        def shutdown(self) -> None:
            if self.flow is not None and self.flow.write_paused:   # nobody reads it: waiting would outlast the stop
                self.transport.abort()
                return
            super().shutdown()

        def _arm(self) -> None:
            if self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            self._header_timer = _cancelled(self._header_timer)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                if self.cycle is None or self.cycle.response_complete:
                    self.transport.close()
                else:                                  # its answer is being computed: close once it is sent
                    self.cycle.keep_alive = False

        def send_400_response(self, msg: str) -> None:
            body = json.dumps({"error": f"{msg.rstrip('.')}: not an HTTP/1.1 request this server can read"}).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode()),
                       *((name.encode("latin-1"), value.encode("latin-1")) for name, value in security_headers.items())]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                                 reason=b"Bad Request")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:     # h11 cannot answer in its state: close as uvicorn does
                pass
            if self.cycle is not None and not self.cycle.response_complete:
                # a request whose body turned out malformed is being answered by the app: its answer
                # has nowhere to go now (sending it raised in h11 and logged two tracebacks a request)
                self.cycle.disconnected = True
            self.transport.close()

    return GuardedProtocol
