"""Lease renewal under gevent and eventlet monkey-patching, in a process of its own.

Monkey-patched, ``threading.Thread`` starts a green thread, which runs only when the body
yields. The renewer must not depend on that: it runs on an OS thread with a backend of its
own. tests/e2e/test_pools.py checks the same on real ``-P gevent`` / ``-P eventlet`` workers.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..servers import unavailable

ROOT = Path(__file__).resolve().parents[2]

# With the pool tests (`-m pools`): each test starts an interpreter that imports Celery and
# gevent or eventlet.
pytestmark = pytest.mark.pools

#: Patches the process, then runs eagerly a body that does 5 leases of CPU work without ever
#: yielding (with "steal": after deleting its own lock key), and prints why its lock was lost
#: (None: it was not) and the losses the ``lock_lost`` signal reported.
SCRIPT = textwrap.dedent(
    """
    import sys

    kind, url, prefix, steal = sys.argv[1:5]
    if kind == "gevent":
        from gevent import monkey

        monkey.patch_all()
    else:
        import eventlet

        eventlet.monkey_patch()

    import threading
    import time

    import celery

    from singletask import SingletonTask
    from singletask.signals import lock_lost

    reported = []
    lock_lost.connect(lambda sender, **kw: reported.append(kw["reason"]), weak=False)

    app = celery.Celery("green", set_as_current=False)
    app.conf.update(
        singletask_backend_url=url,
        singletask_key_prefix=prefix,
        task_always_eager=True,
        task_eager_propagates=True,
    )

    @app.task(base=SingletonTask, bind=True, shared=False, lazy=False, lock_ttl=0.6)
    def busy(self):
        if steal == "steal":
            import redis

            redis.Redis.from_url(url).delete(self.lock.key)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            pass
        return self.lock.lost_reason

    print("lost:", busy.apply().get())
    print("reported:", reported)
    """
)


def run(kind: str, redis_url: str, key_prefix: str, steal: str = "") -> list[str]:
    """Run SCRIPT; return its two lines of output."""
    if importlib.util.find_spec(kind) is None:
        unavailable(f"{kind} is not installed (the test extra installs it)")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, kind, redis_url, key_prefix, steal or "-"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-2:]


@pytest.mark.parametrize("kind", ["gevent", "eventlet"])
def test_a_body_that_never_yields_keeps_its_renewed_lease(
    kind: str, redis_url: str, key_prefix: str
) -> None:
    # Given a process monkey-patched by gevent or eventlet
    # When a body with a 0.6 s lease runs 3 s of CPU work without ever yielding to the hub
    lost, reported = run(kind, redis_url, key_prefix)

    # Then its lock was renewed all along: never lost
    assert lost == "lost: None"
    assert reported == "reported: []"


@pytest.mark.parametrize("kind", ["gevent", "eventlet"])
def test_a_loss_found_by_the_renewer_thread_is_reported(
    kind: str, redis_url: str, key_prefix: str
) -> None:
    # Given a process monkey-patched by gevent or eventlet
    # When a body's lock key is deleted under it while it runs without yielding
    lost, reported = run(kind, redis_url, key_prefix, "steal")

    # Then the renewer, on its OS thread, finds it gone and reports it (signal and log)
    reason = "a renewal found it gone or held by another owner"
    assert lost == f"lost: {reason}"
    assert reported == f"reported: [{reason!r}]"
