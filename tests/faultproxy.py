"""A TCP fault proxy for tests: a lock store seen through a link the test controls.

A :class:`FaultProxy` listens on a free loopback port and forwards every connection to a target
server (Redis, PostgreSQL, MariaDB, memcached: it reads no protocol). While connections are open,
the test can change what the link does:

* :meth:`~FaultProxy.delay_replies` / :meth:`~FaultProxy.delay_requests`: bytes from the server
  (or to it) are held that many seconds after they arrive. With a reply delay the server has
  already acted when the client sees its answer late (or gives up on it). The delay is read when
  a byte is due, so changing it re-times what is held (``delay_replies(0)`` lets it all go), and
  ``after=n`` lets the next ``n`` reads pass first (with one request in flight at a time, one
  read is one reply: ``delay_replies(60, after=1)`` holds the reply to the second request).
* :meth:`~FaultProxy.delay_reply_to`: only the reply to a request containing given bytes is held
  (``delay_reply_to(b"EVALSHA", 1.5)``: the next script call is answered late, once), everything
  else passes at once.
* :meth:`~FaultProxy.stall` / :meth:`~FaultProxy.resume`: nothing is forwarded either way, open
  connections stay open, and new ones are accepted but not connected onward (a black-holed
  link, or a server that hangs). :meth:`~FaultProxy.resume` forwards what was held.
* :meth:`~FaultProxy.cut`: every open connection is reset (RST to both ends); the proxy keeps
  listening, so the next connect works.
* :meth:`~FaultProxy.stop` / :meth:`~FaultProxy.start`: the port is closed (connects are
  refused) and open connections are cut; :meth:`~FaultProxy.start` listens on the same port.
* :meth:`~FaultProxy.repoint`: new connections go to another server (a failover behind a fixed
  address); ``cut=True`` also resets the connections to the old one.

:meth:`~FaultProxy.url_for` rewrites a store URL to go through the proxy. Every control takes
effect before it returns. One thread serves every connection (a selector loop); it exists only
while the proxy listens or has connections, and :meth:`~FaultProxy.close` (or leaving the ``with``
block) stops it and frees every socket.

No new dependency: the standard library only. ``tests/e2e/proxy.py`` re-exports this class as
``TcpProxy``.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import struct
import threading
import time
import weakref
from collections import deque
from types import TracebackType
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from .servers import free_port

#: (host, port) of a server.
Address = tuple[str, int]
_Proxy = TypeVar("_Proxy", bound="FaultProxy")

_CHUNK = 65536
#: Bytes held per direction of one connection before the proxy stops reading its source.
_HELD_LIMIT = 1 << 20
#: SO_LINGER on, 0 seconds: close() sends a reset instead of a FIN.
_RESET = struct.pack("ii", 1, 0)
#: Which delay a held chunk waits for: its direction's, none, or that of delay_reply_to.
_DELAYED, _EXEMPT, _TRIGGERED = 0, 1, 2


class _Direction:
    """One direction of a forwarded connection: chunks read from its source, each with the time
    it may be sent to the sink."""

    __slots__ = ("blocked", "chunks", "eof", "held", "shut")

    def __init__(self) -> None:
        #: (arrival time, data, which delay applies: _DELAYED, _EXEMPT or _TRIGGERED)
        self.chunks: deque[tuple[float, bytes, int]] = deque()
        self.held = 0  # bytes in chunks
        self.eof = False  # the source sent its FIN
        self.shut = False  # the FIN was passed on (shutdown(SHUT_WR) of the sink)
        self.blocked = False  # the sink's send buffer was full at the last send


class _Connection:
    """A client connection and its connection to the server (None until connected)."""

    __slots__ = (
        "client",
        "closed",
        "connecting",
        "down",
        "masks",
        "seen",
        "server",
        "triggered",
        "up",
    )

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.server: socket.socket | None = None
        self.connecting = False
        self.closed = False
        self.up = _Direction()  # client -> server (requests)
        self.down = _Direction()  # server -> client (replies)
        self.masks: dict[socket.socket, int] = {}  # selector events registered per socket
        self.seen = b""  # the last request bytes, to find a trigger split over two reads
        self.triggered = 0  # replies to hold for delay_reply_to

    def sockets(self) -> list[socket.socket]:
        return [self.client] if self.server is None else [self.client, self.server]


class FaultProxy:
    """Forwards ``host``:``port`` (default: 127.0.0.1 and a free port) to ``target``.

    The proxy listens as soon as it is created (``listen=False``: after :meth:`start`). Use it as
    a context manager, or call :meth:`close`, to stop its thread and close its sockets.
    """

    def __init__(
        self,
        target: Address,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        listen: bool = True,
    ) -> None:
        self.target: Address = target
        self.host = host
        self.port = port or free_port()
        #: Connections accepted since the proxy was created.
        self.accepted = 0
        self._reply_delay = 0.0
        self._request_delay = 0.0
        self._replies_exempt = 0  # reads from servers that pass the reply delay
        self._requests_exempt = 0
        self._trigger = b""  # delay_reply_to: the request bytes ...
        self._triggers_left = 0  # ... how many more requests it applies to ...
        self._trigger_delay = 0.0  # ... and the delay of their replies
        self._stalled = False
        self._closed = False
        self._mutex = threading.RLock()
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        for end in (self._wake_reader, self._wake_writer):
            end.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
        self._listener: socket.socket | None = None
        self._connections: set[_Connection] = set()
        self._thread: threading.Thread | None = None
        self._finalizer = weakref.finalize(
            self, _release, self._selector, self._wake_reader, self._wake_writer
        )
        if listen:
            self.start()

    # -- construction helpers -------------------------------------------------------------------

    @classmethod
    def for_url(cls: type[_Proxy], url: str) -> tuple[_Proxy, str]:
        """A proxy to the server of ``url``, and ``url`` rewritten to go through it."""
        proxy = cls(address_of(url))
        return proxy, proxy.url_for(url)

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's (user, password, path, query
        and fragment kept as they are)."""
        parts = urlsplit(url)
        userinfo, _, _ = parts.netloc.rpartition("@")
        netloc = f"{self.host}:{self.port}"
        return urlunsplit(parts._replace(netloc=f"{userinfo}@{netloc}" if userinfo else netloc))

    @property
    def address(self) -> Address:
        """Where clients connect."""
        return (self.host, self.port)

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._mutex:
            return len(self._connections)

    @property
    def held_replies(self) -> int:
        """Bytes from servers the proxy holds now (delayed or stalled)."""
        with self._mutex:
            return sum(c.down.held for c in self._connections)

    @property
    def held_requests(self) -> int:
        """Bytes to servers the proxy holds now (delayed, stalled or not yet connected)."""
        with self._mutex:
            return sum(c.up.held for c in self._connections)

    @property
    def listening(self) -> bool:
        with self._mutex:
            return self._listener is not None

    # -- controls -------------------------------------------------------------------------------

    def delay_replies(self, seconds: float, *, after: int = 0) -> None:
        """Hold every byte from the server until ``seconds`` after it arrived (0: no delay),
        bytes already held included; the next ``after`` reads from servers pass at once."""
        with self._mutex:
            self._replies_exempt = max(0, after)
        self._set(reply_delay=seconds)

    def delay_requests(self, seconds: float, *, after: int = 0) -> None:
        """Hold every byte to the server until ``seconds`` after it arrived (0: no delay),
        bytes already held included; the next ``after`` reads from clients pass at once."""
        with self._mutex:
            self._requests_exempt = max(0, after)
        self._set(request_delay=seconds)

    def delay_reply_to(self, request: bytes, seconds: float, *, times: int = 1) -> None:
        """Hold the reply to each of the next ``times`` requests containing ``request`` (on any
        connection) until ``seconds`` after it arrived; every other byte passes as before.

        The reply is the first read from the server on that connection after the request was
        read (one request in flight at a time, as for ``after``); ``request`` is found even if it
        is split over two reads. The delay is read when the reply is due, so ``heal()`` or
        ``delay_reply_to(request, 0)`` lets a held reply go.
        """
        if not request:
            raise ValueError("delay_reply_to needs the bytes of a request")
        with self._mutex:
            self._trigger = request
            self._triggers_left = max(0, times)
            self._trigger_delay = max(0.0, seconds)
            for connection in self._connections:
                connection.seen = b""
        self._wake()

    def stall(self) -> None:
        """Forward nothing either way, keep connections open, accept new ones but do not connect
        them onward, until :meth:`resume`."""
        self._set(stalled=True)

    def resume(self) -> None:
        """End a :meth:`stall`: what was held is forwarded, accepted connections connect."""
        self._set(stalled=False)

    def heal(self) -> None:
        """No stall and no delays, :meth:`delay_reply_to` included (connections that were cut
        stay cut)."""
        with self._mutex:
            self._triggers_left = 0
            self._trigger_delay = 0.0
        self._set(stalled=False, reply_delay=0.0, request_delay=0.0)

    def cut(self) -> None:
        """Reset every open connection (both ends see a connection reset); keep listening."""
        with self._mutex:
            for connection in list(self._connections):
                self._drop(connection, reset=True)
        self._wake()

    def repoint(self, target: Address, *, cut: bool = False) -> None:
        """Send new connections to ``target``; with ``cut``, reset the open ones too (their
        clients reconnect, to ``target``)."""
        with self._mutex:
            self.target = target
        if cut:
            self.cut()

    def stop(self) -> None:
        """Close the listening port (connects are refused) and cut every open connection."""
        with self._mutex:
            listener, self._listener = self._listener, None
            if listener is not None:
                self._selector.unregister(listener)
                listener.close()
        self.cut()

    def start(self) -> None:
        """Listen on :attr:`port` (again). Does nothing if the proxy listens already."""
        with self._mutex:
            if self._closed:
                raise RuntimeError("the proxy is closed")
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((self.host, self.port))
                listener.listen(128)
                listener.setblocking(False)
            except OSError:
                listener.close()
                raise
            self._listener = listener
            self._selector.register(listener, selectors.EVENT_READ, None)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"faultproxy-{self.port}", daemon=True
                )
                self._thread.start()
        self._wake()

    def close(self) -> None:
        """Stop listening, cut every connection, end the thread and close every socket."""
        self.stop()
        with self._mutex:
            self._closed = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)
        self._finalizer()

    def __enter__(self: _Proxy) -> _Proxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FaultProxy {self.host}:{self.port} -> {self.target[0]}:{self.target[1]}>"

    # -- the loop -------------------------------------------------------------------------------

    def _set(
        self,
        *,
        stalled: bool | None = None,
        reply_delay: float | None = None,
        request_delay: float | None = None,
    ) -> None:
        with self._mutex:
            if reply_delay is not None:
                self._reply_delay = max(0.0, reply_delay)
            if request_delay is not None:
                self._request_delay = max(0.0, request_delay)
            if stalled is not None:
                self._stalled = stalled
                if not stalled:
                    for connection in list(self._connections):
                        if connection.server is None:
                            self._connect(connection)
            for connection in list(self._connections):
                self._update_interest(connection)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            self._wake_writer.send(b"\0")

    def _run(self) -> None:
        while True:
            with self._mutex:
                if self._closed or (self._listener is None and not self._connections):
                    self._thread = None
                    return
                timeout = self._next_release()
            events = self._selector.select(timeout)
            with self._mutex:
                for key, mask in events:
                    self._handle(key, mask)
                for connection in list(self._connections):
                    self._flush(connection)
                for connection in list(self._connections):
                    self._update_interest(connection)

    def _next_release(self) -> float | None:
        """Seconds until the next held chunk may be sent (None: nothing is waiting on time)."""
        if self._stalled:
            return None
        soonest: float | None = None
        for connection in self._connections:
            for direction, delay in (
                (connection.up, self._request_delay),
                (connection.down, self._reply_delay),
            ):
                if direction.chunks and not direction.blocked:
                    arrived, _, kind = direction.chunks[0]
                    at = arrived + self._delay_of(kind, delay)
                    soonest = at if soonest is None else min(soonest, at)
        return None if soonest is None else max(0.0, soonest - time.monotonic())

    def _handle(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.fileobj is self._wake_reader:
            with contextlib.suppress(OSError):
                while self._wake_reader.recv(4096):
                    pass
            return
        if key.data is None:  # a listener (maybe one closed since select returned)
            if key.fileobj is self._listener:
                self._accept(self._listener)
            return
        connection: _Connection = key.data
        if connection.closed:
            return
        sock = key.fileobj
        assert isinstance(sock, socket.socket)
        if sock is connection.server and connection.connecting:
            if mask & selectors.EVENT_WRITE:
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:  # the server refused: the client sees a reset
                    self._drop(connection, reset=True)
                else:
                    connection.connecting = False
            return
        if mask & selectors.EVENT_READ:
            self._read(connection, sock)
        if mask & selectors.EVENT_WRITE and not connection.closed:
            (connection.up if sock is connection.server else connection.down).blocked = False

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(client)
            self._connections.add(connection)
            self.accepted += 1
            if not self._stalled:
                self._connect(connection)
            self._update_interest(connection)

    def _connect(self, connection: _Connection) -> None:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setblocking(False)
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.server = server
        error = server.connect_ex(self.target)
        if error in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            connection.connecting = error != 0
        else:
            self._drop(connection, reset=True)

    def _read(self, connection: _Connection, sock: socket.socket) -> None:
        from_client = sock is connection.client
        direction = connection.up if from_client else connection.down
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by that end: pass the reset on
            self._drop(connection, reset=True)
            return
        if not data:
            direction.eof = True
            return
        kind = _DELAYED
        if from_client:
            if self._triggers_left:
                self._watch(connection, data)
            if self._requests_exempt > 0:
                self._requests_exempt -= 1
                kind = _EXEMPT
        elif connection.triggered:
            connection.triggered -= 1
            kind = _TRIGGERED
        elif self._replies_exempt > 0:
            self._replies_exempt -= 1
            kind = _EXEMPT
        direction.chunks.append((time.monotonic(), data, kind))
        direction.held += len(data)

    def _watch(self, connection: _Connection, data: bytes) -> None:
        """Arm ``connection`` to hold its next reply if ``data`` completes a trigger request."""
        window = connection.seen + data
        if self._trigger in window:
            connection.triggered += 1
            self._triggers_left -= 1
            window = b""  # a trigger is counted once
        connection.seen = window[-(len(self._trigger) - 1) :] if len(self._trigger) > 1 else b""

    def _delay_of(self, kind: int, delay: float) -> float:
        """The delay a held chunk waits for, ``delay`` being its direction's."""
        if kind == _TRIGGERED:
            return self._trigger_delay
        return 0.0 if kind == _EXEMPT else delay

    def _flush(self, connection: _Connection) -> None:
        """Send what is due, pass FINs on, close a connection both ends have finished."""
        if self._stalled or connection.closed:
            return
        now = time.monotonic()
        server = None if connection.connecting else connection.server
        for direction, sink, delay in (
            (connection.up, server, self._request_delay),
            (connection.down, connection.client, self._reply_delay),
        ):
            if sink is None:
                continue
            while direction.chunks and not direction.blocked:
                arrived, data, kind = direction.chunks[0]
                if arrived + self._delay_of(kind, delay) > now:
                    break
                try:
                    sent = sink.send(data)
                except (BlockingIOError, InterruptedError):
                    direction.blocked = True
                    break
                except OSError:
                    self._drop(connection, reset=True)
                    return
                direction.held -= sent
                if sent < len(data):
                    direction.chunks[0] = (arrived, data[sent:], kind)
                    direction.blocked = True
                else:
                    direction.chunks.popleft()
            if direction.eof and not direction.chunks and not direction.shut:
                direction.shut = True
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
        if connection.up.shut and connection.down.shut:
            self._drop(connection, reset=False)

    def _update_interest(self, connection: _Connection) -> None:
        if connection.closed:
            return
        flowing = not self._stalled
        up, down = connection.up, connection.down
        wanted = {
            connection.client: (
                (selectors.EVENT_READ if flowing and not up.eof and up.held < _HELD_LIMIT else 0)
                | (selectors.EVENT_WRITE if down.blocked else 0)
            )
        }
        if connection.server is not None:
            if connection.connecting:
                wanted[connection.server] = selectors.EVENT_WRITE
            else:
                reading = flowing and not down.eof and down.held < _HELD_LIMIT
                wanted[connection.server] = (selectors.EVENT_READ if reading else 0) | (
                    selectors.EVENT_WRITE if up.blocked else 0
                )
        for sock, mask in wanted.items():
            current = connection.masks.get(sock, 0)
            if mask == current:
                continue
            if not current:
                self._selector.register(sock, mask, connection)
            elif not mask:
                self._selector.unregister(sock)
            else:
                self._selector.modify(sock, mask, connection)
            connection.masks[sock] = mask

    def _drop(self, connection: _Connection, *, reset: bool) -> None:
        """Close both ends of ``connection``; with ``reset``, as a connection reset."""
        if connection.closed:
            return
        connection.closed = True
        self._connections.discard(connection)
        for sock in connection.sockets():
            if connection.masks.get(sock):
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(sock)
            if reset:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            sock.close()
        connection.masks.clear()


def _release(
    selector: selectors.BaseSelector, wake_reader: socket.socket, wake_writer: socket.socket
) -> None:
    selector.close()
    wake_reader.close()
    wake_writer.close()


def address_of(url: str) -> Address:
    """The (host, port) a store URL names (both required)."""
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ValueError(f"no host and port in {url!r}")
    return (parts.hostname, parts.port)
