"""``lock_debounce`` / ``lock_debounce_max``: sends of one key collapse into one run (issue 24).

The send side needs a broker (its countdown is the point): tests/e2e/test_debounce.py runs it on
real workers. Here, in one process against the memory store, SQLite and the session's private
Redis: what an execution does with the key's window (only its latest send runs, and closes the
window), the countdown arithmetic, and what definition time refuses.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import celery
import pytest

from singletask import ConfigurationError, SingletonTask, Skipped
from singletask.conf.runtime import lock_options
from singletask.send.debounce import MAX_PENDING, publish_time, wait


@pytest.fixture
def app(eager_store_app: celery.Celery) -> celery.Celery:
    """An eager app on each store with limits, rates and debounce (tests/conftest.py)."""
    return eager_store_app


def test_only_the_latest_send_of_a_window_runs_and_its_run_closes_the_window(
    app: celery.Celery,
) -> None:
    ran: list[int] = []

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=5)
    def rebuild(version: int) -> int:
        ran.append(version)
        return version

    # Given a window whose sends were "send-1" then "send-2" (as apply_async records them)
    backend, key = rebuild.lock_backend, rebuild.lock_key_for((1,))
    backend.debounce(key, "send-1", 60)
    backend.debounce(key, "send-2", 60)

    # When the earlier message starts, then the latest
    earlier = rebuild.apply((1,), task_id="send-1").get()
    latest = rebuild.apply((2,), task_id="send-2").get()

    # Then the earlier is skipped naming its successor; the latest runs and closes the window
    assert isinstance(earlier, Skipped)
    assert earlier.reason == "debounced"
    assert earlier.holder == "send-2"
    assert "superseded" in str(earlier)
    assert latest == 2
    assert ran == [2]
    assert backend.debounce_take(key, "send-1") == ("send-2", 0.0)


def test_an_earlier_send_that_starts_after_the_latest_ran_is_still_superseded(
    app: celery.Celery,
) -> None:
    """A worker can start messages out of order: the earlier send comes after the latest's run
    began, finds the window closed by it, and must not run its stale arguments."""
    ran: list[int] = []

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=5)
    def rebuild(version: int) -> int:
        ran.append(version)
        return version

    backend, key = rebuild.lock_backend, rebuild.lock_key_for((1,))
    backend.debounce(key, "send-1", 60)
    backend.debounce(key, "send-2", 60)

    assert rebuild.apply((2,), task_id="send-2").get() == 2
    late = rebuild.apply((1,), task_id="send-1").get()

    assert isinstance(late, Skipped)
    assert late.reason == "debounced"
    assert late.holder == "send-2"
    assert ran == [2]


def test_a_message_of_a_key_without_a_window_runs_at_once(app: celery.Celery) -> None:
    """What send_task() from a process without the task class sends: no window, no wait."""

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=5)
    def rebuild() -> str:
        return "ran"

    assert rebuild.apply(task_id="by-name").get() == "ran"


def test_eager_mode_runs_each_send_at_once(app: celery.Celery) -> None:
    ran: list[int] = []

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=5)
    def rebuild(version: int) -> None:
        ran.append(version)

    rebuild.delay(1)
    rebuild.delay(2)
    assert ran == [1, 2]


def test_the_wait_is_the_window_bounded_by_debounce_max() -> None:
    app = celery.Celery("debounce-wait", set_as_current=False)

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=2, lock_debounce_max=5)
    def rebuild() -> None: ...

    options = lock_options(rebuild)
    assert wait(options, 0.0) == 2
    assert wait(options, 4.0) == 1
    assert wait(options, 9.0) == 0
    app.close()


# -- definition time ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attributes", "named"),
    [
        ({"lock_debounce": 0}, "lock_debounce"),
        ({"lock_debounce": -1}, "lock_debounce"),
        ({"lock_debounce": 10**9}, "lock_debounce"),
        ({"lock_debounce": "5"}, "lock_debounce"),
        ({"lock_debounce_max": 5}, "lock_debounce_max"),
        ({"lock_debounce": 5, "lock_debounce_max": 2}, "lock_debounce_max"),
        ({"lock_debounce": 5, "lock_scope": "queue"}, "lock_scope"),
        ({"lock_debounce": 5, "lock_scope": "coalesce"}, "lock_scope"),
    ],
)
def test_bad_debounce_options_are_refused_naming_task_and_attribute(
    attributes: dict[str, Any], named: str
) -> None:
    app = celery.Celery("debounce-bad", set_as_current=False)
    with pytest.raises(ConfigurationError, match=rf"task 'debounce\.bad' attribute {named}"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="debounce.bad", **attributes)
        def bad() -> None: ...


@pytest.mark.parametrize("url", ["memcached://127.0.0.1:1", "django://default"])
def test_a_store_without_debounce_windows_refuses_debounce_at_definition(url: str) -> None:
    app = celery.Celery("debounce-store", set_as_current=False)
    app.conf.update(singletask_backend_url=url)
    scheme = url.split(":", 1)[0]
    with pytest.raises(ConfigurationError, match=rf"lock_debounce: the {scheme}:// lock store"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="debounce.m", lock_debounce=1)
        def bad() -> None: ...


def test_a_send_waits_its_debounce_on_top_of_its_countdown_and_its_expires_moves_along() -> None:
    """What apply_async publishes for a debounced task (captured where Celery would publish):
    the countdown adds the wait, and an ``expires`` (beat's recipe sets one period) moves by
    the same wait, so that the message does not expire before it may run."""
    from singletask.send import debounce

    app = celery.Celery("debounce-send", set_as_current=False)
    app.conf.update(singletask_backend_url="memory://")

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=1.5)
    def rebuild() -> None: ...

    published: list[tuple[str | None, dict[str, Any]]] = []

    def publish(task_id: str | None, send_options: Any = None) -> Any:
        published.append((task_id, dict(send_options or {})))
        return rebuild.AsyncResult(task_id)

    options = lock_options(rebuild)
    debounce.send(
        rebuild, options, publish, "send-1", (), {}, linked=False,
        send_options={"countdown": 2, "expires": 1.0},
    )  # fmt: skip
    debounce.send(rebuild, options, publish, "send-2", (), {}, linked=False, send_options={})

    assert published == [
        ("send-1", {"countdown": 3.5, "expires": 2.5}),
        ("send-2", {"countdown": 1.5}),
    ]
    assert rebuild.lock_backend.debounce_take(rebuild.lock_key_for(), "send-1") == ("send-2", 0.0)
    app.close()


@pytest.mark.parametrize("store", ["memory", "sqlite", "redis"])
def test_an_earlier_send_with_a_longer_countdown_of_its_own_never_runs_its_older_arguments(
    store: str, request: pytest.FixtureRequest, key_prefix: str, tmp_path: Any
) -> None:
    """The window outlives every send it superseded: a later send with a shorter wait does not
    shorten it, so an earlier send that starts long after the later one ran (its own countdown
    was longer) still finds the window, and ends superseded instead of running."""
    import time

    from singletask.send import debounce

    if store == "memory":
        url = "memory://"
    elif store == "sqlite":
        url = f"sqlite:///{tmp_path}/locks.db"
    else:
        url = request.getfixturevalue("redis_url")
        request.getfixturevalue("redis_client")
    app = celery.Celery("debounce-outlives", set_as_current=False)
    app.conf.update(singletask_backend_url=url, singletask_key_prefix=key_prefix)
    ran: list[int] = []

    # Given a debounced task whose queued messages are given 0.3 s to start (lock_queue_ttl)
    @app.task(
        base=SingletonTask, shared=False, lazy=False, lock_debounce=0.2, lock_queue_ttl=0.3
    )  # fmt: skip
    def rebuild(version: int) -> int:
        ran.append(version)
        return version

    published: list[tuple[str | None, dict[str, Any]]] = []

    def publish(task_id: str | None, send_options: Any = None) -> Any:
        published.append((task_id, dict(send_options or {})))
        return rebuild.AsyncResult(task_id)

    try:
        options = lock_options(rebuild)
        # When send-1 is sent with a countdown of its own of 1.5 s, then send-2 at once
        sent = time.monotonic()
        debounce.send(
            rebuild, options, publish, "send-1", (1,), {}, linked=False,
            send_options={"countdown": 1.5},
        )  # fmt: skip
        debounce.send(rebuild, options, publish, "send-2", (2,), {}, linked=False, send_options={})
        assert [countdown["countdown"] for _, countdown in published] == [1.7, 0.2]

        # And each message starts when its countdown ends: send-2 first, send-1 after send-2's
        # window record would have run out by send-2's countdown alone
        time.sleep(max(0.0, sent + 0.2 - time.monotonic()))
        latest = rebuild.apply((2,), task_id="send-2").get()
        time.sleep(max(0.0, sent + 1.7 - time.monotonic()))
        earlier = rebuild.apply((1,), task_id="send-1").get()

        # Then only the burst's last send ran; send-1 ended superseded by it
        assert latest == 2
        assert isinstance(earlier, Skipped), earlier
        assert earlier.reason == "debounced"
        assert earlier.holder == "send-2"
        assert ran == [2]
    finally:
        app.close()


def test_an_earlier_message_waits_for_a_pending_latest_send_and_runs_if_it_is_taken_back(
    app: celery.Celery,
) -> None:
    """Issue 37: the latest send's publish is still failing when the earlier message starts."""
    ran: list[int] = []

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=5)
    def rebuild(version: int) -> int:
        ran.append(version)
        return version

    backend, key = rebuild.lock_backend, rebuild.lock_key_for((1,))
    backend.debounce(key, "send-1", 60)
    previous, _, closed = backend.debounce(key, "send-2", 60, pending=60)

    # When the earlier message starts while send-2 is pending, and send-2 is then taken back
    with ThreadPoolExecutor(max_workers=1) as pool:
        earlier = pool.submit(lambda: rebuild.apply((1,), task_id="send-1").get())
        time.sleep(0.5)
        assert not earlier.done()  # it waits
        backend.debounce_undo(key, "send-2", previous, closed=closed)
        outcome = earlier.result(timeout=30)

    # Then it ran its body: the latest published send of the burst
    assert outcome == 1
    assert ran == [1]


