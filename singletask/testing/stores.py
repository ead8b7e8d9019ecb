"""The stores a test installs for an app: a fresh one per test, or none at all (locks off)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..backends.base import AcquireResult, Holder, LockBackend, StoreState, Units, UnitsResult
from ..exceptions import BackendUnavailable, UnsupportedOperation
from ..task import override_lock_backend

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["locks_disabled", "routed"]


def _no_units(units: Sequence[Units]) -> None:
    """The test stores route the locks alone: named limits are not kept there."""
    if units:
        raise UnsupportedOperation("the test suite's lock store keeps no named limits")


class _Router(LockBackend):
    """The store an app's tasks see during a test: forwards to the test's store of the moment.

    One router per app, installed with override_lock_backend, so the app keeps one renewer (and
    one renewer thread) however many tests install a fresh store. With ``namespace``, every key
    is stored under it, so tests sharing a real server never see each other's locks.
    """

    def __init__(self) -> None:
        self.target: LockBackend | None = None
        self.namespace = ""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> _Router:
        return cls()

    def _store(self) -> LockBackend:
        target = self.target
        if target is None:
            raise BackendUnavailable("the test's lock store is gone (its test has ended)")
        return target

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        _no_units(units)
        return self._store().acquire(
            self.namespace + key, token, ttl, meta=meta, takeover_prefix=takeover_prefix
        )

    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        _no_units(units)
        return self._store().release(self.namespace + key, token, completed=completed)

    def extend(self, key: str, token: str, ttl: float) -> bool:
        return self._store().extend(self.namespace + key, token, ttl)

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        return self._store().extend_many([(self.namespace + k, t, s) for k, t, s in leases])

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        return self._store().claim_next(self.namespace + key, task_id, ttl)

    def clear_next(self, key: str, task_id: str) -> bool:
        return self._store().clear_next(self.namespace + key, task_id)

    def holder(self, key: str) -> Holder | None:
        return self._store().holder(self.namespace + key)

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        start = len(self.namespace)
        for key, holder in self._store().iter_locks(self.namespace + prefix, page_size=page_size):
            yield key[start:], holder

    def iter_state(self, prefix: str, *, page_size: int = 500) -> Iterator[StoreState]:
        start = len(self.namespace)
        for state in self._store().iter_state(self.namespace + prefix, page_size=page_size):
            yield dataclasses.replace(state, key=state.key[start:])

    def release_held_by(self, key: str, task_id: str) -> Holder | None:
        return self._store().release_held_by(self.namespace + key, task_id)

    def force_release(self, key: str) -> Holder | None:
        return self._store().force_release(self.namespace + key)


class _AlwaysFree(LockBackend):
    """A store in which every lock is free, and every limit has room: locking switched off."""

    supports_units = True

    def __init__(self) -> None:
        self._fences = itertools.count(1)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> _AlwaysFree:
        return cls()

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        return AcquireResult(True, fence=next(self._fences))

    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        return True

    def take_units(
        self,
        token: str,
        ttl: float,
        units: Sequence[Units],
        *,
        meta: Mapping[str, str] | None = None,
    ) -> UnitsResult:
        return UnitsResult(True)  # limits are off with the locks

    def give_units(self, token: str, units: Sequence[Units]) -> list[bool]:
        return [True] * len(units)

    def extend(self, key: str, token: str, ttl: float) -> bool:
        return True

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        return task_id

    def clear_next(self, key: str, task_id: str) -> bool:
        return False

    def holder(self, key: str) -> Holder | None:
        return None

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        return iter(())

    def iter_state(self, prefix: str, *, page_size: int = 500) -> Iterator[StoreState]:
        return iter(())

    def release_held_by(self, key: str, task_id: str) -> Holder | None:
        return None

    def force_release(self, key: str) -> Holder | None:
        return None


_routers: weakref.WeakKeyDictionary[Celery, _Router] = weakref.WeakKeyDictionary()
_routers_mutex = threading.Lock()


@contextlib.contextmanager
def routed(app: Celery, store: LockBackend, namespace: str = "") -> Iterator[_Router]:
    """Point every SingletonTask of ``app`` at ``store`` in this process, until the block ends."""
    with _routers_mutex:
        router = _routers.get(app)
        if router is None:
            router = _routers[app] = _Router()
        if router.target is not None:
            raise RuntimeError(
                f"the locks of app {app.main!r} are already isolated or switched off by an "
                "enclosing isolated_locks() / locks_disabled()"
            )
        router.target, router.namespace = store, namespace
    override_lock_backend(app, router)
    try:
        yield router
    finally:
        override_lock_backend(app, None)
        with _routers_mutex:
            router.target, router.namespace = None, ""


@contextlib.contextmanager
def locks_disabled(app: Celery) -> Iterator[None]:
    """Switch singleton locking off for ``app``'s tasks, in this process, until the block ends.

    Every execution then finds its lock free: duplicates all run, nothing is skipped, retried
    or deduplicated. Keys are still built (a call whose key cannot be built still fails with
    :class:`~singletask.LockKeyError`), and ``self.lock`` is still set in the body.
    :func:`hold_lock` refuses to hold anything meanwhile.
    """
    with routed(app, _AlwaysFree()):
        yield
