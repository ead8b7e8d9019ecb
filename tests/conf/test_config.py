"""Configuration: task attributes validated at definition time, app settings at first use.

Celery creates the class of an ``@app.task`` lazily (a proxy evaluated on first attribute access
or at ``app.finalize()``), and SingletonTask validates its attributes when that class is created.
These tests pass ``lazy=False`` so the class, and so the validation, happens right at the
decorator; one test shows the same error surfacing at ``app.finalize()`` for a lazy task. Every
task is created with ``shared=False``: a shared task (Celery's default) would be re-created, and
fail again, in every app finalized later in the session.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import celery
import pytest

from singletask import ConfigurationError, LockHandle, SingletonTask, Skipped, TaskLocked
from singletask.backends import backend_from_url
from singletask.conf.settings import DEFAULTS, Settings


@pytest.fixture
def app() -> Iterator[celery.Celery]:
    app = celery.Celery("t", set_as_current=False)
    app.conf.singletask_backend_url = "memory://"
    yield app
    app.close()


def singleton(app: celery.Celery, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``@app.task(base=SingletonTask, ...)``, validated at once, never shared between apps."""
    return app.task(base=SingletonTask, shared=False, lazy=False, **options)


# -- task attributes: validated when the task class is created -----------------------------------


@pytest.mark.parametrize(
    ("options", "attribute"),
    [
        ({"lock_policy": "sometimes"}, "lock_policy"),
        ({"lock_policy": "SKIP"}, "lock_policy"),
        ({"lock_args": ("customer",)}, "lock_args"),
        ({"lock_args": "customer_id"}, "lock_args"),
        ({"lock_args": ()}, "lock_args"),
        ({"lock_ttl": 0}, "lock_ttl"),
        ({"lock_ttl": -5}, "lock_ttl"),
        ({"lock_ttl": math.nan}, "lock_ttl"),
        ({"lock_ttl": math.inf}, "lock_ttl"),
        ({"lock_ttl": "60"}, "lock_ttl"),
        ({"lock_retry_countdown": -1}, "lock_retry_countdown"),
        ({"lock_retry_max": -1}, "lock_retry_max"),
        ({"lock_retry_max": 2.5}, "lock_retry_max"),
        ({"lock_key": "customer:{customer}"}, "lock_key"),
        ({"lock_key": "customer:{0}"}, "lock_key"),
        ({"lock_key": "customer:{}"}, "lock_key"),
        ({"lock_key": "customer:{customer_id"}, "lock_key"),
        ({"lock_key": 42}, "lock_key"),
        ({"lock_renew": "yes"}, "lock_renew"),
        ({"lock_max_hold": 0}, "lock_max_hold"),
        ({"lock_on_backend_error": "ignore"}, "lock_on_backend_error"),
        ({"lock_backend_retry_max": -1}, "lock_backend_retry_max"),
        ({"lock_scope": "enqueue"}, "lock_scope"),
        ({"lock_queue_ttl": 0}, "lock_queue_ttl"),
    ],
    ids=[
        "unknown-policy",
        "policy-wrong-case",
        "lock_args-not-a-parameter",
        "lock_args-bare-string",
        "lock_args-empty",
        "ttl-zero",
        "ttl-negative",
        "ttl-nan",
        "ttl-infinite",
        "ttl-string",
        "retry-countdown-negative",
        "retry-max-negative",
        "retry-max-float",
        "lock_key-unknown-field",
        "lock_key-positional-field",
        "lock_key-auto-numbered-field",
        "lock_key-malformed",
        "lock_key-not-str-or-callable",
        "renew-not-bool",
        "max-hold-zero",
        "backend-error-policy-unknown",
        "backend-retry-max-negative",
        "scope-unknown",
        "queue-ttl-zero",
    ],
)
def test_an_invalid_task_attribute_fails_at_definition_naming_task_and_attribute(
    app: celery.Celery, options: dict[str, Any], attribute: str
) -> None:
    """A bad lock option is a ConfigurationError (a ValueError) when the task is defined."""
    # When a task is defined with the invalid option
    with pytest.raises(ConfigurationError) as caught:

        @singleton(app, name="cfg.sync_customer", **options)
        def sync_customer(customer_id: int, full: bool = False) -> None: ...

    # Then the message names the task and the attribute
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert "cfg.sync_customer" in message
    assert attribute in message


