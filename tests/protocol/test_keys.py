"""Canonical lock keys, through real task classes (``SingletonTask.lock_key_for``).

Every task here is created with ``shared=False``: a shared task would be re-created in every
app finalized later in the session.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import celery
import pytest
from kombu.utils import json as kombu_json

from singletask import ConfigurationError, LockKeyError, SingletonTask
from singletask.protocol.keys import canonical_json

SECRET = "hunter2-card-4111111111111111"


@pytest.fixture
def app() -> Iterator[celery.Celery]:
    app = celery.Celery("t", set_as_current=False)
    app.conf.singletask_backend_url = "memory://"
    yield app
    app.close()


def singleton(app: celery.Celery, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``@app.task(base=SingletonTask, ...)``, created at once and never shared between apps."""
    return app.task(base=SingletonTask, shared=False, lazy=False, **options)


def suffix_of(key: str, task_name: str) -> str:
    prefix = f"singletask:{task_name}:"
    assert key.startswith(prefix), key
    return key[len(prefix) :]


# -- canonical binding ----------------------------------------------------------------------------


def test_positional_keyword_and_default_arguments_share_a_key(app: celery.Celery) -> None:
    """f(1), f(a=1) and f(1, b=<default>) are the same call, so they take the same lock."""

    # Given a task locked on all of its arguments, one of which has a default
    @singleton(app, name="keys.f", lock_args="*")
    def f(a: int, b: int = 2) -> None: ...

    # When the same call is spelt three ways
    keys = {
        f.lock_key_for((1,), {}),
        f.lock_key_for((), {"a": 1}),
        f.lock_key_for((1,), {"b": 2}),
        f.lock_key_for((), {"b": 2, "a": 1}),
    }

    # Then they share one key, and another value of a default gives another key
    assert len(keys) == 1
    assert f.lock_key_for((1, 3), {}) not in keys
    assert f.lock_key_for((2,), {}) not in keys


def test_the_key_is_the_sha256_of_the_canonical_json(app: celery.Celery) -> None:
    """The suffix is SHA-256 (64 hex digits) of the sorted, whitespace-free JSON arguments."""

    @singleton(app, name="keys.g", lock_args=("a", "b"))
    def g(a: int, b: str) -> None: ...

    key = g.lock_key_for((1, "x"), {})

    assert suffix_of(key, "keys.g") == hashlib.sha256(b'{"a":1,"b":"x"}').hexdigest()


def test_a_tuple_and_a_list_share_a_key(app: celery.Celery) -> None:
    """A tuple becomes a list in a message, so (1, 2) and [1, 2] must lock the same."""

    @singleton(app, name="keys.items", lock_args=("items",))
    def items(items: Any) -> None: ...

    assert items.lock_key_for(((1, 2),), {}) == items.lock_key_for(([1, 2],), {})
    assert items.lock_key_for(([1, 2],), {}) != items.lock_key_for(([2, 1],), {})


def test_dict_order_does_not_matter(app: celery.Celery) -> None:
    """Two equal dicts lock the same, whatever their insertion order (nested too)."""

    @singleton(app, name="keys.opts", lock_args=("options",))
    def opts(options: dict[str, Any]) -> None: ...

    first = {"a": 1, "b": {"x": 1, "y": 2}}
    second = {"b": {"y": 2, "x": 1}, "a": 1}
    assert opts.lock_key_for((first,), {}) == opts.lock_key_for((second,), {})
    assert opts.lock_key_for((first,), {}) != opts.lock_key_for(({"a": 2},), {})


