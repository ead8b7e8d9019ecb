"""Gauges from the lock store: what is held now, read on a timer, served from the last read.

:class:`StoreCollector` reads the store in a thread of its own every ``interval`` seconds
(:meth:`StoreCollector.read` walks the locks under the prefix, and the follow-ups, debounce
windows and named limits where the store keeps them: :func:`singletask.ops.inventory.find_state`).
A scrape
never touches the store: it serves the last read, with ``singletask_store_up`` 0 and no store
gauges when that read failed or a read has been running longer than ``timeout``, so a slow or
unreachable store cannot hang a scrape nor show stale numbers as current.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...backends.base import LockBackend
from ...exceptions import UnsupportedOperation
from ..inventory import LimitRecord, find_locks, find_state
from .events import UNKNOWN, task_of_key

__all__ = ["LimitState", "StoreCollector", "TaskState"]

logger = logging.getLogger("singletask.exporter")


@dataclass
class TaskState:
    """What the store holds for one task name, at one read."""

    held: int = 0
    reserved: int = 0
    follow_ups: int = 0
    windows: int = 0
    #: When the oldest running hold and the oldest reservation were acquired (epoch seconds).
    oldest_hold: float | None = None
    oldest_reservation: float | None = None


@dataclass
class LimitState:
    """What the store holds of one named limit (by name and kind), at one read."""

    #: Units held (concurrency) or started in the current window (rate).
    used: int = 0
    #: The limit's size, as its last take gave it.
    size: int = 0


def _older(current: float | None, candidate: float | None) -> float | None:
    if candidate is None:
        return current
    return candidate if current is None else min(current, candidate)


class StoreCollector(Collector):
    """The store gauges, from the last read; register it in the exporter's registry."""

    def __init__(
        self, backend: LockBackend, prefix: str, *, interval: float, timeout: float | None = None
    ) -> None:
        if interval <= 0:
            raise ValueError(f"the store interval must be above 0 seconds, got {interval!r}")
        self.backend = backend
        self.prefix = prefix
        self.interval = interval
        self.timeout = interval if timeout is None else timeout
        #: Whether the follow-up, debounce window and named limit gauges are served (False once
        #: the store said it keeps no such records).
        self.reads_state = True
        self.states: dict[str, TaskState] | None = None
        self.tasks: set[str] = set()
        #: The named limits in use at the last read, by (name, kind).
        self.limits: dict[tuple[str, str], LimitState] = {}
        #: Every limit a read found, with the size it had when last found.
        self.limit_sizes: dict[tuple[str, str], int] = {}
        self.error: str | None = "not read yet"
        self.read_started: float | None = None
        self.read_seconds: float | None = None
        self.last_success: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first_read = threading.Event()
        self._failing = False
        #: Set when a read found that the store cannot list its locks (it is not read again).
        self.unsupported: UnsupportedOperation | None = None

    # -- reading ----------------------------------------------------------------------------

    def read(self) -> None:
        """Read the store once and keep what it holds for the next scrapes.

        Raises:
            UnsupportedOperation: The store cannot list its locks (memcached, also behind a
                Django cache).
        """
        started = time.monotonic()
        with self._lock:
            self.read_started = started
        states: dict[str, TaskState] | None = None
        limits: dict[tuple[str, str], LimitState] = {}
        error: str | None = None
        try:
            states = self._states(limits)
        except UnsupportedOperation:
            raise
        except Exception as exc:  # the store failed: reported as store_up 0, then read again
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            with self._lock:
                self.read_started = None
                self.read_seconds = time.monotonic() - started
        with self._lock:
            self.states, self.error = states, error
            if states is not None:
                self.last_success = time.time()
                self.tasks.update(states)
                self.limits = limits
                self.limit_sizes.update((name, limit.size) for name, limit in limits.items())
        # One line when reads start failing and one when they work again, not one per read.
        if error is not None and not self._failing:
            logger.warning("singletask exporter: reading the lock store failed: %s", error)
        elif error is None and self._failing:
            logger.warning("singletask exporter: the lock store is read again")
        self._failing = error is not None

    def _states(self, limits: dict[tuple[str, str], LimitState]) -> dict[str, TaskState]:
        """What the store holds per task name; the named limits in use go into ``limits``."""
        states: dict[str, TaskState] = {}

        def state(task: str | None, key: str) -> TaskState:
            name = task or task_of_key(key, self.prefix) or UNKNOWN
            return states.setdefault(name, TaskState())

        for record in find_locks(self.backend, self.prefix):
            since = record.acquired_at.timestamp() if record.acquired_at else None
            entry = state(record.task, record.key)
            if record.state == "reserved":
                entry.reserved += 1
                entry.oldest_reservation = _older(entry.oldest_reservation, since)
            else:
                entry.held += 1
                entry.oldest_hold = _older(entry.oldest_hold, since)
        if self.reads_state:
            try:
                kinds = ("follow_up", "window", "limit")
                for item in find_state(self.backend, self.prefix, kinds=kinds):
                    if item.kind == "follow_up":
                        state(item.task, item.key).follow_ups += 1
                    elif item.kind == "window" and item.detail.get("open", True):
                        state(item.task, item.key).windows += 1  # a closed one stays a while
                    elif item.kind == "limit":
                        named = LimitRecord.from_store(item, self.prefix)
                        limit = limits.setdefault((named.name, named.kind), LimitState())
                        limit.used += named.used
                        limit.size = max(limit.size, named.size)
            except UnsupportedOperation:  # a store that keeps no such records: no such gauges
                self.reads_state = False
        return states

    def start(self, wait: float = 0.0) -> None:
        """Read the store every ``interval`` seconds in a daemon thread, from now on; wait up to
        ``wait`` seconds for the first read (a store that hangs does not hold the start up).

        Raises:
            UnsupportedOperation: The first read found that the store cannot list its locks.
        """
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="singletask-store", daemon=True)
            self._thread.start()
        self._first_read.wait(wait)
        if self.unsupported is not None:
            raise self.unsupported

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.read()
            except UnsupportedOperation as exc:
                logger.error("singletask exporter: the lock store cannot be read: %s", exc)
                with self._lock:
                    self.states, self.error, self.unsupported = None, str(exc), exc
                return
            finally:
                self._first_read.set()
            self._stop.wait(self.interval)

    # -- scraping ---------------------------------------------------------------------------

    def up(self) -> bool:
        """Whether the last read succeeded and no read has been running longer than timeout."""
        with self._lock:
            stuck = (
                self.read_started is not None
                and time.monotonic() - self.read_started > self.timeout
            )
            return self.states is not None and not stuck

    def collect(self) -> Iterator[Metric]:
        up = self.up()
        with self._lock:
            states = dict(self.states or {}) if up else {}
            known = sorted(self.tasks)
            reads_state = self.reads_state
            limits, sizes = dict(self.limits), dict(self.limit_sizes)
            read_seconds, last_success = self.read_seconds, self.last_success
        yield GaugeMetricFamily(
            "singletask_store_up",
            "1 when the last read of the lock store succeeded and none is overdue, else 0",
            value=1.0 if up else 0.0,
        )
        if read_seconds is not None:
            yield GaugeMetricFamily(
                "singletask_store_read_duration_seconds",
                "How long the last read of the lock store took",
                value=read_seconds,
            )
        if last_success is not None:
            yield GaugeMetricFamily(
                "singletask_store_last_read_timestamp_seconds",
                "When the lock store was last read successfully (Unix time)",
                value=last_success,
            )
        if not up:
            return
        now = time.time()
        counts = (
            ("singletask_locks_held", "Executions holding their lock now", "held"),
            ("singletask_lock_reservations", "Locks reserved for messages not started yet",
             "reserved"),
            ("singletask_follow_ups_pending", "Follow-up runs claimed and not started yet",
             "follow_ups"),
            ("singletask_debounce_windows_open", "Debounce windows open now", "windows"),
        )  # fmt: skip
        for name, documentation, field in counts if reads_state else counts[:2]:
            family = GaugeMetricFamily(name, documentation, labels=["task"])
            for task in known:  # a task seen once stays at 0, so a graph drops instead of gaps
                entry = states.get(task)
                family.add_metric([task], float(getattr(entry, field)) if entry else 0.0)
            yield family
        ages = (
            ("singletask_oldest_hold_age_seconds",
             "Age of the oldest lock held by a running execution", "oldest_hold"),
            ("singletask_oldest_reservation_age_seconds",
             "Age of the oldest reservation (a message waiting to start)", "oldest_reservation"),
        )  # fmt: skip
        for name, documentation, field in ages:
            family = GaugeMetricFamily(name, documentation, labels=["task"])
            for task, entry in sorted(states.items()):
                since = getattr(entry, field)
                if since is not None:
                    family.add_metric([task], max(0.0, now - since))
            yield family
        if reads_state:
            yield from _limit_gauges(limits, sizes)


def _limit_gauges(
    limits: dict[tuple[str, str], LimitState], sizes: dict[tuple[str, str], int]
) -> Iterator[Metric]:
    """The named limit gauges: one series per limit and kind a read has found (a limit no
    longer in use stays, at 0 units, with the size it had when last found)."""
    used = GaugeMetricFamily(
        "singletask_limit_units_used",
        "Units of a named limit in use now: held (kind concurrency) or started in the current "
        "window (kind rate)",
        labels=["limit", "kind"],
    )
    size = GaugeMetricFamily(
        "singletask_limit_units_size",
        "Size of a named limit: units held at once (kind concurrency) or started per window "
        "(kind rate), as its last take gave it",
        labels=["limit", "kind"],
    )
    for name, kind in sorted(sizes):
        entry = limits.get((name, kind))
        used.add_metric([name, kind], float(entry.used) if entry else 0.0)
        size.add_metric([name, kind], float(entry.size if entry else sizes[(name, kind)]))
    yield used
    yield size
