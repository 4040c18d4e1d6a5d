"""The HTTP connection with the daemon's limits, which uvicorn's httptools parser lacks: without
them any local user could use up the daemon's descriptors with idle connections, or its memory
with one endless header. So: past ``max_connections`` a new connection closes the longest-idle
one, or is refused with 503 when all are busy; a head over ``MAX_HEADER_BYTES`` gets 431; a
connection has ``REQUEST_TIMEOUT_S`` to deliver a whole request (an idle one is closed, a
dribbled header gets 408). A refusal is followed by a lingering close, so that the client reads
the answer instead of a reset."""

from __future__ import annotations

import asyncio
import json
import resource
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from advisor.daemon._config import MAX_HEADER_BYTES, REQUEST_TIMEOUT_S, connection_limit

# How long a refused connection drains the client's bytes before it closes.
_LINGER_S = 2.0
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def limited_protocol() -> type[_LimitedProtocol]:
    """uvicorn's httptools protocol class with the limits (pass it as ``uvicorn.Config(http=...)``);
    ``max_connections`` follows from this process's descriptor limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return type("LimitedHttpProtocol", (_LimitedProtocol,), {"max_connections": connection_limit(soft)})


class _LimitedProtocol(HttpToolsProtocol):
    max_connections: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting_since = 0.0  # when it began waiting for its current request
        self._in_head = True  # reading a request's line and headers
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False  # answered with a refusal: input is dropped until it closes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if len(self.connections) <= self.max_connections:
            return
        idle = [c for c in self.connections
                if c is not self and isinstance(c, _LimitedProtocol) and c._idle()]
        if idle:
            min(idle, key=lambda c: c._waiting_since)._close()
        else:
            self._refuse(503, f"the daemon has {self.max_connections} connections open, each busy with a "
                              "request; try again shortly")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _idle(self) -> bool:
        """Open, and neither handling a request nor receiving one's body."""
        busy = self.cycle is not None and not self.cycle.response_complete
        return self._in_head and not busy and not self.transport.is_closing()

    def _close(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # draining before the close
        counted = self._in_head
        if counted:
            self._head_bytes += len(data)
        super().data_received(data)
        # Checked after the parser has had the data, so that a head and a body arriving
        # together count only as far as the head: the parser has said where it ended.
        if self._in_head and counted and self._head_bytes > MAX_HEADER_BYTES:
            self._refuse(431, f"the request's line and headers are over {MAX_HEADER_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()  # the whole request is in: the application's time is not the client's
        self._in_head = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._refused:
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._waiting_since = self.loop.time()
        self._deadline = self.loop.call_later(REQUEST_TIMEOUT_S, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._refused:
            return
        if self._head_bytes:
            self._refuse(408, f"the request did not arrive within {REQUEST_TIMEOUT_S:g} s")
        else:
            self._close()  # nothing sent (or a body left unfinished): nothing to answer

    def _refuse(self, status: int, detail: str) -> None:
        """Answer ``status`` and close (lingering); a connection mid-answer is just closed."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        self._refused = True
        body = json.dumps({"detail": detail}).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body)))
        self.transport.write(head + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self._close)
