"""Flower's task list and task page, told which runs were singletask's outcomes.

Flower renders the fields Celery's event state keeps for a task (its state, ``result``,
``exception``...), not the fields of singletask's own events. A run that singletask ended
without its body shows there as Celery saw it: SUCCESS with a :class:`~singletask.Skipped`
result, FAILURE or RETRY with a :class:`~singletask.TaskLocked` (or
:class:`~singletask.RateLimited`) exception, whose text names the key and the holder.

:func:`format_task` is a formatter for Flower's ``format_task`` option, which Flower applies to
a copy of each task it shows in its task list and on its task page: it reads those texts back
and adds the outcome to the state shown (``SUCCESS: skipped``) and the rows "Lock outcome",
"Lock key" and "Lock holder". Put it in Flower's configuration file
(``flowerconfig.py``, or the file ``--conf`` names)::

    from singletask.observe.flower import format_task

Nothing in Celery or in the result backend changes: ``AsyncResult`` still reports SUCCESS and
returns the ``Skipped``. Flower's API (``/api/task/info``, ``/api/tasks``) does not apply the
formatter; its ``result`` and ``exception`` carry the same texts.

Celery's event state takes the type of an event it does not know as the task's state until its
next known event: while the body of a singleton task runs, Flower has ``SINGLETASK-ACQUIRED``
where it would have STARTED. The formatter shows STARTED again (:func:`shown_state`), which
also brings back the page's Terminate button.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["describe", "format_task", "shown_state"]

#: ``Skipped.reason`` -> the outcome it is.
SKIPPED_OUTCOMES: Final[Mapping[str, str]] = {
    "held": "skipped",
    "rate": "rate_limited",
    "debounced": "superseded",
    "superseded": "superseded",
    "replaced": "preempted",
}

#: A refusal's exception, in a FAILURE or RETRY state -> the outcome it is.
REFUSALS: Final[Mapping[tuple[str, str], str]] = {
    ("FAILURE", "TaskLocked"): "raised",
    ("RETRY", "TaskLocked"): "retried",
    ("FAILURE", "RateLimited"): "rate_limited",
    ("RETRY", "RateLimited"): "rate_limited",
}

#: The state Celery's event state gives a task after one of singletask's events: the event's
#: type, upper case, as for any task event it does not know.
CUSTOM_STATE: Final = "SINGLETASK-"

#: The outcomes of an execution that holds its lock (or held it, its result not reported yet).
RUNNING: Final = frozenset({"acquired", "released", "lease_lost"})

#: The rows :func:`format_task` adds to a task's page.
#: (Flower's page writes a field's name with its first letter in capitals and ``_`` as a space,
#: and "eta" in capitals wherever it occurs: hence not "singletask_...".)
FIELDS: Final = ("lock_outcome", "lock_key", "lock_holder")


def _call(text: object) -> tuple[str, list[Any], dict[str, Any]] | None:
    """The class name, positional and keyword values of a ``repr`` such as
    ``Skipped(key='k', holder=None)``; None when ``text`` is not one (or was cut short)."""
    if not isinstance(text, str) or not text.endswith(")"):
        return None
    try:
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            return None
        args = [ast.literal_eval(arg) for arg in node.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return node.func.id, args, kwargs


def describe(state: object, result: object, exception: object) -> dict[str, Any] | None:
    """The singletask outcome, key and holder that a task's state and the texts Flower shows
    for its ``result`` and ``exception`` tell, or None for a run that did its work."""
    if state == "SUCCESS":
        call = _call(result)
        if call is None or call[0] != "Skipped":
            return None
        fields = call[2]
        outcome = SKIPPED_OUTCOMES.get(str(fields.get("reason", "held")))
        key, holder = fields.get("key"), fields.get("holder")
    else:
        call = _call(exception)
        if call is None:
            return None
        outcome = REFUSALS.get((str(state), call[0]))
        values = [*call[1], None, None]
        key, holder = values[0], values[1] if call[0] == "TaskLocked" else None
    if outcome is None or not isinstance(key, str):
        return None
    return {"lock_outcome": outcome, "lock_key": key, "lock_holder": holder}


def shown_state(state: object, *, revoked: bool = False, rejected: bool = False) -> object:
    """The state to show for a task whose last event was one of singletask's, which Celery's
    event state takes as the task's state (``SINGLETASK-ACQUIRED``...) until Celery reports
    SUCCESS, FAILURE or RETRY, the states that rank above it: REVOKED or REJECTED if Celery
    reported those meanwhile (``revoked``, ``rejected``), else STARTED: the execution is in a
    worker's hands (with the outcome when it did not run its body; RETRY for a lock retry).
    Any other state as it is."""
    if not isinstance(state, str) or not state.startswith(CUSTOM_STATE):
        return state
    if revoked or rejected:
        return "REVOKED" if revoked else "REJECTED"
    outcome = state[len(CUSTOM_STATE) :].lower()
    if outcome in RUNNING:
        return "STARTED"
    return "RETRY: retried" if outcome == "retried" else f"STARTED: {outcome}"


def format_task(task: Any) -> Any:
    """Flower's ``format_task``: the copy of ``task`` Flower shows, with singletask's outcome
    in its state and its rows (see above); a run that did its work is shown as it is."""
    task.state = shown_state(
        getattr(task, "state", None),
        revoked=bool(getattr(task, "revoked", None)),
        rejected=bool(getattr(task, "rejected", None)),
    )
    found = describe(
        getattr(task, "state", None),
        getattr(task, "result", None),
        getattr(task, "exception", None),
    )
    if found is None:
        return task
    for name, value in found.items():
        setattr(task, name, value)
    task.state = f"{task.state}: {found['lock_outcome']}"
    task._fields = (*type(task)._fields, *FIELDS)  # the rows Flower's task page shows
    return task
