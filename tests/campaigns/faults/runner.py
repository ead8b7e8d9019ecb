"""One campaign run: start the workers (threads and processes), inject the seeded faults while
they work, collect their histories and judge them (tests/campaigns/faults/history.py).

On a store with holder slots (``supports_limit``), a share of the holds take keys of their own
with ``acquire_slot`` (limits :data:`SLOT_LIMITS`) instead of the singleton keys, under the same
faults."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from singletask.backends import backend_class

from .faults import Injector, injecting
from .history import Report, check
from .workers import History, WorkerSpec, process_main, run_worker

__all__ = ["Environment", "campaign_seed", "run_campaign"]

#: Replays a run: the seed its report printed.
SEED_VARIABLE = "SINGLETASK_CAMPAIGN_SEED"

#: The limits of the keys taken with acquire_slot: 3, and 2 for contention where few workers run.
SLOT_LIMITS = (3, 2)

#: The share of holds that take a key with holder slots, on a store that keeps them.
SLOT_SHARE = 0.4


def campaign_seed() -> int:
    """The run's seed: ``SINGLETASK_CAMPAIGN_SEED`` when set, else a fresh one."""
    value = os.environ.get(SEED_VARIABLE, "").strip()
    return int(value) if value else random.SystemRandom().randrange(1, 2**31)


@dataclass
class Environment:
    """A store set up for a campaign.

    ``urls`` gives each worker's store URL (each through its own proxy, where the store has a
    socket); threads and processes take them in that order. ``backend`` (memory://) gives
    thread ``n`` its view of one store object shared by the threads instead.
    """

    store: str
    urls: list[str]
    options: dict[str, Any]
    threads: int
    processes: int
    ttls: tuple[float, ...]
    block_bound: float  # seconds: the longest a call may block (the store's timeouts)
    injectors: Callable[[Callable[[], list[int]]], Mapping[str, Injector]]
    keys: int = 4
    backend: Callable[[int], Any] | None = None
    pids: list[int] = field(default_factory=list)


def _supports_limit(env: Environment) -> bool:
    if env.backend is not None:
        return bool(env.backend(0).supports_limit)
    return backend_class(env.urls[0]).supports_limit


def run_campaign(env: Environment, seed: int, seconds: float, workdir: Path) -> Report:
    """Run ``env``'s workers for ``seconds`` under the faults of ``seed``; return the verdict."""
    rng = random.Random(seed)
    keys = tuple(f"campaign:{seed}:{env.store}:{n}" for n in range(env.keys))
    slot_keys: tuple[tuple[str, int], ...] = ()
    if _supports_limit(env):
        slot_keys = tuple((f"campaign:{seed}:{env.store}:limit{n}", n) for n in SLOT_LIMITS)
    startup = 1.5 if env.processes else 0.0  # spawned interpreters import singletask first
    until = time.monotonic() + startup + seconds
    specs = [
        WorkerSpec(
            name=f"{'thread' if n < env.threads else 'process'}-{n}",
            keys=keys,
            seed=rng.randrange(2**31),
            until=until,
            ttls=env.ttls,
            url=env.urls[n % len(env.urls)] if env.urls else "",
            options=env.options,
            out=str(workdir / f"worker-{n}.json"),
            slot_keys=slot_keys,
            slot_share=SLOT_SHARE if slot_keys else 0.0,
        )
        for n in range(env.threads + env.processes)
    ]
    histories: dict[str, History] = {}

    def thread_main(n: int, spec: WorkerSpec) -> None:
        backend = env.backend(n) if env.backend is not None else None
        histories[spec.name] = run_worker(spec, backend)

    threads = [
        threading.Thread(target=thread_main, args=(n, spec), name=spec.name, daemon=True)
        for n, spec in enumerate(specs[: env.threads])
    ]
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=process_main, args=(spec,), name=spec.name, daemon=True)
        for spec in specs[env.threads :]
    ]
    for thread in threads:
        thread.start()
    for process in processes:
        process.start()
    env.pids[:] = [p.pid for p in processes if p.pid is not None]
    hung: list[str] = []
    with injecting(until, rng.randrange(2**31), env.injectors(lambda: env.pids)) as faults:
        # A worker ends its last hold at most two leases and one blocked call after `until`.
        grace = until + 2 * max(env.ttls) + 2 * env.block_bound + 5.0
        for thread in threads:
            thread.join(max(0.0, grace - time.monotonic()))
            if thread.is_alive():
                hung.append(thread.name)
    for process in processes:
        process.join(max(0.0, grace - time.monotonic()))
        if process.is_alive():
            hung.append(process.name)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.join()
    for spec, process in zip(specs[env.threads :], processes, strict=True):
        path = Path(spec.out)
        if path.exists():
            histories[spec.name] = History.from_json(path.read_text())
        elif spec.name not in hung:
            hung.append(f"{spec.name} (exited with {process.exitcode}, no history)")
    report = check(
        [hold for h in histories.values() for hold in h.holds],
        [error for h in histories.values() for error in h.errors],
        [call for h in histories.values() for call in h.calls],
        faults,
        operations=sum(h.operations for h in histories.values()),
        block_bound=env.block_bound,
    )
    report.refused_full = sum(h.refused_full for h in histories.values())
    report.violations += [f"{name}: still blocked after the run (hung)" for name in hung]
    return report
