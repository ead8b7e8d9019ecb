"""Named limits (``singletask_limits``, ``lock_limits``, ``lock_cost``, ``self.lock.charge``),
in one process: the options, their refusals at definition, at bind and at send, and what an
execution takes, gives back and reports, on each store that keeps limits (eager mode: the
memory store, the session's private Redis, SQLite). Real workers sharing limits across
processes: tests/e2e/test_named_limits.py; the store primitive: tests/contract/
test_contract_units.py.
"""

from __future__ import annotations

import threading
from typing import Any

import celery
import pytest
from celery.exceptions import Ignore

from singletask import ConfigurationError, SingletonTask, Skipped, TaskLocked
from singletask.conf.runtime import app_state
from singletask.exceptions import LockKeyError

LIMITS = {
    "{llm}-requests": {"concurrency": 2},
    "{llm}-tokens": {"rate": "100/m"},
    "warehouse": {"concurrency": 1},
}


@pytest.fixture
def app(eager_store_app: celery.Celery) -> celery.Celery:
    """An eager app on each store with limits (tests/conftest.py), with three named limits."""
    eager_store_app.conf.singletask_limits = LIMITS
    return eager_store_app


def run(task: Any, *args: Any) -> Any:
    """One eager execution's value (an exception it raised, too)."""
    return task.apply(args=args).result


def limit_records(app: celery.Celery) -> dict[str, dict[str, Any]]:
    """The limits' records in the app's store, by key: what operators see."""
    state = app_state(app)
    prefix = state.settings.key_prefix
    return {s.key: dict(s.detail) for s in state.backend.iter_state(prefix) if s.kind == "limit"}


# -- what an execution takes and gives back ---------------------------------------------------


def test_executions_of_two_tasks_share_a_limit_of_the_fleet(app: celery.Celery) -> None:
    """A limit of 2 requests at once, named by two task types: while two run, a third of
    either is skipped with reason "limit" and the limit's name; each gives its unit back."""
    entered, release = threading.Barrier(3), threading.Event()

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["{llm}-requests"])
    def summarize(doc: int) -> str:
        entered.wait(10)
        release.wait(10)
        return f"summary {doc}"

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["{llm}-requests"])
    def translate(doc: int) -> str:
        return f"translation {doc}"

    # Given two executions holding the limit's two units
    results: list[Any] = []
    runs = [threading.Thread(target=lambda d=d: results.append(run(summarize, d))) for d in (1, 2)]
    for thread in runs:
        thread.start()
    entered.wait(10)

    # When a third execution, of the other task, starts
    refused = run(translate, 3)

    # Then it is skipped for want of room, naming the limit
    assert isinstance(refused, Skipped)
    assert refused.reason == "limit"
    assert refused.limit == "{llm}-requests"
    assert "{llm}-requests" in str(refused)

    release.set()
    for thread in runs:
        thread.join(10)
    assert sorted(results) == ["summary 1", "summary 2"]
    # every unit came back: the next ones run
    assert run(translate, 4) == "translation 4"
    assert not any(r["used"] for k, r in limit_records(app).items() if "%limit:" in k)


def test_a_task_without_a_key_of_its_own_runs_as_many_at_once_as_its_limits_allow(
    app: celery.Celery,
) -> None:
    """lock_limits without lock_args, lock_key or lock_limit: no one-per-task lock, the named
    limit alone holds executions back (here 2 at once, same arguments)."""
    entered, release = threading.Barrier(3), threading.Event()

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["{llm}-requests"])
    def summarize() -> str:
        entered.wait(10)
        release.wait(10)
        return "done"

    results: list[Any] = []
    runs = [threading.Thread(target=lambda: results.append(run(summarize)))
            for _ in range(2)]  # fmt: skip
    for thread in runs:
        thread.start()
    entered.wait(10)
    assert run(summarize).limit == "{llm}-requests"
    release.set()
    for thread in runs:
        thread.join(10)
    assert results == ["done", "done"]


