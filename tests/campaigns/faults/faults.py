"""The faults a campaign injects, and the seeded schedule that draws them.

Each injector blocks for the fault's duration and returns the :class:`~.history.Fault` it
caused. The schedule (:func:`inject_until`) draws, from one ``random.Random(seed)``, the pause
before each fault, its kind among those the store's environment offers, its target and its
duration: the same seed replays the same schedule (the workers' timing still varies).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from .history import Fault

__all__ = ["InProcessLink", "Injector", "inject_until", "link_faults", "pause_fault"]

logger = logging.getLogger(__name__)

#: An injector: given the schedule's random source, cause one fault and return it.
Injector = Callable[[random.Random], Fault]


class Link(Protocol):
    """What the campaign needs of a fault proxy (tests/faultproxy.py)."""

    def delay_replies(self, seconds: float) -> None: ...
    def stall(self) -> None: ...
    def resume(self) -> None: ...
    def cut(self) -> None: ...
    def stop(self) -> None: ...
    def start(self) -> None: ...


def _timed(kind: str, target: str, action: Callable[[], Any], *, lossy: bool = False) -> Fault:
    start = time.monotonic()
    action()
    return Fault(kind, target, start, time.monotonic(), lossy)


def link_faults(
    links: Mapping[str, Link], longest: float, *, stall_longest: float | None = None
) -> dict[str, Injector]:
    """Faults between one worker and the store, through that worker's proxy: replies delayed
    (for up to ``longest`` seconds), the link stalled (requests accepted, never answered) for up
    to ``stall_longest`` seconds (default ``longest``; longer than a store's timeouts, a stall
    must end in a timeout), its connections cut; and the store gone for every worker (every
    proxy stopped, then started: how the campaign "restarts" a shared server it must not
    restart)."""
    names = sorted(links)
    stall_longest = longest if stall_longest is None else stall_longest

    def delay(rng: random.Random) -> Fault:
        name = rng.choice(names)
        seconds, lasting = rng.uniform(0.02, 0.4), rng.uniform(0.3, longest)

        def act() -> None:
            links[name].delay_replies(seconds)
            try:
                time.sleep(lasting)
            finally:
                links[name].delay_replies(0.0)

        return _timed("delay", name, act)

    def stall(rng: random.Random) -> Fault:
        name, lasting = rng.choice(names), rng.uniform(0.2, stall_longest)

        def act() -> None:
            links[name].stall()
            try:
                time.sleep(lasting)
            finally:
                links[name].resume()

        return _timed("stall", name, act)

    def cut(rng: random.Random) -> Fault:
        name = rng.choice(names)
        return _timed("cut", name, links[name].cut)

    def outage(rng: random.Random) -> Fault:
        lasting = rng.uniform(0.1, longest / 2)

        def act() -> None:
            for link in links.values():
                link.stop()
            try:
                time.sleep(lasting)
            finally:
                for link in links.values():
                    link.start()

        return _timed("outage", "every link", act)

    return {"delay": delay, "stall": stall, "cut": cut, "outage": outage}


def pause_fault(pids: Callable[[], Sequence[int]], longest: float) -> Injector:
    """A worker process stopped (SIGSTOP: its renewer too, as a VM pause or a debugger would)
    for up to ``longest`` seconds, then continued."""

    def pause(rng: random.Random) -> Fault:
        alive = list(pids())
        if not alive:
            return Fault("pause", "no process", time.monotonic(), time.monotonic())
        pid, lasting = rng.choice(alive), rng.uniform(0.2, longest)

        def act() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(lasting)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

        return _timed("pause", f"pid {pid}", act)

    return pause


def sqlite_lock_fault(path: str, longest: float) -> Injector:
    """Another process's write transaction holds the SQLite database for up to ``longest``
    seconds (the file-level stall: writers wait for it, up to their busy timeout)."""

    def locked(rng: random.Random) -> Fault:
        lasting = rng.uniform(0.1, longest)

        def act() -> None:
            conn = sqlite3.connect(path, timeout=10, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                time.sleep(lasting)
                conn.execute("ROLLBACK")
            finally:
                conn.close()

        return _timed("db-lock", path, act)

    return locked


class InProcessLink:
    """A link between one thread and an in-process store (memory://), where there is no socket:
    the store acts at once, and its reply is delayed, or held back until :meth:`resume` (a
    stall). :meth:`wrap` gives the worker's view of the store."""

    def __init__(self) -> None:
        self.delay = 0.0
        self._open = threading.Event()
        self._open.set()

    def delay_replies(self, seconds: float) -> None:
        self.delay = seconds

    def stall(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def wrap(self, backend: Any) -> Any:
        link = self

        class Linked:
            def __getattr__(self, name: str) -> Any:
                method = getattr(backend, name)
                if name not in {"acquire", "acquire_slot", "release", "extend", "extend_many"}:
                    return method

                def call(*args: Any, **kwargs: Any) -> Any:
                    result = method(*args, **kwargs)  # the store acts; the reply is late
                    link._open.wait()
                    if link.delay:
                        time.sleep(link.delay)
                    return result

                return call

        return Linked()


def inject_until(
    until: float, rng: random.Random, injectors: Mapping[str, Injector], faults: list[Fault]
) -> None:
    """Inject faults, drawn from ``rng``, until monotonic time ``until``; append each to
    ``faults``. The kinds come in rounds, each a shuffle of every kind, so that a run long
    enough for one round injects each at least once. Every injector undoes its fault before it
    returns; one that fails (the harness, not the store) is listed as ``<kind> (failed)``."""
    kinds: list[str] = []
    while injectors and time.monotonic() < until:
        time.sleep(rng.uniform(0.1, 0.8))
        if time.monotonic() >= until:
            return
        if not kinds:
            kinds = sorted(injectors)
            rng.shuffle(kinds)
        kind = kinds.pop()
        started = time.monotonic()
        try:
            faults.append(injectors[kind](rng))
        except Exception as exc:  # the harness failed (e.g. Sentinel did not fail over in time)
            logger.warning("campaign: injecting %s failed: %r", kind, exc)
            faults.append(Fault(f"{kind} (failed)", repr(exc), started, time.monotonic()))


@contextlib.contextmanager
def injecting(until: float, seed: int, injectors: Mapping[str, Injector]) -> Iterator[list[Fault]]:
    """Run the schedule in a thread during the block; the list of faults fills as it runs."""
    faults: list[Fault] = []
    thread = threading.Thread(
        target=inject_until, args=(until, random.Random(seed), injectors, faults), daemon=True
    )
    thread.start()
    try:
        yield faults
    finally:
        thread.join()
