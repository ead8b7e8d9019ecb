"""Named limits end to end on the stores besides Redis that keep them (PostgreSQL, MariaDB /
MySQL, SQLite): real prefork workers whose locks and limits live there, the broker a private
Redis, as in test_stores.py; and memcached, which keeps none, refusing them.

The scenarios of test_named_limits.py (on Redis), with the helpers of shared_limits.py: two
task types share a limit of the fleet, costs weigh, a refusal names the limit, a crash gives
its units back, ``charge`` moves a rate's count and a rate is never exceeded. The test process
holds units of a limit itself, as executions on another host would, through a backend of its
own connected to the store, so that the workers' pool processes meet a limit with less room
than they are.

SQLite is not one of ``LOCK_STORES`` (test_stores.py takes those stores down through a TCP
proxy): here it is a database file of the test's own, shared by the workers of this host.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery import group

from singletask import ConfigurationError, SingletonTask, Skipped
from singletask.backends import backend_class, backend_from_url
from singletask.backends.base import LockBackend, Units

from .app import make_app
from .conftest import LOCK_STORES
from .faults import BOUND, FaultEnv
from .shared_limits import (
    SIZE,
    crowded_windows,
    database,
    database_key,
    hold_elsewhere,
    most_held,
    most_running_of,
)
from .tasks_policies import gate_key
from .tasks_shared import PREFIX, TTL

pytestmark = [pytest.mark.e2e, pytest.mark.stores]


@contextlib.contextmanager
def sqlite_lock_store(folder: Path) -> Iterator[str]:
    """The URL of a SQLite database file in ``folder`` (the test's own directory)."""
    yield f"sqlite:///{folder.resolve() / 'locks.db'}"


#: The stores that keep named limits besides Redis: name -> a context manager, given the test's
#: directory, that yields a store URL for one test and cleans up after it.
UNIT_STORES: dict[str, Callable[[Path], AbstractContextManager[str]]] = {
    "postgresql": lambda _: LOCK_STORES["postgresql"](),
    "mysql": lambda _: LOCK_STORES["mysql"](),
    "sqlite": sqlite_lock_store,
}


class UnitStore:
    """A FaultEnv whose lock store is one of UNIT_STORES, a backend of the test process's own
    on that store, and the test's probe label."""

    def __init__(self, env: FaultEnv, locks: LockBackend, label: str) -> None:
        self.env = env
        self.locks = locks
        self.label = label

    def task(self, name: str) -> Any:
        return self.env.app.tasks[PREFIX + name]

    def events(self) -> list[dict[str, Any]]:
        return self.env.probe.events(self.label)

    def assert_room_is_back(self, elsewhere: int) -> None:
        """Every unit the workers took of the label's database limit is back: besides the
        ``elsewhere`` units, the whole rest of its size can be taken (and is given back)."""
        rest = [Units(database_key(self.label), SIZE, SIZE - elsewhere)]
        taken = self.locks.take_units("room-check", 5, rest, meta={"task_id": "room-check"})
        assert taken.taken, (taken, self.env.explain())
        assert self.locks.give_units("room-check", rest) == [True]


@pytest.fixture(params=list(UNIT_STORES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UnitStore]:
    with UNIT_STORES[request.param](tmp_path) as url:
        env = FaultEnv(tmp_path, lock_store=url)
        locks = backend_from_url(url)
        label = f"units-{request.param}-{uuid.uuid4().hex[:10]}"
        try:
            yield UnitStore(env, locks, label)
        finally:
            env.probe.client.rpush(gate_key(label), *["open"] * 20)  # a body left waiting goes
            env.close()
            locks.close()


def test_two_task_types_sharing_a_limit_never_hold_more_than_its_size(store: UnitStore) -> None:
    """With 1 of 3 units held elsewhere, reports and exports (1 unit each) on two workers of two
    processes: at most 2 run at once, both kinds run, every one of them runs, and the units
    are all back afterwards."""
    env, label = store.env, store.label
    env.start_worker()
    env.start_worker()
    hold_elsewhere(store.locks, label, 1)
    sends = [store.task(name).s(label, pause=0.3) for name in ("report", "export") * 6]

    results = group(sends).apply_async().get(timeout=BOUND * 4)

    assert results == [1] * 12
    # (two at once is what four processes reach with twelve such bodies, but not a promise)
    assert 1 <= most_held(store.events()) <= SIZE - 1, env.explain()
    assert {e["task"] for e in env.probe.starts(label)} == {PREFIX + "report", PREFIX + "export"}
    store.assert_room_is_back(elsewhere=1)


def test_costs_weigh_against_the_size(store: UnitStore) -> None:
    """Executions of 2 units each on a limit of 3: never two at once, though two processes
    are free; executions of 1 unit fill the rest."""
    env, label = store.env, store.label
    env.start_worker()
    sends = [store.task("report").s(label, cost=2, pause=0.1) for _ in range(4)]
    sends += [store.task("export").s(label, cost=1, pause=0.1) for _ in range(4)]

    results = group(sends).apply_async().get(timeout=BOUND * 4)

    assert sorted(results) == [1] * 4 + [2] * 4
    events = store.events()
    assert most_held(events) <= SIZE
    assert most_running_of(events, 2) == 1, env.explain()
    store.assert_room_is_back(elsewhere=0)


def test_a_full_limit_refuses_with_its_name_and_a_crash_gives_the_units_back(
    store: UnitStore,
) -> None:
    """A skip names the limit; the pool process holding the last unit is SIGKILLed: its worker
    gives the unit back long before the units' 30 s lease would, and the next one runs."""
    env, label = store.env, store.label
    env.start_worker()
    hold_elsewhere(store.locks, label, SIZE - 1)

    # Given the last unit held by a body that waits on its gate
    held = store.task("report").apply_async((label,), {"hold": True})
    (start,) = env.wait_starts(label, 1)

    # When another execution is sent, Then it is skipped, naming the limit
    refused = store.task("report_skip").apply_async((label,)).get(timeout=BOUND)
    assert isinstance(refused, Skipped), refused
    assert (refused.reason, refused.limit) == ("limit", database(label))

    # When the holder's pool process is SIGKILLed
    env.kill_process(start["pid"])
    env.wait_until(lambda: held.state == "FAILURE", "the killed execution to fail")
    assert isinstance(held.result, WorkerLostError), held.result

    # Then the unit comes back within BOUND (20 s) < TTL (30 s): the worker gave it back
    assert BOUND < TTL

    def runs() -> Any:
        value = store.task("report_skip").apply_async((label,)).get(timeout=BOUND)
        return None if isinstance(value, Skipped) else value

    assert env.wait_until(runs, "an execution after the crash to run", timeout=BOUND) == 1
    assert [s["task_id"] == held.id for s in env.probe.starts(label)] == [True, False]
    store.assert_room_is_back(elsewhere=SIZE - 1)


def test_charge_counts_the_real_cost_and_a_rate_is_never_exceeded(store: UnitStore) -> None:
    """On "10 tokens per 2 s": six calls in a row estimated at 5 that used 1 are charged 1
    each, so none is refused (estimates alone would refuse the third); twelve calls of 3
    tokens sent at once all run, and no window of 2 s holds more than 10 tokens of starts."""
    env, label = store.env, store.label
    env.start_worker()
    task = store.task("complete")

    # Given six calls in a row, estimated at 5 tokens, that used 1
    charged = []
    for _ in range(6):
        call = task.apply_async((label,), {"estimate": 5, "used": 1})
        assert call.get(timeout=BOUND) == 1
        charged.append(call)
    # Then all six ran, none refused for want of room (a refused call is sent again)
    assert len(env.probe.starts(label)) == 6
    assert [env.received(call.id) for call in charged] == [1] * 6, env.explain()

    # Given twelve calls of 3 tokens sent at once (a label, so a rate, of their own)
    rated = f"{label}-rate"
    sends = [task.s(rated, estimate=3, used=3) for _ in range(12)]
    # Then all run, no window of 2 s (less 0.1 s between a take and its record) above 10
    assert group(sends).apply_async().get(timeout=BOUND * 3) == [3] * 12
    starts = env.probe.starts(rated)
    assert len(starts) == 12
    assert not crowded_windows(starts), sorted(s["t"] for s in starts)


def test_memcached_refuses_named_limits_when_a_task_is_bound() -> None:
    """memcached keeps no named limits: the e2e app built on it has none of the tasks of
    tasks_shared.py (which asks the store first), and a task naming ``lock_limits`` or
    ``lock_cost`` is refused when it is bound, naming the option and the store."""
    with LOCK_STORES["memcached"]() as url:
        assert not backend_class(url).supports_units
        app = make_app(
            broker="memory://", results="cache+memory://", locks=url, queue="units-refused"
        )
        try:
            assert not [name for name in app.tasks if name.startswith(PREFIX)]
            for option, options, says in (
                ("lock_limits", {"lock_limits": [database("refused")]}, "keeps no named limits"),
                ("lock_cost", {"lock_cost": 2, "lock_limit": 3}, "keeps no limits of several"),
            ):
                with pytest.raises(
                    ConfigurationError, match=rf"{option}: the memcached:// lock store {says}"
                ):
                    app.task(
                        base=SingletonTask, name=f"{PREFIX}refused-{option}", lazy=False,
                        shared=False, **options,
                    )(_refused)  # fmt: skip
        finally:
            app.close()


def _refused() -> None:
    """The body of a task that memcached refuses (see above)."""