@pytest.mark.parametrize(
    ("value", "same", "other"),
    [
        (
            datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc),
            datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc),
            datetime(2024, 5, 1, 12, 1, tzinfo=timezone.utc),
        ),
        (
            uuid.UUID("12345678-1234-5678-1234-567812345678"),
            uuid.UUID("12345678123456781234567812345678"),
            uuid.UUID("87654321-1234-5678-1234-567812345678"),
        ),
        (Decimal("9.99"), Decimal("9.99"), Decimal("10.00")),
    ],
    ids=["datetime", "uuid", "decimal"],
)
def test_datetime_uuid_and_decimal_values_make_keys(
    app: celery.Celery, value: Any, same: Any, other: Any
) -> None:
    """Values kombu's JSON knows (datetime, UUID, Decimal) are valid lock arguments."""

    @singleton(app, name="keys.typed", lock_args=("value",))
    def typed(value: Any) -> None: ...

    assert typed.lock_key_for((value,), {}) == typed.lock_key_for((same,), {})
    assert typed.lock_key_for((value,), {}) != typed.lock_key_for((other,), {})


def test_an_unserialisable_value_raises_lock_key_error_naming_the_argument(
    app: celery.Celery,
) -> None:
    """A value with no canonical JSON form (a set) -> LockKeyError naming that argument."""

    @singleton(app, name="keys.tags", lock_args="*")
    def tags(customer_id: int, tags: Any) -> None: ...

    with pytest.raises(LockKeyError, match="'tags'") as caught:
        tags.lock_key_for((42, {"a", "b"}), {})
    assert isinstance(caught.value, TypeError)
    assert "keys.tags" in str(caught.value)


