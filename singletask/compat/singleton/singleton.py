"""``Singleton`` and ``clear_locks``, as celery-singleton 0.3.1 defines them, with singletask's
execution-time guarantees (:mod:`singletask.compat.guard`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Task
from kombu.utils.uuid import uuid

from ...exceptions import ConfigurationError
from ..guard import guarded_call, is_direct, with_key
from . import util
from .backends import get_backend
from .config import Config
from .exceptions import DuplicateTaskError

if TYPE_CHECKING:
    from celery.result import AsyncResult

__all__ = ["Singleton", "clear_locks"]


def clear_locks(app: Any) -> None:
    """Delete every lock under the app's ``singleton_key_prefix``."""
    config = Config(app)
    get_backend(config).clear(config.key_prefix)


if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
else:
    _TaskBase = Task


class Singleton(_TaskBase):
    """A task of which one per key is queued or running: ``unique_on`` (argument names),
    ``raise_on_duplicate``, ``lock_expiry`` (seconds; None: never), and
    ``challenge_lock_on_startup`` (a held key whose task no worker knows is taken over)."""

    abstract = True
    _singleton_backend: Any = None
    _singleton_config: Any = None
    unique_on: ClassVar[str | Sequence[str] | None] = None
    raise_on_duplicate: ClassVar[bool | None] = None
    lock_expiry: ClassVar[float | None] = None
    challenge_lock_on_startup: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_singleton(cls)

    @property
    def _raise_on_duplicate(self) -> bool:
        if self.raise_on_duplicate is not None:
            return bool(self.raise_on_duplicate)
        return bool(self.singleton_config.raise_on_duplicate)

    @property
    def singleton_config(self) -> Config:
        if not self._singleton_config:
            self._singleton_config = Config(self.app)
        return self._singleton_config  # type: ignore[no-any-return]

    @property
    def singleton_backend(self) -> Any:
        if not self._singleton_backend:
            self._singleton_backend = get_backend(self.singleton_config)
        return self._singleton_backend

    def expiry(self) -> float | None:
        """The lock's lifetime: ``lock_expiry``, else ``singleton_lock_expiry``, else None
        (for ever)."""
        expiry = self.lock_expiry
        if expiry is None:
            expiry = self.singleton_config.lock_expiry
        return None if expiry is None else float(expiry)

    def aquire_lock(self, lock: str, task_id: str) -> bool:
        expiry = self.expiry()
        return bool(self.singleton_backend.lock(lock, task_id, expiry=expiry))

    def get_existing_task_id(self, lock: str) -> str | None:
        found = self.singleton_backend.get(lock)
        return None if found is None else str(found)

    def generate_lock(
        self,
        task_name: str,
        task_args: Sequence[Any] | None = None,
        task_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The key: ``singleton_key_prefix`` + md5 of the name and the JSON of the arguments
        (only ``unique_on``'s, by name, when it is set and not empty)."""
        unique_on = self.unique_on
        args: Sequence[Any] = task_args or []
        kwargs: Mapping[str, Any] = task_kwargs or {}
        if unique_on:
            names = [unique_on] if isinstance(unique_on, str) else list(unique_on)
            bound = inspect.signature(self.run).bind(*args, **kwargs).arguments
            args, kwargs = [], {name: bound[name] for name in names}
        return util.generate_lock(
            task_name, args, kwargs, key_prefix=self.singleton_config.key_prefix
        )

    def apply_async(  # type: ignore[override]
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> AsyncResult[Any] | None:
        """Lock the key for the new task id and send; a duplicate gets the holder's
        ``AsyncResult`` (``raise_on_duplicate``: :class:`DuplicateTaskError`)."""
        args = args or []
        kwargs = kwargs or {}
        task_id = task_id or uuid()
        lock = self.generate_lock(str(self.name), args, kwargs)
        run_args = dict(
            args=args, kwargs=kwargs, task_id=task_id, producer=producer, link=link,
            link_error=link_error, shadow=shadow, **with_key(options, lock),
        )  # fmt: skip
        challenged = False
        while True:
            task = self.lock_and_run(lock, **run_args)
            if task:
                return task  # type: ignore[no-any-return]
            existing = self.get_existing_task_id(lock)
            if existing == task_id:  # this task's own retry (self.retry()): it holds the key
                return super().apply_async(**run_args)
            if existing and self.challenge_lock_on_startup and not challenged:
                challenged = True
                if not self.holder_is_known(existing):
                    self.unlock(lock)
                    continue
            if existing:
                return self.on_duplicate(existing)

    def lock_and_run(self, lock: str, *args: Any, task_id: str | None = None, **kwargs: Any) -> Any:
        if self.aquire_lock(lock, str(task_id)):
            try:
                return super().apply_async(*args, task_id=task_id, **kwargs)  # type: ignore[misc]
            except Exception:
                self.unlock(lock)
                raise
        return None

    def holder_is_known(self, task_id: str) -> bool:
        """Whether a worker has ``task_id`` active, reserved or scheduled (asked for 1 s)."""
        inspect_ = self.app.control.inspect(timeout=1.0)
        for answer in (inspect_.active(), inspect_.reserved(), inspect_.scheduled()):
            for tasks in (answer or {}).values():
                entry: Any
                for entry in tasks:
                    request = entry.get("request", entry)
                    if request.get("id") == task_id:
                        return True
        return False

    def release_lock(
        self, task_args: Sequence[Any] | None = None, task_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self.unlock(self.generate_lock(str(self.name), task_args, task_kwargs))

    def unlock(self, lock: str) -> None:
        self.singleton_backend.unlock(lock)

    def unlock_as(self, lock: str, task_id: str | None) -> None:
        """Release at an execution's end: by key (celery-singleton's way), or with
        ``singleton_owner_checked_release`` only while ``task_id`` holds it."""
        if not self.singleton_config.owner_checked_release or task_id is None:
            self.unlock(lock)
            return
        backend = self.singleton_backend
        if hasattr(backend, "unlock_if_owner"):
            backend.unlock_if_owner(lock, task_id)
        elif self.get_existing_task_id(lock) == task_id:
            self.unlock(lock)

    def on_duplicate(self, existing_task_id: str) -> AsyncResult[Any]:
        if self._raise_on_duplicate:
            raise DuplicateTaskError(
                f"Attempted to queue a duplicate of task ID {existing_task_id}",
                task_id=existing_task_id,
            )
        return self.AsyncResult(existing_task_id)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if is_direct(self.request):  # a direct call takes no lock, and touches no store
            return super().__call__(*args, **kwargs)
        task_id = self.request.id

        def take(lock: str) -> str | None:
            if self.aquire_lock(lock, str(task_id)):
                return None
            holder = self.get_existing_task_id(lock)
            return None if holder == task_id else (holder or "")

        def duplicate(holder: str) -> None:
            if self._raise_on_duplicate:
                raise DuplicateTaskError(
                    f"Attempted to run a duplicate of task ID {holder}", task_id=holder
                )

        backend, expiry = self.singleton_backend, self.expiry()
        renew = None
        if hasattr(backend, "renew") and expiry is not None:  # a lifetime, on a store that renews

            def renew(lock: str) -> None:
                backend.renew(lock, str(task_id), expiry)

        return guarded_call(
            self, super().__call__, args, kwargs,
            key_for=lambda a, k: self.generate_lock(str(self.name), a, k),
            take=take, release=lambda lock: self.unlock_as(lock, task_id), on_duplicate=duplicate,
            renew=renew, lease=expiry,
        )  # fmt: skip


def check_singleton(cls: type[Singleton]) -> None:
    """Refuse, when the task class is made, options celery-singleton would fail on later."""
    name = cls.__dict__.get("name") or cls.__qualname__
    unique_on = cls.__dict__.get("unique_on")
    run = cls.__dict__.get("run")
    if unique_on is not None:
        names = [unique_on] if isinstance(unique_on, str) else unique_on
        if not all(isinstance(item, str) for item in names):
            raise ConfigurationError(f"task {name}: unique_on must be argument names")
        if run is not None:
            parameters = inspect.signature(run).parameters
            missing = [item for item in names if item not in parameters]
            if missing:
                raise ConfigurationError(f"task {name}: unique_on names no argument {missing}")
    expiry = cls.__dict__.get("lock_expiry")
    if expiry is not None and (isinstance(expiry, bool) or not isinstance(expiry, int | float)):
        raise ConfigurationError(f"task {name}: lock_expiry must be seconds, got {expiry!r}")
