"""One validated range of leases per lock store, refused as early as the store is known.

Every lock store class says how long a lease it accepts (``max_lease``; memcached's relative
expiry ends at 30 days, so its stores accept less than the settings allow). A task option that
becomes a lease or a reservation in the store (``lock_ttl``; ``lock_queue_ttl`` for the "queue"
and "coalesce" scopes) and is longer than that is refused with ConfigurationError naming the
task, the attribute (or the setting it came from) and the store:

* when the task is bound to its app (definition time: Celery has read the app's configuration);
* else, for an app configured after its tasks were bound, when the worker starts and at the
  task's first use in a process (before anything is written).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import celery
import pytest

from singletask import ConfigurationError, SingletonTask
from singletask.backends import BACKEND_ALIASES, backend_class
from singletask.backends.memory import MemoryBackend
from singletask.conf.settings import MAX_SECONDS
from singletask.execution.bootstep import CheckLockStore

MEMCACHED = "memcached://127.0.0.1:1"  # nothing connects to it: the class decides


def memcached_max() -> float:
    return backend_class(MEMCACHED).max_lease


def too_long_for_memcached() -> float:
    """The shortest lease the settings allow and memcached:// refuses."""
    limit = memcached_max()
    if limit >= MAX_SECONDS:
        pytest.fail(f"memcached's max_lease ({limit}) is not below the settings' bound")
    return float(int(limit) + 1)


class MinuteBackend(MemoryBackend):
    """A store (registered below as ``minute://``) whose leases end at one minute."""

    max_lease = 60.0

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MinuteBackend:
        return cls()

    @classmethod
    def check_url(cls, url: str) -> None:
        return None


@pytest.fixture
def minute_scheme(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(BACKEND_ALIASES, "minute", f"{__name__}:MinuteBackend")
    return "minute://"


def make_app(**conf: Any) -> celery.Celery:
    app = celery.Celery("range", set_as_current=False)
    app.conf.update(**conf)
    return app


@pytest.fixture
def app() -> Iterator[celery.Celery]:
    app = make_app(singletask_backend_url=MEMCACHED)
    yield app
    app.close()


def singleton(app: celery.Celery, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    return app.task(base=SingletonTask, shared=False, lazy=False, **options)


@pytest.mark.parametrize(
    ("options", "attribute"),
    [
        ({"lock_ttl": "too long"}, "lock_ttl"),
        ({"lock_queue_ttl": "too long", "lock_scope": "queue"}, "lock_queue_ttl"),
        ({"lock_queue_ttl": "too long", "lock_scope": "coalesce"}, "lock_queue_ttl"),
    ],
)
def test_a_lease_longer_than_the_store_accepts_fails_at_definition_naming_task_and_store(
    app: celery.Celery, options: dict[str, Any], attribute: str
) -> None:
    options = {k: too_long_for_memcached() if v == "too long" else v for k, v in options.items()}

    # When a task declares a lease memcached:// cannot keep (the settings allow 30 days)
    with pytest.raises(ConfigurationError) as caught:

        @singleton(app, name="range.long", **options)
        def long() -> None:
            pass

    # Then the definition fails, naming the task, the attribute and the store
    message = str(caught.value)
    assert "'range.long'" in message
    assert attribute in message
    assert "memcached://" in message
    assert f"(at most {memcached_max():.0f}s)" in message


def test_the_longest_lease_the_store_accepts_is_accepted(app: celery.Celery) -> None:
    limit = memcached_max()

    @singleton(app, name="range.longest", lock_ttl=limit, lock_queue_ttl=limit, lock_scope="queue")
    def longest() -> None:
        pass


def test_a_queue_ttl_is_not_a_lease_for_the_execution_scope(app: celery.Celery) -> None:
    """``lock_queue_ttl`` reaches the store only for scopes that reserve at send time."""

    @singleton(app, name="range.exec", lock_queue_ttl=too_long_for_memcached())
    def execution() -> None:
        pass


def test_an_app_setting_too_long_for_the_store_is_refused_naming_the_setting() -> None:
    app = make_app(singletask_backend_url=MEMCACHED, singletask_lock_ttl=too_long_for_memcached())
    with pytest.raises(ConfigurationError) as caught:

        @singleton(app, name="range.setting")
        def setting() -> None:
            pass

    message = str(caught.value)
    assert "'range.setting'" in message
    assert "setting singletask_lock_ttl" in message
    assert "memcached://" in message


def test_a_store_registered_for_a_scheme_brings_its_own_range(minute_scheme: str) -> None:
    app = make_app(singletask_backend_url=minute_scheme)

    @singleton(app, name="range.minute.ok", lock_ttl=60)
    def fits() -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"lock_ttl: 61s .* minute:// lock store .* 60s"):

        @singleton(app, name="range.minute.long", lock_ttl=61)
        def long() -> None:
            pass


def test_an_app_configured_after_its_tasks_is_checked_at_worker_start_and_first_use(
    minute_scheme: str,
) -> None:
    """Bound while no store was configured: nothing to check then; the worker's start and the
    first use in a process refuse it, before any lease is written."""
    app = make_app()  # no lock store yet: the definition cannot know the range

    @singleton(app, name="range.later", lock_ttl=120)
    def later() -> None:
        pass

    app.finalize()  # every task bound (shared ones of other test modules too), nothing checked

    # When the app gets its store after the task was bound
    app.conf.update(singletask_backend_url=minute_scheme, task_always_eager=True)

    # Then a worker of the app does not start
    with pytest.raises(ConfigurationError, match=r"'range\.later' attribute lock_ttl"):
        CheckLockStore(SimpleNamespace(app=app))
    # And the task's first use fails before anything is written
    with pytest.raises(ConfigurationError, match="minute://"):
        later.apply_async()
    with pytest.raises(ConfigurationError, match="minute://"):
        later()