def test_a_task_with_a_key_holds_its_key_and_its_limits(app: celery.Celery) -> None:
    """With lock_args, the key is the task's lock as always: a second call for the same
    argument is refused by the key, one for another argument by the limit."""
    entered, release = threading.Event(), threading.Event()

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_args=["table"],
              lock_limits=["warehouse"])  # fmt: skip
    def load(table: str) -> str:
        entered.set()
        release.wait(10)
        return table

    thread = threading.Thread(target=lambda: run(load, "orders"))
    thread.start()
    assert entered.wait(10)
    same = run(load, "orders")
    other = run(load, "customers")
    release.set()
    thread.join(10)

    assert same.reason == "held"
    assert (other.reason, other.limit) == ("limit", "warehouse")
    assert run(load, "customers") == "customers"  # the key of "orders" and its unit are back


@pytest.mark.parametrize("ending", ["returns", "raises", "ignored"])
def test_units_come_back_on_every_ending(app: celery.Celery, ending: str) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["warehouse"])
    def load() -> str:
        if ending == "raises":
            raise ValueError("boom")
        if ending == "ignored":
            raise Ignore()
        return "loaded"

    for _ in range(3):  # a unit kept by an ending would refuse the second
        result = load.apply()
        assert not isinstance(result.result, Skipped)
    assert limit_records(app) == {} or all(r["used"] == 0 for r in limit_records(app).values())


def test_several_limits_are_taken_all_or_nothing(app: celery.Celery) -> None:
    """A rate without room takes no request either: the concurrency limit stays free."""

    def tokens(args: Any, kwargs: Any) -> int:
        return int(args[0])

    @app.task(base=SingletonTask, shared=False, lazy=False,
              lock_limits={"{llm}-requests": 1, "{llm}-tokens": tokens})  # fmt: skip
    def summarize(tokens: int) -> str:
        return "done"

    assert run(summarize, 90) == "done"
    refused = run(summarize, 20)
    assert (refused.reason, refused.limit) == ("limit", "{llm}-tokens")
    assert refused.retry_after is not None
    assert 50 < refused.retry_after <= 60
    assert run(summarize, 10) == "done"  # 100 of 100: room for exactly that
    records = limit_records(app)
    assert [r["used"] for k, r in records.items() if "%rate:" in k] == [100]


def test_charge_counts_the_real_cost_at_the_start(app: celery.Celery) -> None:
    """An execution estimated at 80 tokens that used 10 leaves room for 90 more."""

    @app.task(base=SingletonTask, shared=False, lazy=False, bind=True,
              lock_limits={"{llm}-tokens": 80})  # fmt: skip
    def summarize(self: Any, used: int) -> str:
        self.lock.charge("{llm}-tokens", used)
        return "done"

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits={"{llm}-tokens": 90})
    def big() -> str:
        return "big"

    assert run(summarize, 10) == "done"
    assert run(big) == "big"
    refused = run(big)
    assert refused.limit == "{llm}-tokens"


def test_charge_of_a_limit_the_execution_did_not_start_is_refused(app: celery.Celery) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, bind=True,
              lock_limits=["{llm}-requests"])  # fmt: skip
    def summarize(self: Any) -> str:
        self.lock.charge("{llm}-tokens", 5)
        return "done"

    with pytest.raises(ConfigurationError, match="started no rate of limit"):
        summarize.apply(throw=True)


def test_raise_fails_with_task_locked_naming_the_limit(app: celery.Celery) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, lock_policy="raise",
              lock_limits={"{llm}-tokens": 100})  # fmt: skip
    def summarize() -> str:
        return "done"

    run(summarize)
    with pytest.raises(TaskLocked) as raised:
        summarize.apply(throw=True)
    assert raised.value.limit == "{llm}-tokens"
    assert raised.value.retry_after is not None


