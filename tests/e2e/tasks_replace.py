"""Tasks of tests/e2e/test_replace.py: ``lock_policy = "replace"`` and ``lock_coalesce =
"latest"`` on a real worker.

Each body writes its version to a *fenced resource* in the probe's Redis (a hash that accepts a
write only with a fencing token larger than the last one it took, in one script), then works
until the test opens its gate, calling ``self.lock.check()`` between steps. A preempted body
records when it learned it and tries one late fenced write, which the resource must refuse.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery
from celery._state import _get_active_apps, connect_on_app_finalize

from singletask import LockLost, LockPreempted, SingletonTask
from singletask.backends import backend_class

from .probe import probe
from .tasks_policies import gate_key, wait_gate

PREFIX = "e2e.replace."

#: The lease: renewed every 0.5 s, so a preempted body learns it within 0.5 s (plus round trips).
TTL = 1.5

#: The longer lease of ``rebuild_long``: renewed every 2 s, so a newer execution sent just after
#: one of its renewals has time to run and end before the next one.
LONG_TTL = 6.0

#: The lease and the renewal cap of ``rebuild_max_hold``: renewed at 2 s and 4 s, no more from
#: the round at 6 s (past 4.5 s); the lease renewed at 4 s runs until 10 s.
MAX_HOLD_TTL = 6.0
MAX_HOLD = 4.5

#: How long a body works at most before it gives up waiting for its gate.
WORK = 30.0

# KEYS[1] the fenced resource (a hash: value, fence)
# ARGV[1] the writer's fencing token, ARGV[2] the value
# Returns 1 when written (the token is larger than the resource's last one), else 0.
FENCED_WRITE = """
local last = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) <= last then return 0 end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
redis.call('EXPIRE', KEYS[1], 3600)
return 1
"""


def resource_key(label: str) -> str:
    return f"fenced:{label}"


def fenced_write(label: str, fence: int, value: int) -> bool:
    """Write ``value`` to the label's resource if ``fence`` is newer than its last writer's."""
    client = probe().client
    return bool(client.eval(FENCED_WRITE, 1, resource_key(label), fence, value))


def rebuild(
    self: SingletonTask, label: str, version: int, check: bool = True, hold: bool = True
) -> int:
    """Write ``version``, then work (checking the lock if ``check``) until the gate opens; with
    ``hold`` False, end right after the write."""
    lock = self.lock
    assert lock is not None
    assert lock.fence is not None
    with probe().running(label, self.request.id, version=version, fence=lock.fence):
        fenced_write(label, lock.fence, version)
        if not hold:
            return version
        deadline = time.monotonic() + WORK
        while time.monotonic() < deadline:
            if check:
                try:
                    lock.check()
                except LockPreempted as exc:
                    late = fenced_write(label, lock.fence, version)
                    probe().mark(
                        label, "preempted", self.request.id, successor=exc.successor,
                        late_write=late, version=version,
                    )  # fmt: skip
                    raise
            if probe().client.lpop(gate_key(label)) is not None:
                return version
            time.sleep(0.02)
    return version


def outlast(self: SingletonTask, label: str, version: int) -> int:
    """Work until the gate opens, checking the lock; on learning it is lost, record when and
    as what (``LockPreempted`` naming the successor, or a plain ``LockLost``), and raise it."""
    lock = self.lock
    with probe().running(label, self.request.id, version=version):
        deadline = time.monotonic() + WORK
        while time.monotonic() < deadline:
            try:
                lock.check()
            except LockLost as exc:
                probe().mark(
                    label, "learned", self.request.id, kind=type(exc).__name__,
                    successor=getattr(exc, "successor", None),
                )  # fmt: skip
                raise
            if probe().client.lpop(gate_key(label)) is not None:
                return version
            time.sleep(0.02)
    return version


def brief(self: SingletonTask, label: str, n: int) -> int:
    """A short replace body for storms: works briefly, checking its lock, and returns ``n``."""
    for _ in range(5):
        time.sleep(0.01)
        self.lock.check()
    return n


def coalesced(self: SingletonTask, label: str, tag: str = "", hold: bool = False) -> str:
    """One run plus one follow-up per label, the follow-up with the latest call's ``tag``."""
    with probe().running(label, self.request.id, tag=tag):
        if hold:
            wait_gate(label)
    return tag


TASKS: list[tuple[str, Any, dict[str, Any]]] = [
    ("rebuild", rebuild, {"lock_policy": "replace"}),
    ("rebuild_long", rebuild, {"lock_policy": "replace", "lock_ttl": LONG_TTL}),
    ("rebuild_slots", rebuild, {"lock_policy": "replace", "lock_limit": 2}),
    ("storm", brief, {"lock_policy": "replace"}),
    ("rebuild_terminate", rebuild, {"lock_policy": "replace", "lock_replace_terminate": True}),
    (
        "rebuild_terminate_long", rebuild,
        {"lock_policy": "replace", "lock_replace_terminate": True, "lock_ttl": LONG_TTL},
    ),
    (
        "rebuild_max_hold", outlast,
        {"lock_policy": "replace", "lock_ttl": MAX_HOLD_TTL, "lock_max_hold": MAX_HOLD},
    ),
    (
        "coalesced_latest", coalesced,
        {"lock_scope": "coalesce", "lock_coalesce": "latest", "lock_retry_countdown": 0.2},
    ),
]  # fmt: skip


@connect_on_app_finalize
def _register(app: Celery) -> None:
    """Only on apps whose lock store can preempt (memcached cannot: binding would stop the
    worker)."""
    url = app.conf.get("singletask_backend_url")
    store = backend_class(url) if url else None
    if store is None or not store.supports_replace:
        return
    for name, body, options in TASKS:
        app.task(
            base=SingletonTask, bind=True, shared=False, lock_args=("label",), name=PREFIX + name,
            **{"lock_ttl": TTL, **options},
        )(body)  # fmt: skip


for _app in _get_active_apps():  # apps finalized before this module was imported (a worker's)
    if _app.finalized:
        _register(_app)
