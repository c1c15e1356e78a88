"""The report endpoint's listening socket, in front of aiohttp's request handler: what aiohttp's
server (kopf's own HTTP stack) does not bound, built on asyncio's public API.

- **A connection cap**, in all and per peer address, counted from the moment a connection is
  accepted (before its TLS handshake) to the moment it ends: a connection over either cap is
  closed at once, before any TLS work. aiohttp has none; its TCPSite accepts without limit.
- **A TLS handshake deadline**: asyncio's `start_tls(ssl_handshake_timeout=...)`; aiohttp's
  TCPSite passes none (asyncio's default is 60 s).
- **A header deadline**: a connection must deliver a whole request head within HEADER_SECONDS
  of its handshake, or of the end of its last request plus the keep-alive idle time; aiohttp has
  no such deadline (a client sending one byte of header every few seconds would hold its
  connection for ever). The request handler (report_server.py) tells the listener when a request
  starts and ends.

Each TLS connection is handed to the protocol aiohttp's `web.Server` makes (AppRunner.server),
through `_Connection`, which passes every protocol call on and tells the listener when the
connection ends. What aiohttp does bound is set where it is made (report_server.py): the idle
keep-alive, the request line and header sizes, the body size."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("accelerate_operator")


@dataclass(frozen=True)
class Bounds:
    connections: int = 1024  # open at once, handshakes included
    connections_per_peer: int = 32  # from one address: a pod reports over one
    handshake_seconds: float = 5.0
    header_seconds: float = 10.0
    # Keep-alive between requests: above the longest pace pod 0 is told to report at
    # (contract.NEXT_REPORT_SECONDS, 15 s), so a reporting pod keeps its connection.
    idle_seconds: float = 20.0


class _Gate(asyncio.Protocol):
    """A plain TCP connection just accepted: the listener admits it (and starts its TLS
    handshake) or closes it."""

    def __init__(self, listener: Listener):
        self.listener = listener

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.listener.accepted(transport)  # type: ignore[arg-type]


class _Connection(asyncio.Protocol):
    """One TLS connection: aiohttp's handler for it, and the listener told when it ends."""

    def __init__(self, handler: asyncio.Protocol, listener: Listener, peer: str):
        self.handler, self.listener, self.peer = handler, listener, peer
        self.transport: asyncio.Transport | None = None
        self.raw: asyncio.Transport | None = None  # the TCP connection under the TLS one
        self.deadline: asyncio.TimerHandle | None = None
        self.lost = False  # ended (even before its handler was given it)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.listener.ended(self)
        if self.transport is not None:
            self.handler.connection_lost(exc)


class Listener:
    """Listens on (host, port) with `context`, handing each admitted TLS connection to a
    protocol from `make_handler` (aiohttp's web.Server). The module's docstring says what it
    bounds."""

    def __init__(self, make_handler: Callable[[], asyncio.Protocol], context: ssl.SSLContext,
                 bounds: Bounds = Bounds()):
        self.make_handler, self.context, self.bounds = make_handler, context, bounds
        self.peers: Counter[str] = Counter()
        self.connections: dict[Any, _Connection] = {}  # by TLS transport
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None

    @property
    def open(self) -> int:
        return sum(self.peers.values())

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (0 picks a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Gate(self), host, port, backlog=512)
        return self._server.sockets[0].getsockname()[1]

    def accepted(self, transport: asyncio.Transport) -> None:
        peer = str((transport.get_extra_info("peername") or ("?",))[0])
        if self.open >= self.bounds.connections or \
                self.peers[peer] >= self.bounds.connections_per_peer:
            transport.abort()
            return
        self.peers[peer] += 1
        task = asyncio.get_running_loop().create_task(self._handshake(transport, peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handshake(self, transport: asyncio.Transport, peer: str) -> None:
        connection = _Connection(self.make_handler(), self, peer)
        connection.raw, tls = transport, None
        try:
            tls = await asyncio.get_running_loop().start_tls(
                transport, connection, self.context, server_side=True,
                ssl_handshake_timeout=self.bounds.handshake_seconds)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError) as error:
            log.debug("report endpoint: a TLS handshake from %s failed: %r", peer, error)
        finally:
            if tls is None:  # failed, timed out, cancelled, or the peer went away
                transport.abort()
                self._forget(peer)
        if tls is None or connection.lost:
            return
        self.connections[tls] = connection
        connection.connection_made(tls)
        self._arm(connection, self.bounds.header_seconds)

    def _arm(self, connection: _Connection, seconds: float) -> None:
        if connection.deadline is not None:
            connection.deadline.cancel()
        connection.deadline = asyncio.get_running_loop().call_later(
            seconds, self._expired, connection)

    def _expired(self, connection: _Connection) -> None:
        """No whole request head in time: the TCP connection is closed (aiohttp has read all the
        client sent, so the peer gets a FIN, not a reset; no TLS close_notify to wait on), and
        reset if our last bytes are still unread HANDSHAKE seconds later."""
        if connection.raw is not None:
            connection.raw.close()
            asyncio.get_running_loop().call_later(self.bounds.handshake_seconds,
                                                  connection.raw.abort)

    def request_started(self, transport: Any) -> None:
        """A request's head has come (the handler runs): no deadline while it is handled."""
        connection = self.connections.get(transport)
        if connection is not None and connection.deadline is not None:
            connection.deadline.cancel()
            connection.deadline = None

    def request_ended(self, transport: Any, refused: bool = False) -> None:
        """The next request's head is due within the idle time and the header deadline; a
        refused request's connection (the answer says Connection: close) ends within the
        handshake deadline, whether or not the client completes the TLS shutdown."""
        connection = self.connections.get(transport)
        if connection is not None:
            self._arm(connection, self.bounds.handshake_seconds if refused
                      else self.bounds.idle_seconds + self.bounds.header_seconds)

    def ended(self, connection: _Connection) -> None:
        if connection.deadline is not None:
            connection.deadline.cancel()
        self.connections.pop(connection.transport, None)
        self._forget(connection.peer)

    def _forget(self, peer: str) -> None:
        self.peers[peer] -= 1
        if self.peers[peer] <= 0:
            del self.peers[peer]

    async def stop(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for connection in list(self.connections.values()):
            if connection.transport is not None:
                connection.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)
