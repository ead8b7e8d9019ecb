"""When a holder's lease starts: at the send of its acquire, never at the reply or later.

The store starts a lease when it runs the acquire. A holder that started counting when the
reply came back (or, in ``coalesce`` scope, after the follow-up call that comes next) would
believe in its lease for as long as that took after the store has freed the key, and pass
``self.lock.check()`` while a rival holds it. These tests hold one reply of a real Redis back
for 1.5 s (a 2 s lease, no renewal) and watch both sides from the body: the holder's
``check()`` and a rival that tries to take the key directly from the store.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import celery
import pytest

from singletask import LockLost, SingletonTask
from singletask.backends import backend_from_url
from singletask.lease import drift_margin

from ..faultproxy import FaultProxy

LEASE = 2.0
HELD_BACK = 1.5  # the reply held back: most of the lease


@pytest.fixture
def proxy_and_url(redis_url: str) -> Iterator[tuple[FaultProxy, str]]:
    proxy, url = FaultProxy.for_url(redis_url)
    with proxy:
        yield proxy, url


@pytest.fixture
def app(proxy_and_url: tuple[FaultProxy, str], key_prefix: str) -> Iterator[Any]:
    app = celery.Celery("lease-start", set_as_current=False)
    app.conf.update(
        singletask_backend_url=proxy_and_url[1],  # the workers reach Redis through the proxy
        singletask_key_prefix=key_prefix,
        task_always_eager=True,
        task_eager_propagates=True,
    )
    yield app
    app.close()


@pytest.mark.parametrize(
    ("scope", "slow_reply"),
    [
        pytest.param("execution", 1, id="slow-acquire-reply"),
        pytest.param("coalesce", 2, id="slow-follow-up-call"),
    ],
)
def test_check_fails_before_the_store_frees_the_key_whatever_the_reply_took(
    app: Any, proxy_and_url: tuple[FaultProxy, str], redis_url: str, scope: str,
    slow_reply: int,
) -> None:  # fmt: skip
    """Holder and rival never both believe they hold the key: check() raises first."""
    proxy = proxy_and_url[0]
    rival = backend_from_url(redis_url)  # straight to the store, not through the proxy
    seen: dict[str, Any] = {}

    @app.task(
        base=SingletonTask, bind=True, shared=False, lazy=False, name=f"lease-start.{scope}",
        lock_ttl=LEASE, lock_renew=False, lock_scope=scope,
    )  # fmt: skip
    def hold(self: SingletonTask, watch: bool) -> None:
        lock = self.lock
        if not watch or lock is None:
            return
        seen["started"] = time.monotonic()
        lost_at = rival_at = None
        deadline = seen["started"] + 2 * LEASE
        while rival_at is None and time.monotonic() < deadline:
            # The holder's side, then the store's, then the holder's again: a check() that
            # passes after the rival got the key is a moment when both believe they hold it.
            try:
                lock.check()
            except LockLost:
                lost_at = lost_at or time.monotonic()
            if rival.acquire(lock.key, "rival", LEASE).acquired:
                rival_at = time.monotonic()
                try:
                    lock.check()
                except LockLost:
                    lost_at = lost_at or time.monotonic()
                else:
                    seen["check_passed_while_the_rival_held"] = True
            time.sleep(0.005)
        seen["lost_at"], seen["rival_at"] = lost_at, rival_at

    try:
        # Given a client whose connection and scripts are warm (so the next replies are ours)
        hold.apply(args=(False,))
        # And the acquire's reply (or the follow-up call's) held back 1.5 s of a 2 s lease
        # (every later reply is held back too: that only slows the release down)
        proxy.delay_replies(HELD_BACK, after=slow_reply - 1)
        sent = time.monotonic()

        # When the holder runs without renewal while a rival tries to take the key
        hold.apply(args=(True,))
    finally:
        rival.close()

    # Then the reply was indeed late, and the rival got the key within the store's lease
    assert seen["started"] - sent >= HELD_BACK
    assert seen["rival_at"] is not None, "the store never freed the key"
    # And the holder's check() raised LockLost before the store freed the key, never after
    assert "check_passed_while_the_rival_held" not in seen, (
        f"check() passed {seen['rival_at'] - sent:.2f}s after the acquire was sent, when the "
        f"rival already held the key"
    )
    assert seen["lost_at"] is not None
    assert seen["lost_at"] < seen["rival_at"]
    # And the holder gave up no more than the drift margin (plus polling) before the store
    assert seen["lost_at"] - sent <= LEASE - drift_margin(LEASE) + 0.1