@pytest.mark.parametrize(
    ("attribute", "value", "bound"),
    [
        ("lock_ttl", 1e16, "2592000"),
        ("lock_queue_ttl", 1e16, "2592000"),
        ("lock_max_hold", 1e16, "2592000"),
        ("lock_retry_countdown", 1e12, "2592000"),
        ("lock_ttl", 2592000.5, "2592000"),
        ("lock_retry_max", 10**6, "1000"),
        ("lock_backend_retry_max", 1025, "1000"),
    ],
)
def test_a_number_above_its_bound_fails_at_definition_naming_task_attribute_and_bound(
    app: celery.Celery, attribute: str, value: float, bound: str
) -> None:
    """Every numeric option has an upper bound, checked when the task is defined.

    A lease of about 1e16 seconds used to reach the lock store (where Redis cannot set such an
    expiry), and a retry countdown of 1e12 seconds ended in an OverflowError at run time.
    """
    # When a task is defined with a number above the option's bound
    with pytest.raises(ConfigurationError) as caught:

        @singleton(app, name="cfg.huge", **{attribute: value})
        def huge() -> None: ...

    # Then the message names the task, the attribute and the bound
    message = str(caught.value)
    assert "cfg.huge" in message
    assert attribute in message
    assert f"at most {bound}" in message


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("singletask_lock_ttl", 1e16),
        ("singletask_lock_queue_ttl", 1e16),
        ("singletask_lock_max_hold", 1e16),
        ("singletask_lock_retry_countdown", 1e12),
        ("singletask_lock_retry_max", 10**6),
        ("singletask_lock_backend_retry_max", 10**4),
    ],
)
def test_a_setting_above_its_bound_is_refused_naming_it(
    app: celery.Celery, setting: str, value: float
) -> None:
    """The app settings have the same bounds as the task options."""
    app.conf[setting] = value

    with pytest.raises(ConfigurationError, match=f"setting {setting}: .*at most"):
        Settings.from_app(app)


def test_the_largest_allowed_numbers_are_accepted(app: celery.Celery) -> None:
    """The bounds themselves are allowed."""

    @singleton(
        app,
        name="cfg.largest",
        lock_ttl=30 * 86400,
        lock_queue_ttl=30 * 86400,
        lock_max_hold=30 * 86400,
        lock_retry_countdown=30 * 86400,
        lock_retry_max=1000,
        lock_backend_retry_max=1000,
    )
    def largest() -> None: ...

    assert largest.lock_ttl == 30 * 86400


@pytest.mark.parametrize("template", ["customer:{0}", "customer:{}", "{0.id}"])
def test_a_positional_lock_key_field_is_rejected_as_positional(
    app: celery.Celery, template: str
) -> None:
    """Positional fields ("{0}", "{}") are refused with a hint to name parameters instead."""
    with pytest.raises(ConfigurationError, match="positional field") as caught:

        @singleton(app, name="cfg.positional", lock_key=template)
        def positional(customer_id: int) -> None: ...

    assert "cfg.positional" in str(caught.value)


def test_a_positional_lock_key_field_is_rejected_without_a_signature() -> None:
    """A task class with no run() yet (an abstract base) still gets its lock_key checked."""
    with pytest.raises(ConfigurationError, match="positional field"):

        class Base(SingletonTask):
            name = "cfg.abstract_base"
            lock_key = "item:{0}"


def test_lock_key_and_lock_args_together_fail_at_definition(app: celery.Celery) -> None:
    """lock_key replaces the key derived from lock_args, so setting both is an error."""
    with pytest.raises(ConfigurationError) as caught:

        @singleton(app, name="cfg.both", lock_key="{a}", lock_args=("a",))
        def both(a: int) -> None: ...

    message = str(caught.value)
    assert "cfg.both" in message
    assert "lock_key" in message
    assert "lock_args" in message