def test_arguments_that_do_not_match_the_signature_raise_lock_key_error(
    app: celery.Celery,
) -> None:
    """A call the signature cannot bind -> LockKeyError, not a bare TypeError from inspect."""

    @singleton(app, name="keys.one", lock_args=("a",))
    def one(a: int) -> None: ...

    with pytest.raises(LockKeyError, match=r"keys\.one"):
        one.lock_key_for((1, 2), {})


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((1,), {}, None),
        ((), {"a": 1}, None),
        ((1, 2), {}, None),
        ((1,), {"b": 2, "c": 3}, None),
        ((), {"c": 3, "a": 1}, None),
        ((1, 2, 3, 4), {}, "too many positional arguments"),
        ((1,), {"a": 1}, "multiple values for argument 'a'"),
        ((1,), {"z": 0}, "unexpected keyword argument 'z'"),
        ((), {"b": 2}, "missing a required argument: 'a'"),
    ],
)
def test_binding_matches_inspect_for_every_kind_of_call(
    app: celery.Celery, args: tuple[Any, ...], kwargs: dict[str, Any], error: str | None
) -> None:
    """Keys bind calls exactly as ``inspect.Signature.bind`` with defaults applied would, and a
    call it rejects is a LockKeyError with inspect's own explanation."""

    @singleton(app, name="keys.bind", lock_args="*")
    def bind(a: int, b: int = 2, *, c: int = 3) -> None: ...

    if error is not None:
        with pytest.raises(LockKeyError, match=error):
            bind.lock_key_for(args, kwargs)
        return
    bound = inspect.signature(bind.run).bind(*args, **kwargs)
    bound.apply_defaults()
    expected = hashlib.sha256(
        json.dumps(dict(bound.arguments), sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    assert suffix_of(bind.lock_key_for(args, kwargs), "keys.bind") == expected


def test_canonical_json_is_kombus_json(app: celery.Celery) -> None:
    """The encoder singletask keeps gives exactly what kombu's ``dumps`` gives for each call."""
    value = {
        "when": datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
        "id": uuid.UUID(int=7),
        "amount": Decimal("1.10"),
        "names": ["é", "z", "a"],
        "nested": {"b": 1, "a": (2, 3)},
    }
    assert canonical_json(value) == kombu_json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def test_raw_argument_values_never_appear_in_the_key(app: celery.Celery) -> None:
    """Keys are digests: an argument value (a secret, say) is never readable in Redis."""

    @singleton(app, name="keys.charge", lock_args=("card", "email"))
    def charge(card: str, email: str) -> None: ...

    key = charge.lock_key_for((SECRET, "someone@example.com"), {})

    assert SECRET not in key
    assert "4111" not in key
    assert "someone" not in key
    assert len(suffix_of(key, "keys.charge")) == 64


# -- which arguments ------------------------------------------------------------------------------


def test_lock_args_subset_ignores_other_arguments(app: celery.Celery) -> None:
    """With lock_args=("customer_id",), only customer_id decides the key."""

    @singleton(app, name="keys.sync", lock_args=("customer_id",))
    def sync(customer_id: int, full: bool = False, note: str = "") -> None: ...

    base = sync.lock_key_for((42,), {})
    assert sync.lock_key_for((42, True, "x"), {}) == base
    assert sync.lock_key_for((), {"customer_id": 42, "note": "y"}) == base
    assert sync.lock_key_for((43,), {}) != base


def test_star_uses_every_parameter_including_varargs(app: celery.Celery) -> None:
    """lock_args="*" keys on every parameter, *args and **kwargs included."""

    @singleton(app, name="keys.star", lock_args="*")
    def star(a: int, *rest: int, **extra: Any) -> None: ...

    base = star.lock_key_for((1, 2), {"x": 1})
    assert star.lock_key_for((1, 2), {"x": 1}) == base
    assert star.lock_key_for((1, 3), {"x": 1}) != base
    assert star.lock_key_for((1, 2), {"x": 2}) != base
    assert star.lock_key_for((1, 2), {"x": 1, "y": 0}) != base
    assert star.lock_key_for((2, 2), {"x": 1}) != base


def test_the_global_key_is_the_prefix_and_task_name(app: celery.Celery) -> None:
    """Without lock_args / lock_key, one lock per task name: exactly singletask:<name>."""

    @singleton(app, name="proj.tasks.rebuild_index")
    def rebuild(kind: str = "all") -> None: ...

    assert rebuild.lock_key_for((), {}) == "singletask:proj.tasks.rebuild_index"
    assert rebuild.lock_key_for(("partial",), {}) == "singletask:proj.tasks.rebuild_index"


def test_the_global_key_uses_the_generated_task_name(app: celery.Celery) -> None:
    """With no explicit name, the key uses the name Celery generated for the task."""

    @singleton(app)
    def nightly() -> None: ...

    assert nightly.lock_key_for() == f"singletask:{nightly.name}"
    assert nightly.name.endswith("nightly")


# -- lock_key -------------------------------------------------------------------------------------


def test_lock_key_format_string(app: celery.Celery) -> None:
    """lock_key as a format string over parameter names replaces the digest, defaults applied."""

    @singleton(app, name="keys.feed", lock_key="feed:{url}:{region}")
    def feed(url: str, region: str = "eu", force: bool = False) -> None: ...

    expected = "singletask:keys.feed:feed:https://x.example/rss:eu"
    assert feed.lock_key_for(("https://x.example/rss",), {}) == expected
    assert feed.lock_key_for((), {"url": "https://x.example/rss", "force": True}) == expected


def test_lock_key_callable(app: celery.Celery) -> None:
    """lock_key as a callable gets the call's arguments; its text replaces the digest."""

    def by_tenant(tenant: str, *args: Any, **kwargs: Any) -> str:
        return f"tenant-{tenant.lower()}"

    @singleton(app, name="keys.report", lock_key=by_tenant)
    def report(tenant: str, day: str) -> None: ...

    assert report.lock_key_for(("ACME", "mon"), {}) == "singletask:keys.report:tenant-acme"
    assert report.lock_key_for(("acme",), {"day": "tue"}) == "singletask:keys.report:tenant-acme"


def test_a_lock_key_callable_returning_no_text_raises_lock_key_error(app: celery.Celery) -> None:
    """A lock_key callable must return a non-empty str."""

    @singleton(app, name="keys.empty", lock_key=lambda *args, **kwargs: "")
    def empty(a: int) -> None: ...

    with pytest.raises(LockKeyError, match="non-empty str"):
        empty.lock_key_for((1,), {})


# -- prefix and task shapes -----------------------------------------------------------------------


def test_custom_key_prefix(app: celery.Celery) -> None:
    """singletask_key_prefix replaces "singletask:" in every key."""
    # Given an app with its own prefix
    app.conf.singletask_key_prefix = "myapp:locks:"

    @singleton(app, name="keys.prefixed")
    def prefixed() -> None: ...

    @singleton(app, name="keys.prefixed_args", lock_key="{a}")
    def prefixed_args(a: int) -> None: ...

    # Then keys start with it
    assert prefixed.lock_key_for() == "myapp:locks:keys.prefixed"
    assert prefixed_args.lock_key_for((7,), {}) == "myapp:locks:keys.prefixed_args:7"


def test_bound_tasks_drop_self_from_the_key(app: celery.Celery) -> None:
    """bind=True: the task instance is not an argument of the key."""

    @singleton(app, name="keys.bound", bind=True, lock_args=("customer_id",))
    def bound(self: Any, customer_id: int) -> None: ...

    @singleton(app, name="keys.bound_star", bind=True, lock_args="*")
    def bound_star(self: Any, customer_id: int) -> None: ...

    assert bound.lock_key_for((42,), {}) == bound.lock_key_for((), {"customer_id": 42})
    assert suffix_of(bound_star.lock_key_for((42,), {}), "keys.bound_star") == (
        hashlib.sha256(b'{"customer_id":42}').hexdigest()
    )


def test_class_based_tasks_key_on_run_parameters(app: celery.Celery) -> None:
    """A SingletonTask subclass with run(self, url) keys on url, like a decorated function."""

    # Given a class-based task registered on the app
    class Fetch(SingletonTask):
        name = "keys.fetch"
        lock_args = ("url",)

        def run(self, url: str) -> str:
            return url

    class FetchByFormat(SingletonTask):
        name = "keys.fetch_format"
        lock_key = "url:{url}"

        def run(self, url: str) -> str:
            return url

    fetch = app.register_task(Fetch())
    fetch_format = app.register_task(FetchByFormat())

    # Then its key follows the same rules
    key = fetch.lock_key_for(("https://a.example",), {})
    assert key == fetch.lock_key_for((), {"url": "https://a.example"})
    assert suffix_of(key, "keys.fetch") == (
        hashlib.sha256(b'{"url":"https://a.example"}').hexdigest()
    )
    assert fetch_format.lock_key_for(("u",), {}) == "singletask:keys.fetch_format:url:u"


# -- bad lock_key templates and values ----------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "complaint"),
    [
        ("{a!z}", "unknown conversion 'z'"),
        ("{a:{width}}", "field 'width', which is not a parameter"),
        ("day:\ud800{a}", "not valid text"),
    ],
    ids=["bad-conversion", "nested-field-not-a-parameter", "lone-surrogate-in-template"],
)
def test_what_a_template_shows_by_itself_is_refused_at_definition(
    app: celery.Celery, template: str, complaint: str
) -> None:
    """A template whose fault needs no call (a conversion other than !r/!s/!a, a field in a
    nested format spec that is not a parameter, text that is not valid) is a ConfigurationError
    when the task is defined, naming the task and the template."""
    # When a task is defined with such a template
    with pytest.raises(ConfigurationError) as caught:

        @singleton(app, name="keys.bad_template", lock_key=template)
        def bad_template(a: int) -> None: ...

    # Then the message names the task, the template and the fault
    message = str(caught.value)
    assert "keys.bad_template" in message
    assert repr(template) in message
    assert complaint in message


@pytest.mark.parametrize(
    ("template", "value", "cause"),
    [
        ("{a:>>>}", 7, ValueError),
        ("{a.nope}", 7, AttributeError),
        ("{a[3]}", [1], IndexError),
        ("{a[k]}", {}, KeyError),
        ("{a}", "\ud800", UnicodeEncodeError),
    ],
    ids=["bad-format-spec", "missing-attribute", "missing-index", "missing-item", "surrogate"],
)
def test_a_value_that_does_not_fit_the_template_is_a_lock_key_error_naming_it(
    app: celery.Celery, template: str, value: object, cause: type[Exception]
) -> None:
    """What depends on the values is checked per call: LockKeyError naming the task, the
    template and the argument, chained (``from``) to the error str.format raised."""

    # Given a task whose template is valid by itself
    @singleton(app, name="keys.by_value", lock_key=template)
    def by_value(a: Any) -> None: ...

    # When the key is built for a value that does not fit it
    with pytest.raises(LockKeyError) as caught:
        by_value.lock_key_for((value,), {})

    # Then singletask's own error names the task, the template and the argument
    message = str(caught.value)
    assert "keys.by_value" in message
    assert repr(template) in message
    assert "argument 'a'" in message
    # And the original error is chained
    assert isinstance(caught.value.__cause__, cause)


def test_a_failing_lock_key_callable_is_a_chained_lock_key_error(app: celery.Celery) -> None:
    """An exception raised by a lock_key callable becomes LockKeyError, chained to it."""

    def broken(a: int) -> str:
        raise KeyError("tenant")

    @singleton(app, name="keys.broken_callable", lock_key=broken)
    def broken_callable(a: int) -> None: ...

    with pytest.raises(LockKeyError, match=r"keys\.broken_callable.*broken.*KeyError") as caught:
        broken_callable.lock_key_for((1,), {})
    assert isinstance(caught.value.__cause__, KeyError)


def test_a_lone_surrogate_in_lock_args_still_gets_a_key_of_its_own(app: celery.Celery) -> None:
    """lock_args hashes its values: a lone surrogate hashes like any other text."""

    @singleton(app, name="keys.surrogate", lock_args=("a",))
    def surrogate(a: str) -> None: ...

    key = surrogate.lock_key_for(("\ud800",), {})
    assert key != surrogate.lock_key_for(("\ud801",), {})
    key.encode()  # a key is always valid text


# -- an unambiguous encoding --------------------------------------------------------------------


def test_two_tasks_never_share_a_key_even_when_name_and_key_text_line_up(
    app: celery.Celery,
) -> None:
    """Task "reports" with lock_key "daily:{day}" and task "reports:daily" with lock_key "{day}"
    once both made the key "singletask:reports:daily:<day>": one skipped the other."""

    # Given the two tasks of the issue
    @singleton(app, name="reports", lock_key="daily:{day}")
    def reports(day: str) -> None: ...

    @singleton(app, name="reports:daily", lock_key="{day}")
    def reports_daily(day: str) -> None: ...

    # When both compute the key for the same day
    first = reports.lock_key_for(("mon",), {})
    second = reports_daily.lock_key_for(("mon",), {})

    # Then the keys differ: the ':' of a task name is escaped
    assert first != second
    assert first == "singletask:reports:daily:mon"
    assert second == "singletask:reports%3Adaily:mon"


def test_a_global_key_and_a_keyed_one_never_meet(app: celery.Celery) -> None:
    """Task "a:b" (one lock) and task "a" with lock_key "b" have different keys."""

    @singleton(app, name="a:b")
    def whole() -> None: ...

    @singleton(app, name="a", lock_key="b")
    def keyed() -> None: ...

    assert whole.lock_key_for() != keyed.lock_key_for()


def test_escaping_keeps_every_key_distinct_and_free_of_braces(app: celery.Celery) -> None:
    """Escaped texts never collide with texts that look like their escapes, and no part but
    the prefix can make a Redis Cluster hash tag."""

    @singleton(app, name="keys.raw", lock_key="{text}")
    def raw(text: str) -> None: ...

    texts = ["a{b}", "a%7Bb%7D", "a%257Bb", "50%", "x:y"]
    keys = [raw.lock_key_for((text,), {}) for text in texts]

    assert len(set(keys)) == len(texts)
    assert all("{" not in key and "}" not in key for key in keys)
    assert keys[0] == "singletask:keys.raw:a%7Bb%7D"
