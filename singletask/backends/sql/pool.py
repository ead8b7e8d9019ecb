"""The connection pool of the PostgreSQL and MySQL lock stores: at most ``pool_size``
connections per process, opened when first needed, never shared with a forked child."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from ...exceptions import BackendTimeout

__all__ = ["Pool"]

C = TypeVar("C")


class Pool(Generic[C]):
    """At most ``size`` connections of the current process, opened when first needed.

    A process forked from the one that opened them never uses (nor closes: that would end the
    parent's sessions) the parent's connections; it opens its own. A connection that saw an
    error, or that ``broken`` says is unusable, is closed, not reused: after a driver error its
    state is unknown.
    """

    def __init__(
        self,
        connect: Callable[[], C],
        close: Callable[[C], None],
        *,
        size: int,
        timeout: float,
        describe: str,
        broken: Callable[[C], bool] | None = None,
    ) -> None:
        self._connect = connect
        self._broken = broken
        self._close = close
        self._size = size
        self._timeout = timeout
        self._describe = describe
        self._mutex = threading.Lock()
        self._pid = os.getpid()
        self._idle: list[C] = []
        self._inherited: list[C] = []
        self._slots = threading.BoundedSemaphore(size)
        self.generation = 0  # bumped whenever the process (or close()) drops every connection

    def _own(self) -> None:
        if self._pid != os.getpid():  # forked: leave the parent's connections alone
            self._pid = os.getpid()
            # Kept referenced, never used: a driver finalising them here could end (or warn
            # about) sessions that belong to the parent.
            self._inherited.extend(self._idle)
            self._idle = []
            self._slots = threading.BoundedSemaphore(self._size)
            self._mutex = threading.Lock()
            self.generation += 1

    @contextmanager
    def connection(self) -> Iterator[C]:
        """Lend a connection for one operation (see :meth:`checkout`)."""
        with self.checkout() as (conn, _):
            yield conn

    @contextmanager
    def checkout(self) -> Iterator[tuple[C, bool]]:
        """Lend a connection for one operation, and whether it was used before (an idle
        connection can have been closed by the server meanwhile; a new one cannot).

        Raises:
            BackendTimeout: Every connection stayed busy for ``timeout`` seconds.
        """
        self._own()
        slots = self._slots
        if not slots.acquire(timeout=self._timeout):
            raise BackendTimeout(
                f"{self._describe}: no free connection within {self._timeout}s "
                f"(pool_size {self._size})"
            )
        try:
            with self._mutex:
                conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            if conn is None:
                conn = self._connect()
            try:
                yield conn, reused
            except BaseException:
                self._discard(conn)
                raise
            if self._broken is not None and self._broken(conn):
                self._discard(conn)
                return
            with self._mutex:
                if slots is self._slots:
                    self._idle.append(conn)
                else:  # close() ran meanwhile
                    self._discard(conn)
        finally:
            slots.release()

    def _discard(self, conn: C) -> None:
        with contextlib.suppress(Exception):  # best effort: it may be broken already
            self._close(conn)

    def clear(self) -> None:
        """Close every idle connection of this process (connections in use close on return)."""
        self._own()
        with self._mutex:
            idle, self._idle = self._idle, []
            self._slots = threading.BoundedSemaphore(self._size)
            self.generation += 1
        for conn in idle:
            self._discard(conn)
