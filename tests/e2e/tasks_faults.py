"""Tasks of tests/e2e/test_faults.py: singletons that get killed, lose their lock store, or are
delivered twice.

Every task locks ``singletask:e2e.faults.<name>:<label>`` (``lock_key="{label}"``), so each test
has keys of its own. Bodies run inside :class:`LiveProbe`, an overlap detector that stays right
when a body is SIGKILLed: it counts the *live processes* inside a body, so a killed body stops
counting as soon as its process is gone, instead of leaving a running counter behind forever.

A body records what it saw of its lock (fencing token, whether it was lost) and whether this is
the first delivery of its task id; ``first_seconds`` lets the first delivery run long (to be
killed, or to be redelivered by the broker while it runs) and any later one run short.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
from celery import Celery, shared_task
from celery._state import _get_active_apps, connect_on_app_finalize

import singletask.signals
from singletask import SingletaskError, SingletonTask
from singletask.backends import backend_class

from .probe import PROBE_URL_ENV, Probe

PREFIX = "e2e.faults."

#: The short lease of most tasks here, in seconds: a crashed holder blocks its key this long.
LEASE = 2.0

#: The lease of the task whose lock must be freed by the worker, not by its lease running out.
LONG_LEASE = 60.0

# KEYS[1] set of "<pid>:<nonce>" of the bodies running, KEYS[2] high-water mark.
# ARGV[1] the entering body, ARGV[2...] members whose process is gone (dropped first).
_ENTER_LIVE = """
for i = 2, #ARGV do redis.call('SREM', KEYS[1], ARGV[i]) end
redis.call('SADD', KEYS[1], ARGV[1])
local n = redis.call('SCARD', KEYS[1])
local m = tonumber(redis.call('GET', KEYS[2]) or '0')
if n > m then redis.call('SET', KEYS[2], n) end
return n
"""


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie is not: it runs nothing any more)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class LiveProbe(Probe):
    """A :class:`Probe` whose running count is the number of live processes inside a body.

    Writes the same high-water mark as :class:`Probe` (``max_overlap`` reads it) and the same
    ``start`` / ``end`` events.
    """

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._enter_live = self.client.register_script(_ENTER_LIVE)

    @contextlib.contextmanager
    def running(self, label: str, task_id: str | None, **extra: Any) -> Iterator[int]:
        members = f"probe:{label}:live"
        me = f"{os.getpid()}:{uuid.uuid4().hex[:8]}"
        gone = [m for m in self.client.smembers(members) if not process_alive(int(m.split(":")[0]))]
        concurrent = self._enter_live(keys=[members, f"probe:{label}:max"], args=[me, *gone])
        self._record(label, "start", task_id, concurrent=concurrent, **extra)
        try:
            yield concurrent
        finally:
            self.client.srem(members, me)
            self._record(label, "end", task_id, **extra)


_probes: dict[int, LiveProbe] = {}


def live_probe() -> LiveProbe:
    """The probe of this process, from ``SINGLETASK_E2E_PROBE``."""
    pid = os.getpid()
    if pid not in _probes:
        _probes.clear()
        _probes[pid] = LiveProbe(os.environ[PROBE_URL_ENV])
    return _probes[pid]


def lock_state(task: SingletonTask) -> dict[str, Any]:
    """What the running body sees of its lock (``locked`` False when it runs without one)."""
    lock = task.lock
    if lock is None:
        return {"locked": False}
    return {
        "locked": True,
        "key": lock.key,
        "fence": getattr(lock, "fence", None),
        "lost": getattr(lock, "lost", None),
    }


def _body(
    task: SingletonTask, label: str, seconds: float, first_seconds: float | None
) -> dict[str, Any]:
    """Run ``seconds`` (``first_seconds`` on the first delivery of this task id) in the probe."""
    request = task.request
    first = bool(live_probe().client.set(f"probe:{label}:delivered:{request.id}", 1, nx=True))
    duration = first_seconds if first and first_seconds is not None else seconds
    seen = lock_state(task)
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    with live_probe().running(
        label, request.id, pid=os.getpid(), first=first, redelivered=redelivered, **seen
    ):
        time.sleep(duration)
        after = lock_state(task)
    live_probe().mark(label, "after", request.id, **after)
    return {"pid": os.getpid(), "fence": seen.get("fence"), "lost": after.get("lost")}


def _task(name: str, **options: Any) -> Any:
    """``@shared_task`` for a singleton of this module locked per label."""
    return shared_task(
        base=SingletonTask, name=PREFIX + name, bind=True, lock_key="{label}", **options
    )


# -- renewal, fixed leases, capped holds, fencing ------------------------------------------


@_task("renewed", lock_ttl=LEASE)
def renewed(
    self: SingletonTask, label: str, seconds: float = 0.0, first_seconds: float | None = None
) -> dict[str, Any]:
    """A short lease, renewed while the body runs (the default)."""
    return _body(self, label, seconds, first_seconds)


@_task("fixed", lock_ttl=LEASE, lock_renew=False)
def fixed(
    self: SingletonTask, label: str, seconds: float = 0.0, first_seconds: float | None = None
) -> dict[str, Any]:
    """A short lease that is never renewed: a longer body outlives its lock."""
    return _body(self, label, seconds, first_seconds)


#: ``lock_max_hold`` of :func:`capped`, in seconds.
MAX_HOLD = 4.0


@_task("capped", lock_ttl=LEASE, lock_max_hold=MAX_HOLD)
def capped(
    self: SingletonTask, label: str, seconds: float = 0.0, first_seconds: float | None = None
) -> dict[str, Any]:
    """Renewed for ``MAX_HOLD`` seconds at most; the lease then runs out."""
    return _body(self, label, seconds, first_seconds)


@_task("long_lease", lock_ttl=LONG_LEASE)
def long_lease(
    self: SingletonTask, label: str, seconds: float = 0.0, first_seconds: float | None = None
) -> dict[str, Any]:
    """A lease far longer than any test: only the worker can free it quickly."""
    return _body(self, label, seconds, first_seconds)


# -- redelivery ----------------------------------------------------------------------------


@_task("late", lock_ttl=LEASE, acks_late=True, reject_on_worker_lost=True)
def late(
    self: SingletonTask, label: str, seconds: float = 0.0, first_seconds: float | None = None
) -> dict[str, Any]:
    """Acknowledged after the body; requeued when its process is lost."""
    return _body(self, label, seconds, first_seconds)


def late_rated(
    self: SingletonTask, label: str, seconds: float = 0.0, first_seconds: float | None = None
) -> dict[str, Any]:
    """Requeued when its process is lost; one start a minute, so a redelivered copy's takeover
    of its killed delivery's hold (a start) is refused by the rate."""
    return _body(self, label, seconds, first_seconds)


