"""``QueueOnce`` and ``AlreadyQueued``, as celery-once 3.0.1 defines them, with singletask's
execution-time guarantees (:mod:`singletask.compat.guard`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Task, states
from celery.result import EagerResult
from kombu.utils.uuid import uuid

from ...exceptions import ConfigurationError, SingletaskError
from ..guard import guarded_call, is_direct, option_dict, sent_key, sent_lease, with_key
from .helpers import import_backend, queue_once_key

if TYPE_CHECKING:
    from celery.result import AsyncResult

__all__ = ["ONCE_OPTIONS", "AlreadyQueued", "QueueOnce"]

#: The keys of a task's ``once`` option (a call's ``once`` reads ``graceful`` and ``timeout``).
ONCE_OPTIONS = frozenset({"keys", "graceful", "timeout", "unlock_before_run"})


class AlreadyQueued(SingletaskError):
    """The task is queued or running already; ``countdown``: seconds before its lock expires."""

    def __init__(self, countdown: float) -> None:
        super().__init__(countdown)
        self.countdown = countdown
        self.message = f"Expires in {countdown} seconds"


if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
else:
    _TaskBase = Task


class QueueOnce(_TaskBase):
    """A task sent once at a time per key: ``once={"keys": [...], "graceful": ..., "timeout":
    ..., "unlock_before_run": ...}``; the store is the app setting ``ONCE`` (``CELERY_ONCE``
    under a Django namespace): ``{"backend": "<dotted class>", "settings": {...}}``.

    ``once`` is one class-level dict shared by every task that does not set its own, as in
    celery-once (code that sets ``QueueOnce.once["graceful"] = True`` changes them all).
    """

    abstract = True
    once: ClassVar[dict[str, Any]] = {"graceful": False, "unlock_before_run": False}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_once(cls)

    # -- configuration, read at each use -------------------------------------------------------

    @property
    def config(self) -> Any:
        return self.app.conf

    @property
    def once_config(self) -> Mapping[str, Any]:
        conf = self.config
        found = conf.get("ONCE") or conf.get("CELERY_ONCE")
        if not isinstance(found, Mapping):
            raise ConfigurationError(
                f"task {self.name}: QueueOnce needs the app setting ONCE (CELERY_ONCE under a "
                "Django namespace): {'backend': '<dotted class>', 'settings': {...}}"
            )
        return found

    @property
    def once_backend(self) -> Any:
        """A new backend object, built from ``ONCE`` (celery-once builds one per access)."""
        return import_backend(self.once_config)

    @property
    def default_timeout(self) -> Any:
        return self.once_config.get("settings", {}).get("default_timeout", 60 * 60)

    def unlock_before_run(self) -> bool:
        return bool(self.once.get("unlock_before_run", False))

    def owner_checked(self) -> bool:
        """Whether releases check the owner (``ONCE["settings"]["owner_checked_release"]``;
        the stock backends only)."""
        return bool(self.once_config.get("settings", {}).get("owner_checked_release", False))

    # -- keys ------------------------------------------------------------------------------

    def _get_call_args(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        call_args = dict(inspect.signature(self.run).bind(*args, **kwargs).arguments)
        if isinstance(call_args.get("self"), Task):
            del call_args["self"]
        return call_args

    def get_key(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """The key of a call: ``qo_<task name>`` then ``_<arg>-<value>`` by argument name."""
        call_args = self._get_call_args(args or (), kwargs or {})
        return queue_once_key(str(self.name), call_args, self.once.get("keys"))

    # -- sending -----------------------------------------------------------------------------

    def apply_async(  # type: ignore[override]
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AsyncResult[Any]:
        """Lock the call's key, then send it; if the key is locked raise :class:`AlreadyQueued`,
        or with ``graceful`` return ``EagerResult(None, None, "REJECTED")`` as celery-once does.
        A retry's message (``retries`` set) is sent without a lock."""
        call_once = options.pop("once", None) or {}
        graceful = call_once.get("graceful", self.once.get("graceful", False))
        timeout = call_once.get("timeout", self.once.get("timeout", self.default_timeout))
        if not options.get("retries"):
            key = self.get_key(args, kwargs)
            options.setdefault("task_id", None)
            options["task_id"] = options["task_id"] or uuid()
            try:
                self.lock_key(key, timeout, options["task_id"])
            except AlreadyQueued:
                if graceful:
                    return EagerResult(None, None, states.REJECTED)  # type: ignore[arg-type]
                raise
            options = with_key(options, key, timeout)
        return super().apply_async(args, kwargs, **options)  # type: ignore[arg-type]

    def lock_key(self, key: str, timeout: Any, task_id: str | None) -> None:
        """Take ``key`` through the backend's ``raise_or_lock`` (which raises AlreadyQueued)."""
        if self.owner_checked():
            self.once_backend.raise_or_lock(key, timeout=timeout, owner=task_id)
        else:
            self.once_backend.raise_or_lock(key, timeout=timeout)

    def release_key(self, key: str, task_id: str | None) -> None:
        if self.owner_checked():
            self.once_backend.clear_lock(key, owner=task_id)
        else:
            self.once_backend.clear_lock(key)

    # -- execution ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if is_direct(self.request):  # a direct call takes no lock (celery-once's neither)
            return super().__call__(*args, **kwargs)
        task_id = self.request.id
        if self.unlock_before_run():
            self.release_key(sent_key(self.request) or self.get_key(args, kwargs), task_id)

        def take(key: str) -> AlreadyQueued | None:
            try:
                self.lock_key(key, self.once.get("timeout", self.default_timeout), task_id)
            except AlreadyQueued as refused:
                return refused
            return None

        lease = sent_lease(self.request, self.once.get("timeout", self.default_timeout))
        return guarded_call(
            self, super().__call__, args, kwargs,
            key_for=self.get_key,
            take=take if not self.unlock_before_run() else lambda key: None,
            release=lambda key: self.release_key(key, task_id),
            on_duplicate=self.on_duplicate,
            release_at_end=not self.unlock_before_run(),
            renew=None if self.unlock_before_run() else self.renewer(task_id, lease),
            lease=lease,
        )  # fmt: skip

    def renewer(self, task_id: str | None, lease: float | None) -> Any:
        """What renews a running task's lock: the backend's ``renew``, if it has one (the stock
        ``Redis`` and ``File`` do; celery-once's protocol has none, so a backend of your own
        keeps its ``timeout`` as a bound from the send)."""
        backend = self.once_backend
        if not hasattr(backend, "renew") or lease is None:
            return None
        owner = task_id if self.owner_checked() else None
        return lambda key: backend.renew(key, lease, owner)

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        """Celery's hook (the lock is released in ``__call__``, on every ending, instead)."""
        super().after_return(status, retval, task_id, args, kwargs, einfo)

    def on_duplicate(self, refused: AlreadyQueued) -> None:
        """An execution found its key held by another (it was sent without a lock, as
        ``send_task()`` and beat send): ``graceful`` skips it (its result is None), else it
        fails with the :class:`AlreadyQueued`."""
        if self.once.get("graceful", False):
            return None
        raise refused


def check_once(cls: type[QueueOnce]) -> None:
    """Refuse, when the task class is made, a ``once`` option that is not celery-once's."""
    found = option_dict(cls, "once", ONCE_OPTIONS)
    if found is None:
        return
    name, once = found
    keys = once.get("keys")
    run = cls.__dict__.get("run")
    if keys is None or run is None:
        return
    if isinstance(keys, str) or not all(isinstance(key, str) for key in keys):
        raise ConfigurationError(f"task {name}: once['keys'] must be a list of argument names")
    parameters = inspect.signature(run).parameters
    missing = [key for key in keys if key not in parameters]
    if missing:
        raise ConfigurationError(f"task {name}: once['keys'] names no argument {missing}")
