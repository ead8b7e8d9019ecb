"""Sending singletask's Celery events without making an execution wait for the broker.

:func:`send` puts an event on the queue of the process's :class:`EventSender` for the app (made
on first use, and again in a forked child), whose thread sends it through one Celery event
dispatcher and one broker connection of its own, made when the first event is sent and again
after an error. An execution, or the renewer thread, never waits for the broker: while it is
unreachable, the thread waits for it (Celery's connection retries) and events queue up to
:data:`QUEUE_LIMIT`, beyond which they are dropped with a WARNING. An event that cannot be sent
is logged and dropped, never retried.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["QUEUE_LIMIT", "EventSender", "flush", "send"]

logger = logging.getLogger("singletask")

#: Events a process keeps waiting for the broker before it drops new ones.
QUEUE_LIMIT: Final = 10_000

#: The attribute of the Celery app where its sender (of the process that made it) is kept.
_SENDER: Final = "_singletask_event_sender"

#: Held while a sender is made; a forked child makes a new one (another thread may have held it
#: at the fork, and that thread does not run in the child).
_MAKING = threading.Lock()


def _after_fork() -> None:
    global _MAKING
    _MAKING = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)

#: How long the thread waits for an event before it checks whether its app is still there.
_IDLE: Final = 1.0


def send(app: Celery, type_: str, hostname: str | None, fields: dict[str, Any]) -> None:
    """Queue the event ``type_`` of the node ``hostname`` (None: this process's default name)
    for the app's sender in this process. Never raises, never blocks."""
    sender = app.__dict__.get(_SENDER)
    if sender is None or sender.pid != os.getpid():
        with _MAKING:  # one sender per app and process, however many threads send at once
            sender = app.__dict__.get(_SENDER)
            if sender is None or sender.pid != os.getpid():
                sender = EventSender(app)
                app.__dict__[_SENDER] = sender
    sender.put(type_, hostname, {**fields, "timestamp": time.time()})


def flush(app: Celery, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for this process's queued events of ``app`` to be sent:
    its sender's thread ends with the process."""
    sender = app.__dict__.get(_SENDER)
    if sender is not None and sender.pid == os.getpid() and not sender.join(timeout):
        logger.warning("singletask: events not sent within %.1fs are dropped", timeout)


class EventSender:
    """A thread sending one app's events, in the order they were queued."""

    def __init__(self, app: Celery) -> None:
        self.pid = os.getpid()
        self._queue: queue.Queue[tuple[str, str | None, dict[str, Any]]] = queue.Queue(QUEUE_LIMIT)
        self._dropping = False
        self._thread = threading.Thread(
            target=_run, args=(weakref.ref(app), self._queue), name="singletask-events",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def put(self, type_: str, hostname: str | None, fields: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait((type_, hostname, fields))
            self._dropping = False
        except queue.Full:
            if not self._dropping:
                logger.warning(
                    "singletask: %d events wait for the broker; dropping new ones until it "
                    "takes them", QUEUE_LIMIT,
                )  # fmt: skip
            self._dropping = True

    def join(self, timeout: float) -> bool:
        """Wait until every queued event was sent (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


def _run(app_ref: weakref.ref[Celery], events: queue.Queue[Any]) -> None:
    """The sender's thread: send each event; end when the app is gone."""
    connection: Any = None
    dispatchers: dict[str | None, Any] = {}
    while True:
        try:
            type_, hostname, fields = events.get(timeout=_IDLE)
        except queue.Empty:
            if app_ref() is None:
                break
            continue
        try:
            app = app_ref()
            if app is None:
                break
            if connection is None:
                connection = app.connection_for_write()
            dispatcher = dispatchers.get(hostname)
            if dispatcher is None:
                dispatcher = app.events.Dispatcher(
                    connection, hostname=hostname, enabled=True, buffer_while_offline=False
                )
                dispatchers[hostname] = dispatcher
            dispatcher.send(type_, retry=False, **fields)
        except Exception:
            logger.warning("singletask: could not send the event %s", type_, exc_info=True)
            _close(connection, dispatchers)
            connection, dispatchers = None, {}
        finally:
            del app
            events.task_done()
    _close(connection, dispatchers)


def _close(connection: Any, dispatchers: dict[str | None, Any]) -> None:
    for dispatcher in dispatchers.values():
        try:
            dispatcher.close()
        except Exception:
            logger.debug("singletask: closing an event dispatcher failed", exc_info=True)
    if connection is not None:
        try:
            connection.close()
        except Exception:
            logger.debug("singletask: closing the events connection failed", exc_info=True)