def test_a_misspelt_lock_option_fails_at_definition_naming_the_closest_one(
    app: celery.Celery,
) -> None:
    """An unknown lock_* attribute is not ignored: the task would run with the default policy."""
    with pytest.raises(ConfigurationError) as caught:

        @singleton(app, name="cfg.typo", lock_polcy="retry")
        def typo() -> None: ...

    message = str(caught.value)
    assert "cfg.typo" in message
    assert "lock_polcy" in message
    assert "did you mean lock_policy?" in message


def test_an_unknown_lock_attribute_of_a_task_class_lists_the_options() -> None:
    with pytest.raises(
        ConfigurationError, match=r"cfg\.Unknown.*lock_zzz: no such option.*lock_ttl"
    ):

        class Unknown(SingletonTask):
            name = "cfg.Unknown"
            lock_zzz = 3

            def run(self) -> None: ...


def test_the_lock_methods_of_singletontask_may_be_overridden() -> None:
    class Custom(SingletonTask):
        name = "cfg.Custom"

        def lock_key_for(self, args: Any = (), kwargs: Any = None) -> str:
            return "custom"

        def run(self) -> None: ...

    assert Custom.lock_key_for(Custom(), ()) == "custom"


def test_a_class_based_task_is_validated_when_the_class_is_defined() -> None:
    """Subclassing SingletonTask with a bad attribute fails at the class statement."""
    with pytest.raises(ConfigurationError, match=r"cfg\.Klass.*lock_args"):

        class Klass(SingletonTask):
            name = "cfg.Klass"
            lock_args = ("missing",)

            def run(self, url: str) -> None: ...


def test_a_lazy_task_is_validated_when_the_app_is_finalized() -> None:
    """With Celery's default lazy task creation, the error surfaces at app.finalize()."""
    # Given a task with an invalid option, created lazily (not yet a class)
    app = celery.Celery("t", set_as_current=False)

    @app.task(base=SingletonTask, shared=False, name="cfg.lazy", lock_policy="often")
    def lazy() -> None: ...

    # When the app is finalized / Then the task's ConfigurationError is raised
    with pytest.raises(ConfigurationError, match=r"cfg\.lazy.*lock_policy"):
        app.finalize()
    app.close()


def test_valid_task_attributes_are_accepted(app: celery.Celery) -> None:
    """The documented forms of every option define a task without error."""

    @singleton(
        app,
        name="cfg.ok",
        lock_policy="retry",
        lock_args=["customer_id"],
        lock_ttl=0.5,
        lock_retry_countdown=0,
        lock_retry_max=0,
    )
    def ok(customer_id: int) -> None: ...

    @singleton(app, name="cfg.ok_key", lock_key="{customer.id}:{items[0]}")
    def ok_key(customer: Any, items: list[int]) -> None: ...

    assert ok.lock_policy == "retry"
    assert ok_key.lock_key == "{customer.id}:{items[0]}"