def test_a_limit_name_can_be_a_template_over_the_arguments(app: celery.Celery) -> None:
    """Per-partner limits from a callable setting: each partner's name is its own limit."""
    asked: list[str] = []

    def limits(name: str) -> dict[str, Any] | None:
        asked.append(name)
        return {"concurrency": 1} if name.startswith("partner:") else None

    app.conf.singletask_limits = limits
    entered, release = threading.Event(), threading.Event()

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["partner:{partner_id}"])
    def sync(partner_id: int, page: int) -> int:
        if page == 0:
            entered.set()
            release.wait(10)
        return page

    thread = threading.Thread(target=lambda: run(sync, 7, 0))
    thread.start()
    assert entered.wait(10)
    same = run(sync, 7, 1)
    other = run(sync, 8, 1)
    release.set()
    thread.join(10)

    assert (same.reason, same.limit) == ("limit", "partner:7")
    assert other == 1
    assert asked.count("partner:7") == 1  # kept by the process for a while


def test_lock_cost_counts_a_keys_limit_in_units(app: celery.Celery) -> None:
    """lock_limit=10 with lock_cost=4: two at once for one key, not ten."""
    entered, release = threading.Barrier(3), threading.Event()

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_args=["table"], lock_limit=10,
              lock_cost=4)  # fmt: skip
    def load(table: str) -> str:
        if table == "orders":
            entered.wait(10)
            release.wait(10)
        return table

    runs = [threading.Thread(target=lambda: run(load, "orders")) for _ in range(2)]
    for thread in runs:
        thread.start()
    entered.wait(10)
    refused = run(load, "orders")
    other = run(load, "customers")
    release.set()
    for thread in runs:
        thread.join(10)
    assert (refused.reason, refused.limit) == ("limit", "lock_limit")
    assert other == "customers"


# -- refused before anything runs ----------------------------------------------------------------


def test_an_unknown_limit_is_refused_when_the_task_is_bound(app: celery.Celery) -> None:
    with pytest.raises(ConfigurationError, match=r"lock_limits\['warehous'\].*did you mean"):

        @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["warehous"])
        def load() -> None: ...


def test_a_constant_cost_larger_than_its_limit_is_refused_when_bound(app: celery.Celery) -> None:
    with pytest.raises(ConfigurationError, match="can never fit"):

        @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits={"warehouse": 2})
        def load() -> None: ...


def test_a_callable_cost_larger_than_its_limit_is_refused_by_apply_async(
    app: celery.Celery,
) -> None:
    ran: list[int] = []

    @app.task(base=SingletonTask, shared=False, lazy=False,
              lock_limits={"{llm}-tokens": lambda args, kwargs: args[0]})  # fmt: skip
    def summarize(tokens: int) -> None:
        ran.append(tokens)

    with pytest.raises(ConfigurationError, match=r"'\{llm\}-tokens'.*a cost of 500 units"):
        summarize.delay(500)
    assert ran == []


