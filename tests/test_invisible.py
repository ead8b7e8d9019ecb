"""SingletonTask is invisible where no two executions share a key.

A base class users put under all their tasks must not change what Celery does for a task whose
executions never conflict: the same inputs give the same message, the same error, the same
call, as a plain ``celery.Task`` gives. Each test here compares the two directly, or checks
what Celery's own test fixtures check (no thread left behind by an app).
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import celery
import pytest
from celery.signals import before_task_publish

from singletask import ConfigurationError, SingletonTask
from singletask.conf.runtime import app_state

#: What a send gave: ``("sent", args, kwargs)`` as Celery was about to serialize them (their
#: types shown by their repr), or ``("raised", exception type)``.
Outcome = tuple[str, ...]

#: How many apps the thread-leak test builds (Celery's fixtures build one per test).
APPS = 50

#: Inputs to ``apply_async(args, kwargs)``, with what Celery does with them.
SEND_INPUTS = [
    pytest.param(("report"), None, id="str-missing-its-comma"),  # Celery: TypeError
    pytest.param({"customer_id": 7}, None, id="dict-as-args"),  # Celery: TypeError
    pytest.param([], "str", id="str-as-kwargs"),  # Celery: TypeError
    pytest.param([1, 2], None, id="list-args"),  # Celery: sent as a list
    pytest.param((1, 2), OrderedDict(a=1), id="ordered-kwargs"),  # Celery: sent as it is
    pytest.param(None, None, id="none"),  # Celery: sent as () and {}
]


@pytest.fixture
def broker_app() -> Iterator[celery.Celery]:
    """A Celery app that publishes to the in-memory broker (a queue of its own, purged at the
    end), without eager mode; its locks live in the in-process store."""
    queue = f"invisible-{uuid.uuid4().hex[:12]}"
    app = celery.Celery("invisible", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_default_queue=queue,
        singletask_backend_url="memory://",
    )
    yield app
    with app.connection_for_write() as connection:
        connection.default_channel.queue_purge(queue)
    app.close()


def send_outcome(task: Any, args: Any, kwargs: Any) -> Outcome:
    """What ``task.apply_async(args, kwargs)`` does: the message's args and kwargs as Celery
    hands them to the serializer (``before_task_publish``), or the exception it raises."""
    published: list[Outcome] = []

    def seen(sender: Any = None, body: Any = None, **_: Any) -> None:
        published.append(("sent", repr(body[0]), repr(body[1])))

    before_task_publish.connect(seen, weak=False)
    try:
        task.apply_async(args, kwargs)
    except Exception as exc:
        return ("raised", TypeError.__name__ if isinstance(exc, TypeError) else repr(exc))
    finally:
        before_task_publish.disconnect(seen)
    (outcome,) = published
    return outcome


def any_arguments(*args: Any, **kwargs: Any) -> None:
    """A body that accepts every call, so Celery's own argument check never refuses one."""


@pytest.mark.parametrize(
    "lock_options",
    [
        pytest.param({}, id="execution-scope"),
        pytest.param({"lock_scope": "queue"}, id="queue-scope"),
        pytest.param({"lock_debounce": 5}, id="debounced"),
    ],
)
@pytest.mark.parametrize(("args", "kwargs"), SEND_INPUTS)
def test_apply_async_sends_or_refuses_the_arguments_as_plain_celery_does(
    broker_app: celery.Celery, lock_options: dict[str, Any], args: Any, kwargs: Any
) -> None:
    """``apply_async`` hands ``args`` and ``kwargs`` to Celery as the caller gave them.

    A str missing its comma, or a dict, given as ``args`` fails with ``TypeError`` as with a
    plain task (never published as its letters or its keys); a list is sent as a list, a
    mapping as that mapping; whatever singletask reads from them to build a lock key.
    """
    # Given a plain task and a singleton task with the same body, on one app
    register: Callable[..., Any] = broker_app.task
    plain = register(name="invisible.plain", shared=False, lazy=False)(any_arguments)
    singleton = register(
        name="invisible.singleton", base=SingletonTask, shared=False, lazy=False, **lock_options
    )(any_arguments)

    # When each is sent with the same args and kwargs
    expected = send_outcome(plain, args, kwargs)
    outcome = send_outcome(singleton, args, kwargs)

    # Then the singleton task publishes the same message, or raises the same TypeError
    assert outcome == expected