def test_a_lease_not_longer_than_the_time_limit_is_warned_about(
    app: celery.Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Without renewal, lock_ttl <= time_limit lets the lock expire while the task runs."""
    with caplog.at_level("WARNING", logger="singletask"):

        @singleton(app, name="cfg.short_lease", lock_ttl=60, lock_renew=False, time_limit=120)
        def short_lease() -> None: ...

    assert any(
        "cfg.short_lease" in r.getMessage() and "time_limit" in r.getMessage()
        for r in caplog.records
    )


# -- app settings -------------------------------------------------------------------------------


def test_library_defaults(app: celery.Celery) -> None:
    """With only a backend URL set, every other setting has its documented default."""
    settings = Settings.from_app(app)

    assert settings.backend_url == "memory://"
    assert settings == Settings(
        backend_setting="memory://",
        key_prefix="singletask:",
        lock_policy="skip",
        lock_scope="execution",
        lock_queue_ttl=3600.0,
        lock_ttl=30.0,
        lock_renew=True,
        lock_max_hold=None,
        lock_retry_countdown=10.0,
        lock_retry_max=30,
        lock_on_backend_error="retry",
        lock_backend_retry_max=10,
        broker_setting=app.conf.broker_url,
    )
    assert DEFAULTS["singletask_lock_policy"] == "skip"


def test_settings_from_conf_update(app: celery.Celery) -> None:
    """app.conf.update(singletask_...) sets every setting."""
    app.conf.update(
        singletask_backend_url="memory://other",
        singletask_key_prefix="locks/",
        singletask_lock_policy="raise",
        singletask_lock_ttl=120,
        singletask_lock_retry_countdown=0,
        singletask_lock_retry_max=3,
        singletask_lock_renew=False,
        singletask_lock_max_hold=600,
        singletask_lock_on_backend_error="run",
        singletask_lock_backend_retry_max=2,
        singletask_lock_scope="queue",
        singletask_lock_queue_ttl=60,
    )

    settings = Settings.from_app(app)

    assert settings.backend_url == "memory://other"
    assert settings == Settings(
        backend_setting="memory://other",
        key_prefix="locks/",
        lock_policy="raise",
        lock_scope="queue",
        lock_queue_ttl=60.0,
        lock_ttl=120.0,
        lock_renew=False,
        lock_max_hold=600.0,
        lock_retry_countdown=0.0,
        lock_retry_max=3,
        lock_on_backend_error="run",
        lock_backend_retry_max=2,
        broker_setting=app.conf.broker_url,
    )


def test_django_style_namespaced_settings() -> None:
    """config_from_object(obj, namespace="CELERY") reads CELERY_SINGLETASK_* settings."""

    # Given a Django-style settings object
    class DjangoSettings:
        CELERY_BROKER_URL = "amqp://guest@localhost//"
        CELERY_SINGLETASK_BACKEND_URL = "redis://locks.example:6379/4"
        CELERY_SINGLETASK_LOCK_POLICY = "retry"
        CELERY_SINGLETASK_LOCK_TTL = 90

    app = celery.Celery("t", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")

    # When the settings are read
    settings = Settings.from_app(app)

    # Then the namespaced values are used
    assert settings.backend_url == "redis://locks.example:6379/4"
    assert settings.lock_policy == "retry"
    assert settings.lock_ttl == 90.0
    app.close()


def test_upper_case_settings() -> None:
    """Old-style upper-case names (SINGLETASK_BACKEND_URL) are read too."""

    class OldStyle:
        BROKER_URL = "amqp://guest@localhost//"
        SINGLETASK_BACKEND_URL = "redis://locks.example:6379/5"
        SINGLETASK_LOCK_RETRY_MAX = 4

    app = celery.Celery("t", set_as_current=False)
    app.config_from_object(OldStyle)

    settings = Settings.from_app(app)

    assert settings.backend_url == "redis://locks.example:6379/5"
    assert settings.lock_retry_max == 4
    app.close()


@pytest.mark.parametrize(
    "broker",
    [
        "redis://:pw@broker.example:6379/0",
        "rediss://broker.example:6380/1",
    ],
)
def test_the_backend_url_falls_back_to_a_redis_broker(broker: str) -> None:
    """Without singletask_backend_url, a redis:// or rediss:// broker is the lock store."""
    app = celery.Celery("t", set_as_current=False, broker=broker)

    assert Settings.from_app(app).backend_url == broker
    app.close()


def test_the_fallback_uses_the_first_of_several_brokers() -> None:
    """A failover broker list ("a;b") falls back to its first URL."""
    app = celery.Celery("t", set_as_current=False)
    app.conf.broker_url = "redis://first:6379/0; redis://second:6379/0"

    assert Settings.from_app(app).backend_url == "redis://first:6379/0"
    app.close()


def test_an_amqp_broker_without_backend_url_fails_at_first_use_without_the_password() -> None:
    """No backend URL and a non-Redis broker: ConfigurationError at first use, password hidden."""
    # Given an app on RabbitMQ with no singletask_backend_url, and a task on it
    app = celery.Celery("t", set_as_current=False, broker="amqp://user:s3cret@rabbit.example//")

    @singleton(app, name="cfg.needs_backend")
    def needs_backend() -> str:
        return "ran"

    # When the task is first used
    with pytest.raises(ConfigurationError) as caught:
        needs_backend()

    # Then the error says what to set, and never shows the broker password
    message = str(caught.value)
    assert "singletask_backend_url" in message
    assert "s3cret" not in message
    app.close()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("singletask_lock_policy", "sometimes"),
        ("singletask_lock_ttl", 0),
        ("singletask_lock_ttl", -1),
        ("singletask_lock_ttl", math.nan),
        ("singletask_lock_ttl", "3600"),
        ("singletask_lock_retry_countdown", -0.5),
        ("singletask_lock_retry_max", -1),
        ("singletask_lock_retry_max", 1.5),
        ("singletask_lock_renew", "no"),
        ("singletask_lock_max_hold", -3),
        ("singletask_lock_on_backend_error", "skip"),
        ("singletask_lock_backend_retry_max", -2),
        ("singletask_lock_scope", "producer"),
        ("singletask_lock_queue_ttl", 0),
        ("singletask_key_prefix", 5),
        ("singletask_backend_url", "localhost:6379"),
        ("singletask_backend_url", 6379),
        ("singletask_backend_table", "Locks; DROP"),
        ("singletask_backend_table", "locks"),  # memory:// has no table
    ],
)
def test_an_invalid_app_setting_is_a_configuration_error_naming_it(
    app: celery.Celery, setting: str, value: object
) -> None:
    """A bad app-level setting is reported, naming the setting, when settings are first read."""
    # Given an app with one invalid setting, and a task on it
    app.conf[setting] = value

    @singleton(app, name="cfg.uses_settings")
    def uses_settings() -> None: ...

    # When the task is first used / Then the error names the setting
    with pytest.raises(ConfigurationError, match=setting):
        uses_settings()
    # (the lock store's URL and table are checked when the store is first built)
    with pytest.raises(ConfigurationError, match=setting):
        build_lock_store(app)


