"""A Celery app on this machine, with no server to install: where it keeps its things.

:class:`Setup` says where the app keeps its messages, results and locks. Each defaults to an
embedded part in one folder: kombu's filesystem transport as the broker, Celery's file result
backend, and singletask's SQLite lock store. Any of them can be a server instead (Redis,
RabbitMQ). :func:`configure` applies a setup to an app, in the process that sends tasks and, via
environment variables, in the worker, where the worker's ``worker_ready`` and
``worker_process_init`` signals and singletask's ``lock_conflict`` append to the folder's event
log (see :mod:`singletask.demo.events`), which works on every broker, including the filesystem
one where remote control is not dependable.

:mod:`singletask.demo.worker` runs the worker, and ``singletask demo``
(:mod:`singletask.demo.runner`) and the programs in ``examples/``
(:mod:`singletask.demo.example`) are built on both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import signals as celery_signals
from kombu import Exchange, Queue

from ..backends.urls import mask_url
from ..signals import lock_conflict
from .events import EventLog

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["DemoError", "Setup", "configure"]

#: Prefix of the environment variables that carry a :class:`Setup` to the worker.
ENV_PREFIX = "SINGLETASK_LOCAL_"

#: The app setting that holds the setup's folder (the event log lives there).
FOLDER_SETTING = "singletask_local_folder"


class DemoError(Exception):
    """The demo or an example cannot go on; the message says why."""


@dataclass(frozen=True)
class Setup:
    """Where an app keeps its messages, results and locks. ``None`` means "embedded".

    Attributes:
        folder: A folder of this run: the event log, the worker's log, and the embedded parts.
        broker: A broker URL, or None for kombu's filesystem transport in ``folder``.
        backend: A result backend URL, or None for Celery's file backend in ``folder``.
        locks: A lock store URL, or None for a SQLite file in ``folder``.
        queue: The queue the tasks go to (a run of its own, so nothing else is consumed).
        key_prefix: The lock key prefix, or None for singletask's default.
    """

    folder: Path
    broker: str | None = None
    backend: str | None = None
    locks: str | None = None
    queue: str = "celery"
    key_prefix: str | None = None

    @property
    def broker_url(self) -> str:
        return self.broker or "filesystem://"

    @property
    def result_backend(self) -> str:
        return self.backend or f"file://{self.folder / 'results'}"

    @property
    def lock_url(self) -> str:
        return self.locks or f"sqlite:///{self.folder / 'locks.db'}"

    @property
    def events(self) -> Path:
        return self.folder / "events.jsonl"

    def describe(self) -> list[tuple[str, str]]:
        """What is used for what, for people: ``[("broker", "..."), ...]``."""
        here = "in the run's temporary folder"
        return [
            (
                "broker",
                mask_url(self.broker) if self.broker else f"kombu's filesystem transport, {here}",
            ),
            (
                "results",
                mask_url(self.backend) if self.backend else f"Celery's file result backend, {here}",
            ),
            (
                "locks",
                mask_url(self.locks) if self.locks else f"SQLite (sqlite:///...), {here}",
            ),
        ]

    def prepare(self) -> None:
        """Create the folders the embedded parts need."""
        for sub in ("broker/queue", "broker/control", "broker/processed", "results"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)

    def celery_settings(self) -> dict[str, Any]:
        exchange = Exchange(self.queue, type="direct", durable=False, auto_delete=True)
        settings: dict[str, Any] = {
            "broker_url": self.broker_url,
            "result_backend": self.result_backend,
            "singletask_backend_url": self.lock_url,
            "task_queues": [
                Queue(self.queue, exchange, routing_key=self.queue, durable=False, auto_delete=True)
            ],
            "task_default_queue": self.queue,
            "task_default_exchange": self.queue,
            "task_default_routing_key": self.queue,
            "worker_prefetch_multiplier": 1,
            "broker_connection_retry_on_startup": True,
            FOLDER_SETTING: str(self.folder),
        }
        if self.key_prefix is not None:
            settings["singletask_key_prefix"] = self.key_prefix
        if self.broker is None:
            broker = self.folder / "broker"
            # kombu's filesystem transport, with whole messages (see singletask.demo.transport).
            settings["broker_transport"] = "singletask.demo.transport:Transport"
            settings["broker_transport_options"] = {
                "data_folder_in": str(broker / "queue"),
                "data_folder_out": str(broker / "queue"),
                "control_folder": str(broker / "control"),
                # Keep consumed messages in the folder too (the default moves them to /tmp).
                "store_processed": True,
                "processed_folder": str(broker / "processed"),
                "polling_interval": 0.05,
            }
        return settings

    def environ(self) -> dict[str, str]:
        """This setup as environment variables, for the worker subprocess."""
        values = {
            "FOLDER": str(self.folder),
            "BROKER": self.broker,
            "BACKEND": self.backend,
            "LOCKS": self.locks,
            "QUEUE": self.queue,
            "KEY_PREFIX": self.key_prefix,
        }
        return {ENV_PREFIX + name: value for name, value in values.items() if value is not None}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Setup | None:
        """The setup that :meth:`environ` exported, or None if there is none."""
        env = os.environ if environ is None else environ
        folder = env.get(ENV_PREFIX + "FOLDER")
        if not folder:
            return None
        return cls(
            folder=Path(folder),
            broker=env.get(ENV_PREFIX + "BROKER"),
            backend=env.get(ENV_PREFIX + "BACKEND"),
            locks=env.get(ENV_PREFIX + "LOCKS"),
            queue=env.get(ENV_PREFIX + "QUEUE", "celery"),
            key_prefix=env.get(ENV_PREFIX + "KEY_PREFIX"),
        )


def configure(app: Celery, setup: Setup | None = None) -> Setup | None:
    """Apply ``setup`` to ``app`` (by default the one in the environment, if any).

    Also connects the signal receivers that write the event log: worker start-up and every
    lock conflict of the app's singleton tasks.
    """
    setup = setup if setup is not None else Setup.from_environ()
    if setup is None:
        return None
    app.conf.update(setup.celery_settings())
    celery_signals.worker_process_init.connect(
        _process_started, weak=False, dispatch_uid="singletask.demo.process"
    )
    celery_signals.worker_ready.connect(
        _worker_ready, weak=False, dispatch_uid="singletask.demo.ready"
    )
    lock_conflict.connect(_conflict, weak=False, dispatch_uid="singletask.demo.conflict")
    return setup


def _environ_log() -> EventLog | None:
    setup = Setup.from_environ()
    return EventLog(setup.events) if setup is not None else None


def _process_started(**_: Any) -> None:
    log = _environ_log()
    if log is not None:
        log.record("process")


def _worker_ready(**_: Any) -> None:
    log = _environ_log()
    if log is not None:
        log.record("ready")


def _conflict(
    sender: Any = None,
    key: str | None = None,
    holder: str | None = None,
    task_id: str | None = None,
    action: str | None = None,
    **_: Any,
) -> None:
    folder = sender.app.conf.get(FOLDER_SETTING) if sender is not None else None
    if folder and action:
        EventLog(Path(folder) / "events.jsonl").record(
            action, task_id=task_id, task=sender.name, key=key, holder=holder
        )