@pytest.fixture
def eager_app() -> Iterator[celery.Celery]:
    """An eager Celery app whose locks live in the in-process store."""
    app = celery.Celery("invisible-eager", set_as_current=False)
    app.conf.update(task_always_eager=True, singletask_backend_url="memory://")
    yield app
    app.close()


def test_a_task_class_without_a_name_runs_its_body_when_called_directly(
    eager_app: celery.Celery,
) -> None:
    """A class-based task that has no name yet runs its body on a direct call, as Celery does.

    No message can name such a task, so no worker runs it, and it has no lock key: the body
    runs without a lock (``self.lock`` is None). Asking for its lock key is refused with a
    ``ConfigurationError`` that says why.
    """
    # Given a plain and a singleton task class, both bound to an app and given no name
    locks: list[Any] = []

    class Plain(celery.Task):  # type: ignore[type-arg]
        def run(self, value: int) -> int:
            return value * 2

    class Single(SingletonTask):
        def run(self, value: int) -> int:
            locks.append(self.lock)
            return value * 2

    Plain.bind(eager_app)
    Single.bind(eager_app)
    assert Plain.name is None
    assert Single.name is None

    # When each is called directly
    expected = Plain()(21)
    result = Single()(21)

    # Then the singleton task's body ran as the plain one did, holding no lock
    assert result == expected == 42
    assert locks == [None]

    # And its lock key is refused with a reason, not an AttributeError
    with pytest.raises(ConfigurationError, match="has no name yet"):
        Single().lock_key_for((21,))


def alive_threads() -> set[threading.Thread]:
    """The threads alive now: what Celery's own test suite compares before and after each test."""
    return {thread for thread in threading.enumerate() if thread.is_alive()}


def run_on_new_app(number: int, *, serving: bool = False, **lock_options: Any) -> celery.Celery:
    """A new eager app (in-process store) that has run a singleton task once (``serving``: as
    in a worker's process, where the renewer thread waits for the next lease)."""
    app = celery.Celery(f"invisible-{number}", set_as_current=False)
    app.conf.update(task_always_eager=True, singletask_backend_url="memory://")
    app_state(app).serve_worker(serving)
    task = app.task(
        name="invisible.once", base=SingletonTask, shared=False, lazy=False, **lock_options
    )(any_arguments)
    task.apply()
    return app


@pytest.mark.parametrize("ending", ["closed", "collected"])
def test_apps_that_ran_a_singleton_task_leave_no_thread_behind(ending: str) -> None:
    """An app that ran singleton tasks leaves no thread once it is closed or collected.

    Celery's own fixtures build an app per test, close it, and fail a test that leaves a thread
    alive: the renewer thread each app started must be gone by then.
    """
    # Given many apps, each of which has run a singleton task as a worker's process does (so its
    # renewer thread waits for the next lease)
    before = alive_threads()
    apps = [run_on_new_app(number, serving=True) for number in range(APPS)]
    started = {t for t in alive_threads() - before if t.name == "singletask-renewer"}
    assert started  # renewal was running for them

    # When the apps are closed, or dropped and collected
    if ending == "closed":
        for app in apps:
            app.close()
    else:
        del apps
        with warnings.catch_warnings():  # what else this process left for the collector
            warnings.simplefilter("ignore", ResourceWarning)  # (other tests' sockets) is not ours
            gc.collect()

    # Then no thread they started is still alive
    assert alive_threads() - before == set()


def test_the_renewer_ends_with_nothing_to_renew_and_starts_again_for_a_new_lease() -> None:
    """A worker's renewer thread ends once it has had nothing to renew for a third of the
    shortest lease, and a later execution starts a new one that renews its lease as before."""
    # Given an app that has run a task with a 0.6 s lease in a worker's process, and is not closed
    lease = 0.6
    app = run_on_new_app(0, serving=True, lock_ttl=lease)
    renewers = [t for t in threading.enumerate() if t.name == "singletask-renewer"]

    # When it has nothing to renew for a while
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in renewers) and time.monotonic() < deadline:
        time.sleep(0.05)

    # Then its renewer thread has ended
    assert not any(t.is_alive() for t in renewers)

    # And a body that runs for three leases afterwards keeps its lock all along (renewed)
    held: list[bool] = []

    @app.task(name="invisible.long", base=SingletonTask, bind=True, lock_ttl=lease, shared=False)
    def long(self: Any) -> None:
        end = time.monotonic() + 3 * lease
        while time.monotonic() < end:
            held.append(not self.lock.lost)
            time.sleep(0.05)
        self.lock.check()

    long.apply().get()
    assert held
    assert all(held)
    app.close()