def test_a_message_sent_without_the_check_fails_before_its_body(app: celery.Celery) -> None:
    """send_task skips apply_async: the execution ends FAILURE, the body never runs."""
    ran: list[int] = []

    @app.task(base=SingletonTask, shared=False, lazy=False,
              lock_limits={"{llm}-tokens": lambda args, kwargs: args[0]})  # fmt: skip
    def summarize(tokens: int) -> None:
        ran.append(tokens)

    result = summarize.apply(args=(500,))
    assert result.failed()
    assert isinstance(result.result, ConfigurationError)
    assert "500" in str(result.result)
    assert ran == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_limits": "warehouse"}, "sequence of limit names"),
        ({"lock_limits": []}, "non-empty"),
        ({"lock_limits": {"warehouse": 0}}, "a cost is a whole number"),
        ({"lock_limits": {"warehouse": True}}, "a cost is a whole number"),
        ({"lock_limits": ["warehouse"], "lock_scope": "queue"}, "lock_scope"),
        ({"lock_limits": ["warehouse"], "lock_debounce": 5}, "lock_debounce"),
        ({"lock_limits": ["warehouse"], "lock_policy": "replace"}, "no holder to preempt"),
        ({"lock_cost": 2}, "lock_limit, which the task does not set"),
        ({"lock_cost": 3, "lock_limit": 2}, "can never fit"),
        ({"lock_limits": ["a\\nb"]}, "control characters"),
        ({"lock_cost": 1, "lock_limit": 2, "lock_rate": "1/s"}, "lock_rate: counts the starts"),
        ({"lock_limits": ["warehouse"], "lock_rate": "1/s"}, "put the rate in a named limit"),
    ],
)
def test_bad_limit_options_are_refused_when_the_task_is_defined(
    app: celery.Celery, options: dict[str, Any], message: str
) -> None:
    options = {k: (v.replace("\\n", "\n") if isinstance(v, str) else v) for k, v in options.items()}
    if isinstance(options.get("lock_limits"), list):
        options["lock_limits"] = [n.replace("\\n", "\n") for n in options["lock_limits"]]
    with pytest.raises(ConfigurationError, match=message) as raised:

        @app.task(base=SingletonTask, shared=False, lazy=False, name="app.load", **options)
        def load() -> None: ...

    assert "'app.load'" in str(raised.value)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"x": {"concurrency": 0}}, "concurrency"),
        ({"x": {"rate": "1.5/m"}}, "whole number of units"),
        ({"x": {"rate": "10/fortnight"}}, "expected a rate"),
        ({"x": {}}, "a limit is a mapping"),
        ({"x": {"concurency": 3}}, "unknown key 'concurency'"),
        (["x"], "expected a mapping"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(
    app: celery.Celery, setting: object, message: str
) -> None:
    app.conf.singletask_limits = setting
    with pytest.raises(ConfigurationError, match=message) as raised:
        app_state(app).settings  # noqa: B018 - read and checked on first use
    assert "singletask_limits" in str(raised.value)


def test_a_template_that_cannot_be_filled_in_is_a_lock_key_error(app: celery.Celery) -> None:
    app.conf.singletask_limits = lambda name: {"concurrency": 1}

    @app.task(base=SingletonTask, shared=False, lazy=False,
              lock_limits=["partner:{partner.id}"])  # fmt: skip
    def sync(partner: object) -> None: ...

    with pytest.raises(LockKeyError, match="partner"):
        sync.delay(3)


def test_a_store_without_limits_refuses_them_when_bound() -> None:
    app = celery.Celery("no-limits", set_as_current=False)
    app.conf.singletask_backend_url = "memcached://127.0.0.1:1"
    app.conf.singletask_limits = LIMITS
    with pytest.raises(ConfigurationError, match="keeps no named limits"):

        @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["warehouse"])
        def load() -> None: ...


def test_limits_a_redis_cluster_cannot_take_together_are_refused_when_bound() -> None:
    """On a Redis Cluster the limits of one take share a hash slot: names without one hash
    tag are refused when the task is bound, with the way out; names with one are accepted."""
    app = celery.Celery("cluster-limits", set_as_current=False)
    app.conf.singletask_backend_url = "redis+cluster://127.0.0.1:1"
    app.conf.singletask_limits = {
        "requests": {"concurrency": 8},
        "tokens": {"rate": "90000/m"},
        **LIMITS,
    }
    with pytest.raises(ConfigurationError, match=r"hash slot.*\{openai\}-requests"):

        @app.task(base=SingletonTask, shared=False, lazy=False, lock_limits=["requests", "tokens"])
        def summarize() -> None: ...

    @app.task(base=SingletonTask, shared=False, lazy=False,
              lock_limits=["{llm}-requests", "{llm}-tokens"])  # fmt: skip
    def translate() -> None: ...
