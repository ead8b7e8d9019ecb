"""Exceptions and Skipped survive the trips Celery makes them take (pickle, JSON results)."""

from __future__ import annotations

import dataclasses
import pickle
import uuid
from collections.abc import Iterator

import celery
import pytest
from kombu.utils.json import dumps, loads

import singletask.exceptions
from singletask import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    ConfigurationError,
    LockKeyError,
    SingletaskError,
    Skipped,
    TaskLocked,
    UnknownBackendError,
)

KEY = "singletask:proj.sync:4f2a"


@pytest.fixture
def result_app() -> Iterator[celery.Celery]:
    """An app with a real (in-process) result backend using the JSON serializer."""
    app = celery.Celery("t", set_as_current=False, backend="cache+memory://", broker="memory://")
    app.conf.result_serializer = "json"
    app.conf.accept_content = ["json"]
    app.conf.result_accept_content = ["json"]
    yield app
    app.close()


# -- TaskLocked -----------------------------------------------------------------------------------


def test_task_locked_keeps_its_fields_through_pickle() -> None:
    """TaskLocked pickles with key, holder and ttl (the pickle result serializer, billiard)."""
    original = TaskLocked(KEY, "holder-id", 12.5)

    copy = pickle.loads(pickle.dumps(original))

    assert type(copy) is TaskLocked
    assert (copy.key, copy.holder, copy.ttl) == (KEY, "holder-id", 12.5)
    assert str(copy) == str(original)


def test_task_locked_keeps_its_fields_through_celerys_json_result_serialization(
    result_app: celery.Celery,
) -> None:
    """A TaskLocked stored by a JSON result backend comes back as TaskLocked with its fields."""
    backend = result_app.backend
    original = TaskLocked(KEY, "holder-id", 12.5)

    # When Celery prepares the exception for a JSON result, it travels as JSON text, and is
    # turned back into an exception by the reading side
    stored = dumps(backend.prepare_exception(original, "json"))
    restored = backend.exception_to_python(loads(stored))

    # Then it is the same exception
    assert type(restored) is TaskLocked
    assert (restored.key, restored.holder, restored.ttl) == (KEY, "holder-id", 12.5)
    assert str(restored) == str(original)


def test_task_locked_with_unknown_holder_round_trips_json(result_app: celery.Celery) -> None:
    """The optional fields (None) survive the JSON trip too."""
    backend = result_app.backend

    restored = backend.exception_to_python(
        loads(dumps(backend.prepare_exception(TaskLocked(KEY), "json")))
    )

    assert type(restored) is TaskLocked
    assert (restored.key, restored.holder, restored.ttl) == (KEY, None, None)


def test_task_locked_through_a_stored_failure_result(result_app: celery.Celery) -> None:
    """mark_as_failure + AsyncResult: the caller's .get() raises TaskLocked with its fields."""
    # Given a task failure stored with a TaskLocked
    task_id = str(uuid.uuid4())  # the memory cache is process-wide: an id nobody else uses
    backend = result_app.backend
    backend.mark_as_failure(task_id, TaskLocked(KEY, "holder-id", 3.0))

    # When a caller waits for it
    with pytest.raises(TaskLocked) as caught:
        result_app.AsyncResult(task_id).get(timeout=5, propagate=True)

    # Then it gets the exception with its fields
    assert (caught.value.key, caught.value.holder, caught.value.ttl) == (KEY, "holder-id", 3.0)


def test_task_locked_str_is_readable() -> None:
    """str() names the key, the holder and the lease left."""
    message = str(TaskLocked(KEY, "holder-id", 12.34))

    assert message == f"lock {KEY!r} is held by task holder-id (12.3s left on its lease)"
    assert str(TaskLocked(KEY)) == f"lock {KEY!r} is held by another execution"


# -- hierarchy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", singletask.exceptions.__all__)
def test_every_exception_is_a_singletask_error(name: str) -> None:
    """One ``except SingletaskError`` catches everything singletask raises."""
    cls = getattr(singletask.exceptions, name)
    assert issubclass(cls, SingletaskError)


def test_exception_hierarchy() -> None:
    """The documented tree: configuration errors are ValueErrors, key errors TypeErrors."""
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(UnknownBackendError, ConfigurationError)
    assert issubclass(LockKeyError, TypeError)
    assert issubclass(BackendUnavailable, BackendError)
    assert issubclass(BackendTimeout, BackendError)
    assert not issubclass(TaskLocked, BackendError)


# -- Skipped --------------------------------------------------------------------------------------


def test_skipped_round_trips_kombu_json() -> None:
    """Skipped is registered with kombu's JSON, so it comes back as a Skipped."""
    original = Skipped(KEY, "holder-id", 4.5)

    text = dumps({"result": original})
    copy = loads(text)["result"]

    assert "singletask.skipped" in text
    assert copy == original
    assert type(copy) is Skipped


def test_skipped_with_unknown_holder_round_trips_kombu_json() -> None:
    assert loads(dumps(Skipped(KEY))) == Skipped(KEY, None, None)


def test_skipped_round_trips_pickle() -> None:
    original = Skipped(KEY, "holder-id", 4.5)

    assert pickle.loads(pickle.dumps(original)) == original


def test_skipped_through_a_stored_success_result(result_app: celery.Celery) -> None:
    """A skipped run's value, stored as a JSON result, is a Skipped again for the caller."""
    task_id = str(uuid.uuid4())
    result_app.backend.mark_as_done(task_id, Skipped(KEY, "holder-id", 4.5))

    value = result_app.AsyncResult(task_id).get(timeout=5)

    assert value == Skipped(KEY, "holder-id", 4.5)


def test_skipped_str_is_readable() -> None:
    assert str(Skipped(KEY, "holder-id")) == f"skipped: lock {KEY!r} is held by holder-id"
    assert str(Skipped(KEY)) == f"skipped: lock {KEY!r} is held by another execution"


def test_skipped_repr_names_every_field_as_a_dataclass_does() -> None:
    value = Skipped(KEY, "holder-id", 4.5, ("a", None), "limit", 1.25, "gate")
    fields = ", ".join(f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value))

    assert repr(value) == f"Skipped({fields})"


def test_the_tree_drawn_in_the_module_is_the_hierarchy() -> None:
    """exceptions.py opens with its tree: every exception of the module is drawn in it, under its
    parent (the docs and readers take it from there)."""
    drawn: dict[str, str] = {}
    parents: list[str] = []
    for line in (singletask.exceptions.__doc__ or "").splitlines():
        name = line.strip("│├└─ ").split("(")[0].split(" ")[0]
        if not name or not name[0].isupper() or name not in singletask.exceptions.__all__:
            continue
        depth = (len(line) - len(line.lstrip("│├└─ "))) // 4 - 1
        del parents[depth:]
        if parents:
            drawn[name] = parents[-1]
        parents.append(name)
    for name in singletask.exceptions.__all__:
        if name == "SingletaskError":
            continue
        exc = getattr(singletask.exceptions, name)
        assert name in drawn, f"{name} is missing from the tree"
        assert exc.__mro__[1].__name__ == drawn[name], name