@connect_on_app_finalize
def _register_rated(app: Celery) -> None:
    """``late_rated`` only on apps whose lock store keeps rates (as tasks_handoffs.py does):
    binding it to a memcached store is refused, which would stop that store's workers."""
    url = app.conf.get("singletask_backend_url")
    if url and backend_class(url).supports_rate:
        app.task(
            base=SingletonTask, bind=True, shared=False, name=PREFIX + "late_rated",
            lock_key="{label}", lock_ttl=LONG_LEASE, acks_late=True, reject_on_worker_lost=True,
            lock_scope="queue", lock_rate="1/m",
        )(late_rated)  # fmt: skip


for _app in _get_active_apps():  # apps finalized before this module was imported (a worker's)
    if _app.finalized:
        _register_rated(_app)


# -- lock store faults ---------------------------------------------------------------------

#: ``lock_backend_retry_max`` of :func:`store_retry_short`.
SHORT_BACKEND_BUDGET = 2


@_task("store_retry", lock_ttl=LEASE)
def store_retry(
    self: SingletonTask, label: str, seconds: float = 0.0, first_seconds: float | None = None
) -> dict[str, Any]:
    """Default ``lock_on_backend_error="retry"`` with the default budget."""
    return _body(self, label, seconds, first_seconds)


@_task("store_retry_short", lock_ttl=LEASE, lock_backend_retry_max=SHORT_BACKEND_BUDGET)
def store_retry_short(
    self: SingletonTask, label: str, seconds: float = 0.0, first_seconds: float | None = None
) -> dict[str, Any]:
    """``lock_on_backend_error="retry"`` with a budget of ``SHORT_BACKEND_BUDGET`` retries."""
    return _body(self, label, seconds, first_seconds)


@_task("store_run", lock_ttl=LEASE, lock_on_backend_error="run")
def store_run(
    self: SingletonTask, label: str, seconds: float = 0.0, first_seconds: float | None = None
) -> dict[str, Any]:
    """Runs without a lock when the lock store cannot be reached."""
    return _body(self, label, seconds, first_seconds)


@_task("stalled", lock_ttl=LEASE)
def stalled(self: SingletonTask, label: str, wait: float = 15.0) -> dict[str, Any]:
    """Waits (``wait`` seconds at most) until its lock is reported lost, then records what it
    saw: ``lost``, and what ``self.lock.check()`` raised (event ``"observed"``)."""
    request = self.request
    with live_probe().running(label, request.id, pid=os.getpid(), **lock_state(self)):
        began = time.monotonic()
        while not getattr(self.lock, "lost", False) and time.monotonic() - began < wait:
            time.sleep(0.05)
        waited = time.monotonic() - began
        raised: str | None = None
        singletask_error = False
        try:
            self.lock.check()  # type: ignore[union-attr]
        except Exception as exc:
            raised, singletask_error = type(exc).__name__, isinstance(exc, SingletaskError)
        observed = {"lost": getattr(self.lock, "lost", None), "raised": raised}
        live_probe().mark(
            label, "observed", request.id, waited=waited, singletask_error=singletask_error,
            **observed,
        )  # fmt: skip
    return observed


def _record_lock_lost(
    sender: Any = None,
    key: str | None = None,
    task_id: str | None = None,
    reason: Any = None,
    **_: Any,
) -> None:
    """Record each ``lock_lost`` signal of a task of this module under the key's label."""
    if not isinstance(sender, SingletonTask) or not sender.name.startswith(PREFIX) or not key:
        return
    label = key.rsplit(":", 1)[-1]
    live_probe().mark(label, "lock_lost", task_id, key=key, reason=str(reason))


# Connected only where the signal exists, so that this module imports on any singletask version.
_lock_lost = getattr(singletask.signals, "lock_lost", None)
if _lock_lost is not None:
    _lock_lost.connect(_record_lock_lost, weak=False)