def test_the_backend_table_setting_reaches_a_sql_store() -> None:
    """singletask_backend_table names the table of a postgresql:// or mysql:// lock store."""
    # Given an app whose lock store is PostgreSQL, with a table of its own
    app = celery.Celery("t", set_as_current=False)
    app.conf.singletask_backend_url = "postgresql://postgres@127.0.0.1:5432/test"
    app.conf.singletask_backend_table = "myapp_locks"

    # When the settings are read / Then the table is passed to the store
    settings = Settings.from_app(app)
    assert settings.backend_table == "myapp_locks"
    assert settings.backend_options() == {"table": "myapp_locks"}
    # And without the setting nothing is passed (the store's default table)
    app.conf.singletask_backend_table = None
    assert Settings.from_app(app).backend_options() == {}
    app.close()


def build_lock_store(app: celery.Celery) -> None:
    """Read the settings and build the lock store from them, as a worker does."""
    settings = Settings.from_app(app)
    backend_from_url(settings.backend_url, **settings.backend_options()).close()


# -- precedence ---------------------------------------------------------------------------------


def lease_seen_by(task: Any) -> float:
    """Run ``task`` directly; it returns the lease of the lock it held."""
    result = task()
    assert isinstance(result, float)
    return result


def test_task_attribute_beats_app_setting_beats_library_default(app: celery.Celery) -> None:
    """Precedence of a lock option: task attribute, then app setting, then library default."""

    def report_lease(self: Any) -> float:
        assert isinstance(self.lock, LockHandle)
        return self.lock.ttl

    # Given an app with its own lease, a task overriding it and a task that does not
    app.conf.singletask_lock_ttl = 120
    own = singleton(app, name="cfg.own_ttl", bind=True, lock_ttl=45)(report_lease)
    inherited = singleton(app, name="cfg.app_ttl", bind=True)(report_lease)

    # And a second app with no lease setting at all
    bare = celery.Celery("t2", set_as_current=False)
    bare.conf.singletask_backend_url = "memory://"
    default = singleton(bare, name="cfg.default_ttl", bind=True)(report_lease)

    # When each runs / Then each holds its lock with the lease of the nearest setting
    assert lease_seen_by(own) == 45.0
    assert lease_seen_by(inherited) == 120.0
    assert lease_seen_by(default) == 30.0
    bare.close()