def test_an_earlier_message_waits_for_a_pending_latest_send_and_is_superseded_once_published(
    app: celery.Celery,
) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=5)
    def rebuild(version: int) -> int:
        raise AssertionError("only send-2 runs")

    backend, key = rebuild.lock_backend, rebuild.lock_key_for((1,))
    backend.debounce(key, "send-1", 60)
    backend.debounce(key, "send-2", 60, pending=60)

    with ThreadPoolExecutor(max_workers=1) as pool:
        earlier = pool.submit(lambda: rebuild.apply((1,), task_id="send-1").get())
        time.sleep(0.5)
        backend.debounce_published(key, "send-2")
        outcome = earlier.result(timeout=30)

    assert isinstance(outcome, Skipped)
    assert outcome.reason == "debounced"
    assert outcome.holder == "send-2"


def test_a_send_is_pending_for_as_long_as_its_producers_publish_may_take() -> None:
    """Every try of kombu's publish retry policy may take a connection timeout, plus the waits
    between tries and a margin; a policy without a bound is capped."""
    app = celery.Celery("publish-time", set_as_current=False)
    # celery's defaults: 4 tries of 4 s, waits of 0, 0.2 and 0.4 s, a margin of 1 s
    assert publish_time(app, {}) == pytest.approx(4 * 4.0 + 0.6 + 1.0)
    assert publish_time(app, {"retry": False}) == pytest.approx(4.0 + 1.0)
    policy = {"max_retries": 1, "interval_start": 2, "interval_step": 1, "interval_max": 5}
    assert publish_time(app, {"retry_policy": policy}) == pytest.approx(2 * 4.0 + 2.0 + 1.0)
    assert publish_time(app, {"retry_policy": {"max_retries": None}}) == MAX_PENDING
    app.conf.broker_connection_timeout = 1.0
    assert publish_time(app, {"retry": False}) == pytest.approx(2.0)
