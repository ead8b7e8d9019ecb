"""A campaign worker: takes, renews, checks and releases random keys, and writes down what it
believed (tests/campaigns/faults/history.py). It runs as a thread of the test process or as a
process of its own (:func:`process_main`, started with the ``spawn`` method).

Each hold is built as the task path builds it (singletask/execution/lifecycle.py): a
:class:`~singletask.lease.LockHandle` whose deadline counts from just before the acquire was sent
(``sent_at``), renewed, when the hold renews, by a :class:`~singletask.lease.Renewer`. The
worker's critical section is a series of slices, each ended by ``check()``: the believed
interval starts when the acquire's reply came and ends at the last check that passed.

Where the store keeps holder slots, some holds take a key of ``slot_keys`` instead, with
``acquire_slot(key, limit, ...)``: the hold then renews, checks and releases the slot's store key
(``result.key``), as the task path does with ``lock_limit``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.exceptions import BackendError, LockLost, SingletaskError
from singletask.lease import LockHandle, Renewer

from .history import Call, CallError, Hold

__all__ = ["History", "WorkerSpec", "process_main", "run_worker"]


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker does; picklable, for worker processes."""

    name: str
    keys: tuple[str, ...]
    seed: int
    until: float  # monotonic time at which it stops starting holds
    ttls: tuple[float, ...]
    url: str = ""  # built in the worker process from url and options
    options: dict[str, Any] = field(default_factory=dict)
    renew_share: float = 0.5  # share of holds that are renewed; the others run on one lease
    slot_keys: tuple[tuple[str, int], ...] = ()  # keys taken with acquire_slot, and their limit
    slot_share: float = 0.0  # share of holds that take one of slot_keys
    out: str = ""  # a worker process writes its History here, as JSON


@dataclass
class History:
    """Everything one worker recorded."""

    operations: int = 0
    holds: list[Hold] = field(default_factory=list)
    errors: list[CallError] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    refused_full: int = 0  # acquire_slot refusals with every slot held

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> History:
        data = json.loads(text)
        return cls(
            operations=data["operations"],
            holds=[Hold(**hold) for hold in data["holds"]],
            errors=[CallError(**error) for error in data["errors"]],
            calls=[Call(**call) for call in data["calls"]],
            refused_full=data["refused_full"],
        )


def error_record(worker: str, call: str, exc: BaseException) -> CallError:
    kind = type(exc)
    cause = exc.__cause__
    context = exc.__context__  # kept by `raise ... from None` too, which hides it
    return CallError(
        worker=worker,
        call=call,
        type=f"{kind.__module__}.{kind.__qualname__}",
        singletask=isinstance(exc, SingletaskError),
        backend_error=isinstance(exc, BackendError),
        cause=None if cause is None else type(cause).__name__,
        context=None if context is None else type(context).__name__,
        message=str(exc)[:300],
    )


class _TimedRenewals:
    """The renewer's view of the backend: ``extend_many`` timed, and its errors recorded."""

    def __init__(self, backend: LockBackend, name: str, history: History) -> None:
        self._backend = backend
        self._name = name
        self._history = history

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        started = time.monotonic()
        try:
            return self._backend.extend_many(leases)
        except Exception as exc:
            self._history.errors.append(error_record(self._name, "extend_many", exc))
            raise
        finally:
            self._history.operations += 1
            self._history.calls.append(
                Call(self._name, "extend_many", started, time.monotonic() - started, os.getpid())
            )


def _call(history: History, name: str, call: str, function: Any, *args: Any) -> Any:
    """Run one store call, timed; returns its result, or None after recording its error."""
    started = time.monotonic()
    try:
        return function(*args)
    except Exception as exc:
        history.errors.append(error_record(name, call, exc))
        return None
    finally:
        history.calls.append(Call(name, call, started, time.monotonic() - started, os.getpid()))
        history.operations += 1


def _hold(
    spec: WorkerSpec,
    rng: random.Random,
    backend: LockBackend,
    renewer: Renewer,
    history: History,
) -> None:
    """One attempt: acquire a random key and, if taken, work in checked slices, then release."""
    limit = 1
    if spec.slot_keys and rng.random() < spec.slot_share:
        key, limit = rng.choice(spec.slot_keys)
    else:
        key = rng.choice(spec.keys)
    ttl = rng.choice(spec.ttls)
    token = f"{spec.name}:{uuid.uuid4().hex}"
    sent = time.monotonic()
    if limit > 1:
        result = _call(
            history, spec.name, "acquire_slot", backend.acquire_slot, key, limit, token, ttl
        )
    else:
        result = _call(history, spec.name, "acquire", backend.acquire, key, token, ttl)
    granted = time.monotonic()
    if result is None or not result.acquired:
        if result is not None and result.holders:
            history.refused_full += 1
        time.sleep(rng.uniform(0.0, 0.05))
        return
    slot = (result.key or key) if limit > 1 else None  # the store key held
    handle = LockHandle(slot or key, token, None, result.fence, ttl, sent_at=sent)
    renew = rng.random() < spec.renew_share
    if renew:
        renewer.add(handle)
    # Most holds are short; three in ten work up to two leases (renewed) or one and a half (not
    # renewed: it runs past its lease and must find out through check()).
    longest = (2.0 if renew else 1.5) * ttl if rng.random() < 0.3 else ttl / 2
    work_until = time.monotonic() + rng.uniform(0.0, longest)
    last_passed: float | None = None
    try:
        while time.monotonic() < work_until:
            time.sleep(rng.uniform(0.005, min(0.1, ttl / 8)))
            try:
                handle.check()
            except LockLost as exc:
                history.errors.append(error_record(spec.name, "check", exc))
                break
            last_passed = time.monotonic()  # after check(): the interval is never too short
    finally:
        renewer.remove(handle)
        _call(history, spec.name, "release", backend.release, handle.key, token)
    if last_passed is not None:
        history.holds.append(
            Hold(key, spec.name, sent, granted, last_passed, result.fence, ttl, limit, slot)
        )


def run_worker(spec: WorkerSpec, backend: LockBackend | None = None) -> History:
    """Hold random keys until ``spec.until``; returns what the worker believed and saw."""
    history = History()
    owned = backend is None
    if backend is None:
        backend = backend_from_url(spec.url, **spec.options)
    rng = random.Random(spec.seed)
    renewer = Renewer(_TimedRenewals(backend, spec.name, history))  # type: ignore[arg-type]
    try:
        while time.monotonic() < spec.until:
            _hold(spec, rng, backend, renewer, history)
    finally:
        if owned:  # its connections are closed here, not left to the garbage collector
            backend.close()
    return history


def process_main(spec: WorkerSpec) -> None:
    """Entry point of a worker process: run, then write the history to ``spec.out``."""
    history = run_worker(spec)
    Path(spec.out).write_text(history.to_json())
