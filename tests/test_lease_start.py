"""When a holder's lease starts: at the send of its acquire, never at the reply or later.

The store starts a lease when it runs the acquire. A holder that started counting when the
reply came back (or, in ``coalesce`` scope, after the follow-up call that comes next) would
believe in its lease for as long as that took after the store has freed the key, and pass
``self.lock.check()`` while a rival holds it. These tests hold one reply of a real Redis back
for 1.5 s (a 2 s lease, no renewal) and watch both sides from the body: the holder's
``check()`` and a rival that tries to take the key directly from the store.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import celery
import pytest

from singletask import LockLost, SingletonTask
from singletask.backends import backend_from_url
from singletask.lease import drift_margin

from .e2e.proxy import TcpProxy

LEASE = 2.0
HELD_BACK = 1.5  # the reply held back: most of the lease


class ReplyDelayingProxy(TcpProxy):
    """A :class:`TcpProxy` that can hold back the n-th chunk the server sends from now on."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(target)
        self._gate = threading.Lock()
        self._countdown = 0  # chunks left to pass before the held one (0: none armed)
        self._hold = 0.0

    def hold_reply(self, nth: int, seconds: float) -> None:
        """Delay the ``nth`` chunk from the server (counting from 1) by ``seconds``."""
        with self._gate:
            self._countdown, self._hold = nth, seconds

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        if source.getpeername()[1] != self.target[1]:  # client -> server: as it comes
            super()._pump(source, sink)
            return
        try:
            while data := source.recv(65536):
                delay = 0.0
                with self._gate:
                    if self._countdown:
                        self._countdown -= 1
                        if self._countdown == 0:
                            delay = self._hold
                if delay:
                    time.sleep(delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def proxy_and_url(redis_url: str) -> Iterator[tuple[ReplyDelayingProxy, str]]:
    proxy, url = ReplyDelayingProxy.for_url(redis_url)
    assert isinstance(proxy, ReplyDelayingProxy)
    proxy.start()
    yield proxy, url
    proxy.stop()


@pytest.fixture
def app(proxy_and_url: tuple[ReplyDelayingProxy, str], key_prefix: str) -> Iterator[Any]:
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
    app: Any, proxy_and_url: tuple[ReplyDelayingProxy, str], redis_url: str, scope: str,
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
        proxy.hold_reply(slow_reply, HELD_BACK)
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
