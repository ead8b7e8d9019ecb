"""Fair turns as a task declares them (``lock_weight``, ``lock_priority``,
``singletask_limit_turns``): their refusals at definition, and the turn an execution waits
with. The line itself, on every store: tests/contract/test_contract_turns.py; executions of
several tenants on a real worker: tests/e2e/test_fair_turns.py.
"""

from __future__ import annotations

from typing import Any

import celery
import pytest

from singletask import ConfigurationError, SingletonTask
from singletask.conf.runtime import app_state
from singletask.execution import units

LIMITS = {"warehouse": {"concurrency": 2}, "tokens": {"rate": "100/m"}}


@pytest.fixture
def app(eager_store_app: celery.Celery) -> celery.Celery:
    eager_store_app.conf.singletask_limits = LIMITS
    return eager_store_app


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_weight": 2}, "lock_weight: orders the turns .* the task takes none"),
        ({"lock_priority": 1}, "lock_priority: orders the turns .* the task takes none"),
        ({"lock_limits": ["warehouse"], "lock_weight": 0}, "a weight is a number above 0"),
        ({"lock_limits": ["warehouse"], "lock_weight": 1001}, "at most 1000"),
        ({"lock_limits": ["warehouse"], "lock_weight": True}, "a weight is a number"),
        ({"lock_limits": ["warehouse"], "lock_priority": 11}, "from -10 to 10"),
        ({"lock_limits": ["warehouse"], "lock_priority": 1.5}, "a whole number"),
    ],
)
def test_bad_turn_options_are_refused_when_the_task_is_defined(
    app: celery.Celery, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as raised:

        @app.task(base=SingletonTask, shared=False, lazy=False, name="app.sync", **options)
        def sync(tenant: str) -> None: ...

    assert "'app.sync'" in str(raised.value)


def test_an_execution_waits_with_its_key_as_group_and_its_task_id_as_ticket(
    app: celery.Celery,
) -> None:
    """The weight and priority callables read the call's arguments; the hold covers the
    countdown and its jitter, the lease several countdowns."""

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["warehouse"],
              lock_args=["tenant"], lock_limit=50, lock_policy="retry", lock_retry_countdown=4,
              lock_weight=lambda args, kwargs: 3 if kwargs["tenant"] == "big" else 1,
              lock_priority=lambda args, kwargs: 2)  # fmt: skip
    def sync(tenant: str) -> None: ...

    options = sync._singletask_options.resolve(sync.name, app_state(app).settings)
    turn = units.turn(sync, options, "key:big", "task-1", (), {"tenant": "big"})
    assert (turn.ticket, turn.group, turn.weight, turn.priority) == ("task-1", "key:big", 3.0, 2)
    assert turn.hold >= 4 * 1.25
    assert turn.lease > turn.hold


def test_a_ticket_for_a_rate_lasts_while_its_owner_waits_for_the_rate(
    app: celery.Celery,
) -> None:
    """A rate's refusal sends its execution back when a start is allowed, up to a period
    later: its ticket there outlasts that wait; its ticket for a concurrency does not need to."""

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["warehouse", "tokens"],
              lock_policy="retry", lock_retry_countdown=1)  # fmt: skip
    def call() -> None: ...

    options = call._singletask_options.resolve(call.name, app_state(app).settings)
    want = units.wanted(call, options, app_state(app), "key", (), {})
    want.turn = units.turn(call, options, "key", "task-1", (), {})
    leases = {want.names[u.key]: u.turn.lease for u in want.taking if u.turn is not None}
    assert leases["warehouse"] == want.turn.lease < 60
    assert leases["tokens"] >= 3 * 60


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (lambda args, kwargs: 1 / 0, "lock_weight: the callable raised ZeroDivisionError"),
        (lambda args, kwargs: -1, "lock_weight: the callable's answer: a weight is a number"),
    ],
)
def test_a_weight_callable_that_fails_names_the_task_and_the_option(
    app: celery.Celery, weight: Any, message: str
) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["warehouse"],
              lock_weight=weight)  # fmt: skip
    def sync(tenant: str) -> None: ...

    options = sync._singletask_options.resolve(sync.name, app_state(app).settings)
    with pytest.raises(ConfigurationError, match=message) as raised:
        units.turn(sync, options, "key", "task-1", ("a",), {})
    assert sync.name in str(raised.value)


def test_the_turns_setting_is_a_boolean(app: celery.Celery) -> None:
    assert app_state(app).settings.limit_turns is True
    fresh = celery.Celery("turns-setting", set_as_current=False)
    fresh.conf.singletask_limit_turns = "no"
    with pytest.raises(ConfigurationError, match="singletask_limit_turns"):
        app_state(fresh).settings  # noqa: B018 - read and checked on first use
