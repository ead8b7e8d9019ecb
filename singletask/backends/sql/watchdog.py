"""A client-side deadline for blocking driver calls: the SQL stores' bound on a stalled server.

A driver blocked reading a socket (psycopg has no read timeout) returns as soon as the socket is
shut down; :class:`Watchdog` does that (through the ``expire`` callback a store gives it) when a
call outlives its deadline.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["WATCHDOG", "Watchdog"]


class _Alarm:
    """One deadline of a :class:`Watchdog`: ``expire`` runs once if it passes while armed."""

    def __init__(self, expire: Callable[[], None]) -> None:
        self._expire = expire
        self._lock = threading.Lock()
        self._armed = True
        self.fired = False

    def fire(self) -> None:
        with self._lock:  # disarm() waits for a running expire: it never outlives the guard
            if self._armed:
                self._armed, self.fired = False, True
                with contextlib.suppress(Exception):
                    self._expire()

    def disarm(self) -> None:
        with self._lock:
            self._armed = False


class Watchdog:
    """Bounds a blocking driver call on the client: one daemon thread per process runs the
    ``expire`` callback of a :meth:`guard` whose deadline passed (typically: shut the
    connection's socket down, so the blocked read returns at once)."""

    def __init__(self) -> None:
        self._pid = 0
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Alarm]] = []
        self._count = itertools.count()

    def _start(self) -> None:
        # First use, or a forked child (its parent's thread did not survive the fork).
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._heap = []
        thread = threading.Thread(
            target=self._loop, args=(self._cond, self._heap), name="singletask-sql-watchdog",
            daemon=True,
        )  # fmt: skip
        thread.start()

    @staticmethod
    def _loop(cond: threading.Condition, heap: list[tuple[float, int, _Alarm]]) -> None:
        while True:
            with cond:
                while not heap:
                    cond.wait()
                wait = heap[0][0] - time.monotonic()
                if wait > 0:  # waking at most 20 times a second, however many calls run
                    cond.wait(max(wait, 0.05))
                    continue
                alarm = heapq.heappop(heap)[2]
            alarm.fire()

    @contextmanager
    def guard(self, seconds: float, expire: Callable[[], None]) -> Iterator[_Alarm]:
        """Run ``expire`` if the block is still running after ``seconds``; the alarm yielded
        tells (``fired``) whether it ran."""
        if self._pid != os.getpid():
            self._start()
        alarm = _Alarm(expire)
        entry = (time.monotonic() + seconds, next(self._count), alarm)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:  # the thread sleeps until a later deadline, if any
                self._cond.notify()
        try:
            yield alarm
        finally:
            alarm.disarm()  # a disarmed alarm is dropped from the heap when its time comes


#: Each process's watchdog, shared by its SQL stores.
WATCHDOG = Watchdog()