def test_task_policy_beats_app_policy(app: celery.Celery) -> None:
    """lock_policy on a task wins over singletask_lock_policy; the app's wins over "skip"."""
    # Given an app whose default policy is "raise"
    app.conf.singletask_lock_policy = "raise"

    @singleton(app, name="cfg.app_policy")
    def app_policy() -> str:
        return "ran"

    @singleton(app, name="cfg.task_policy", lock_policy="skip")
    def task_policy() -> str:
        return "ran"

    # And both tasks' locks held by someone else
    backend = app_policy.lock_backend
    for task in (app_policy, task_policy):
        assert backend.acquire(task.lock_key_for(), "other", 30, meta={"task_id": "h"}).acquired

    # When each runs / Then the app policy raises, the task policy skips
    with pytest.raises(TaskLocked):
        app_policy()
    assert isinstance(task_policy(), Skipped)


def test_transport_options_are_read_checked_and_kept_out_of_the_repr() -> None:
    """``singletask_backend_transport_options`` is a dict of options (default empty); anything
    else is refused; its values (a sentinel password, say) never appear in the settings' repr."""
    # Given an app with transport options holding a password
    app = celery.Celery("t", set_as_current=False)
    app.conf.singletask_backend_url = "sentinel://127.0.0.1:26379/0"
    options = {"master_name": "m", "sentinel_kwargs": {"password": "s3cret"}}
    app.conf.singletask_backend_transport_options = options
    # Then the settings carry them, without showing them
    settings = Settings.from_app(app)
    assert settings.backend_transport_options == options
    assert "s3cret" not in repr(settings)
    # And a value that is not a dict is refused
    app.conf.singletask_backend_transport_options = ["master_name"]
    with pytest.raises(ConfigurationError, match="singletask_backend_transport_options"):
        Settings.from_app(app)
    app.close()


def test_a_producer_of_an_execution_scope_task_needs_no_lock_store() -> None:
    """delay() of a task with the default "execution" scope never touches the lock store, so
    it needs none configured, even with a broker that is not Redis.

    It used to raise ConfigurationError at send time.
    """
    # Given a producer app on a broker that is not Redis, with no singletask_backend_url
    app = celery.Celery("t", set_as_current=False, broker="memory://")
    app.conf.task_default_queue = f"cfg-producer-{uuid.uuid4().hex}"

    @singleton(app, name="cfg.producer_only")
    def producer_only(n: int) -> int:
        return n

    # When it sends the task / Then the message is sent
    result = producer_only.delay(1)
    assert result.id
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(app.conf.task_default_queue)
        message = queue.get(timeout=5)
        assert message.headers["id"] == result.id
        message.ack()
        queue.close()
    app.close()


def test_a_message_delayed_beyond_the_longest_lease_is_sent_with_a_capped_reservation() -> None:
    """With lock_scope "queue", a message's countdown adds to its reservation; a countdown
    longer than the stores' MAX_LEASE (366 days) caps the reservation there instead of being
    refused by the store (or, before leases were checked, failing inside it)."""
    from singletask.backends.base import MAX_LEASE
    from singletask.send.dedup import queue_lease

    # Given a queue-scope task on an in-process broker and lock store
    app = celery.Celery("t", set_as_current=False, broker="memory://")
    app.conf.update(
        singletask_backend_url="memory://",
        task_default_queue=f"cfg-delayed-{uuid.uuid4().hex}",
    )

    @singleton(app, name="cfg.delayed", lock_scope="queue")
    def delayed() -> None: ...

    # When it is sent with a countdown of 1000 days
    result = delayed.apply_async(countdown=1000 * 86400)

    # Then it was sent, and its key is reserved for MAX_LEASE
    holder = delayed.lock_backend.holder(delayed.lock_key_for())
    assert holder is not None
    assert holder.task_id == result.id
    assert holder.ttl is not None
    assert MAX_LEASE - 60 < holder.ttl <= MAX_LEASE
    assert queue_lease(3600.0, {"countdown": 10**12}) == MAX_LEASE
    app.close()
