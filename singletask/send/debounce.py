"""Debounce when a task is sent (``lock_debounce``, ``lock_debounce_max``).

``SingletonTask.apply_async`` hands a debounced task's messages to :func:`send`. Each send
becomes the latest of its key's *debounce window* in the lock store (one round trip,
:meth:`~singletask.backends.base.LockBackend.debounce`), *pending* while it is published with a
countdown of ``lock_debounce`` seconds, and is then marked published (a second round trip,
:meth:`~singletask.backends.base.LockBackend.debounce_published`): a later send of the key
within that time supersedes it. An earlier message that starts while the latest send is pending
waits for it to be published or taken back (at most :func:`publish_time`) instead of ending
superseded by a send that may never be published. When a
message starts, only the window's latest send runs its body, which closes the window (a closed
window still names it until its record expires, for the earlier sends a worker starts late);
every earlier one ends as a :class:`~singletask.Skipped` naming the send that superseded it (see
:func:`singletask.execution.lifecycle.execute`). With ``lock_debounce_max``, the countdown is
shortened so that no send waits longer than that after the first send of its window, and a steady
stream of sends still runs at least that often. A send whose publish fails is taken back out
of the window (:meth:`~singletask.backends.base.LockBackend.debounce_undo`) before its error
reaches the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from celery.utils import uuid
from celery.utils.time import maybe_iso8601

from ..conf.runtime import app_state
from ..exceptions import BackendError
from .dedup import call_arguments, published_as_is, send_delay
from .records import MAX_PENDING, enter_window, publish_or_undo, publish_time, window_published

if TYPE_CHECKING:
    from celery import Task
    from celery.result import AsyncResult

    from ..conf.options import LockOptions

# MAX_PENDING and publish_time: from singletask.send.records (lock_coalesce "latest" uses them too)
__all__ = ["MAX_PENDING", "publish_time", "send", "wait"]

logger = logging.getLogger("singletask")


def wait(options: LockOptions, age: float) -> float:
    """Seconds a send waits for a later one: ``lock_debounce``, shortened so that the window
    (``age`` seconds old) does not outlast ``lock_debounce_max``."""
    assert options.debounce is not None
    if options.debounce_max is None:
        return options.debounce
    return max(0.0, min(options.debounce, options.debounce_max - age))


def send(
    task: Task[Any, Any],
    options: LockOptions,
    publish: Callable[[str | None, Mapping[str, Any]], AsyncResult[Any]],
    task_id: str | None,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    linked: bool,
    send_options: Mapping[str, Any],
) -> AsyncResult[Any]:
    """Publish a message of the debounced ``task`` with ``publish(task_id, send_options)``.

    The message becomes its key's latest send and waits :func:`wait` seconds, on top of any
    ``countdown`` or ``eta`` it was given; an ``expires`` it was given moves by the same wait
    (beat's recipe ``expires`` of one period would otherwise drop every debounced tick). A
    message :func:`~singletask.send.dedup.published_as_is` (eager mode, retries, canvas parts) is
    published as it is. If the lock store cannot be reached the message is published at once,
    without debounce, and a WARNING says so.
    """
    if published_as_is(task.app, linked, send_options):
        return publish(task_id, send_options)
    task_id = task_id or uuid()
    key = options.key(*call_arguments(args, kwargs))
    delay = send_delay(send_options)
    try:
        backend = app_state(task.app).backend
        # The window outlives its latest message's countdown by lock_queue_ttl, the time a
        # queued message is given to start: an earlier send that starts late still finds it.
        ttl = delay + float(options.debounce or 0) + options.queue_ttl
        previous, age, window = enter_window(
            backend, key, task_id, min(ttl, backend.max_lease),
            pending=publish_time(task.app, send_options),
        )  # fmt: skip
    except BackendError as exc:
        logger.warning(
            "Task %s[%s] sent without debounce: the lock store is unreachable (%s); it runs "
            "when a worker starts it, under the execution-time lock",
            task.name, task_id, exc,
        )  # fmt: skip
        return publish(task_id, send_options)
    waited = wait(options, age)
    countdown = delay + waited
    logger.info(
        "Task %s[%s] debounced on %r: starts in %.1fs unless a later send supersedes it%s",
        task.name, task_id, key, countdown, f" (it supersedes {previous})" if previous else "",
    )  # fmt: skip
    published = {k: v for k, v in send_options.items() if k != "eta"}
    expires = send_options.get("expires")
    if isinstance(expires, int | float) and not isinstance(expires, bool):
        published["expires"] = expires + waited  # counted from the send, which waits longer now
    elif isinstance(expires, datetime | str):
        moment = maybe_iso8601(expires)
        if moment is not None:
            published["expires"] = moment + timedelta(seconds=waited)
    # Unpublished, the send would stay the window's latest: the burst's published sends would
    # all end superseded by it, and no body would run. Taken back, the window is as before.
    # Until then it is pending: an earlier message that starts meanwhile waits for the outcome.
    message = partial(publish, task_id, {**published, "countdown": countdown})
    result = publish_or_undo(task, task_id, message, window)
    window_published(task, backend, key, task_id)
    return result
