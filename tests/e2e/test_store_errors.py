"""The lock store failing at a step after the acquire, on real prefork workers.

``lock_on_backend_error`` (docs/configuration.rst) says what an execution does when the lock
store cannot be reached as it takes its lock: by default it is sent again with backoff, on a
budget of its own. Taking the lock is sometimes more than the one acquire: with ``lock_limit``
above 1 a redelivered message reads the key's other slots (is a copy of it running there?), and
with ``lock_scope = "coalesce"`` an execution that finds the run in progress records itself as
the key's follow-up. These tests make the store time out on exactly that second request (the
fault proxy holds its reply back past the workers' 1 s socket timeout, once) and state that the
execution follows ``lock_on_backend_error`` as for the acquire itself: it is retried with
backoff, then runs once, instead of failing at once with the store's error.

Each test has a worker of its own (a :class:`~tests.e2e.faults.FaultEnv`) whose locks live in
the session's private Redis, reached through a :class:`~tests.e2e.proxy.TcpProxy`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from singletask import Skipped
from singletask.backends import backend_from_url
from singletask.backends.redis.wire import CLAIM_NEXT
from singletask.protocol.headers import REDELIVERED_HEADER
from singletask.protocol.slots import slot_keys
from singletask.protocol.tokens import reservation_token

from .faults import BOUND, FaultEnv
from .proxy import TcpProxy
from .tasks_handoffs import PREFIX
from .tasks_limits import PREFIX as LIMITS
from .tasks_scopes import PREFIX as SCOPES
from .tasks_scopes import gate_key

pytestmark = pytest.mark.e2e

#: Longer than the workers' socket timeout (1 s): a reply held this long is a timeout.
HELD = 3.0


@pytest.fixture
def proxied(redis_url: str, tmp_path: Path) -> Iterator[tuple[FaultEnv, TcpProxy]]:
    """A worker whose lock store (the session's Redis) is reached through a proxy."""
    proxy, url = TcpProxy.for_url(redis_url)
    env = FaultEnv(tmp_path, lock_store=f"{url}?socket_timeout=1&socket_connect_timeout=1")
    try:
        env.start_worker()
        yield env, proxy
    finally:
        env.close()
        proxy.close()


def backend_retries(env: FaultEnv, task_id: str) -> int:
    """How many times the worker logged that ``task_id`` retries for an unreachable store."""
    return len(env.log_lines(task_id, "the lock store is unreachable"))


def test_a_store_timeout_in_the_redelivered_twin_check_retries_with_backoff_then_runs(
    proxied: tuple[FaultEnv, TcpProxy], redis_url: str
) -> None:
    """``lock_limit`` above 1, a redelivered message: the read of the other slots times out.
    The execution gives its slot back and is retried (``lock_on_backend_error = "retry"``);
    the retry finds no twin and runs, once."""
    env, proxy = proxied
    label = uuid.uuid4().hex[:12]

    # Given a task with two slots per key, and a message of it that is a redelivered copy (its
    # header says a copy of it was deferred before), so its execution reads the other slot
    task = env.app.tasks[LIMITS + "export"]
    # And the lock store answering that read too late, once (a holder is read in one MULTI
    # transaction: no other request of an execution is one)
    proxy.delay_reply_to(b"$5\r\nMULTI\r\n", HELD)

    # When it runs
    message = task.apply_async(kwargs={"label": label}, headers={REDELIVERED_HEADER: 1})

    # Then it is retried for the unreachable store, not failed, and then runs once
    value: Any = message.get(timeout=BOUND)
    assert isinstance(value, dict), f"{value!r}\n{env.explain()}"
    assert backend_retries(env, message.id) == 1, env.explain()
    assert [s["task_id"] for s in env.probe.starts(label)] == [message.id]
    # And every slot of the key is free again
    locks = backend_from_url(redis_url)
    try:
        key = str(task.lock_key_for((), {"label": label}))
        assert [locks.holder(slot) for slot in slot_keys(key, 2)] == [None, None]
    finally:
        locks.close()


def test_a_store_timeout_in_the_follow_up_claim_retries_with_backoff_then_runs(
    proxied: tuple[FaultEnv, TcpProxy],
) -> None:
    """``lock_scope = "coalesce"``: an execution that finds the run in progress cannot record
    itself as the follow-up (the claim times out). It is retried (``lock_on_backend_error =
    "retry"``), records its claim on the next try, and runs once the run in progress is done."""
    env, proxy = proxied
    label = uuid.uuid4().hex[:12]
    task = env.app.tasks[SCOPES + "coalesced"]

    # Given a coalescing task whose run is in progress (its body waits on a gate)
    running = task.apply_async(kwargs={"label": label, "tag": "first", "hold": True})
    env.probe.wait_for(label, "start")
    # And the lock store answering the next follow-up claim too late, once
    proxy.delay_reply_to(CLAIM_NEXT.sha.encode(), HELD)

    # When another message of the key runs meanwhile (sent by name: no claim when it is sent,
    # so its execution is the first to claim)
    follow_up = env.app.send_task(SCOPES + "coalesced", kwargs={"label": label, "tag": "second"})
    env.wait_until(lambda: backend_retries(env, follow_up.id) >= 1, "a retry for the store")

    # Then it is retried for the unreachable store, not failed
    assert not follow_up.ready() or follow_up.state != "FAILURE", env.explain()

    # When the run in progress ends
    env.probe.client.rpush(gate_key(label), "open")

    # Then both ran, one after the other, the follow-up once
    assert running.get(timeout=BOUND) == "first"
    assert follow_up.get(timeout=BOUND) == "second", env.explain()
    assert [s["task_id"] for s in env.probe.starts(label)] == [running.id, follow_up.id]
    assert env.probe.max_overlap(label) == 1
    assert backend_retries(env, follow_up.id) == 1, env.explain()


#: How long the link stays down as a body ends: far below END_PERSISTENCE (2 s).
BRIEF_OUTAGE = 0.5


def test_a_release_that_meets_the_store_down_is_sent_again_so_no_later_send_joins_the_ended_run(
    proxied: tuple[FaultEnv, TcpProxy],
) -> None:
    """``lock_scope = "queue"``: the lock store is unreachable for half a second as a body ends
    (issue 37: the release was given up at once, the key stayed held for the rest of the lease,
    and sends meanwhile were deduplicated onto the run that had ended, so they never ran). The
    release is sent again until the store is back, before the result is stored: a send made
    once the result is in finds the key free, is published, and runs."""
    env, proxy = proxied
    label = uuid.uuid4().hex[:12]
    task = env.app.tasks[SCOPES + "queued"]

    # Given a run in progress (its body waits on its gate)
    running = task.apply_async(kwargs={"label": label, "hold": True, "note": "first"})
    env.probe.wait_for(label, "start")
    # And the lock store refusing connections as the body ends
    proxy.stop()
    env.probe.client.rpush(gate_key(label), "open")
    env.probe.wait_for(label, "end")
    time.sleep(BRIEF_OUTAGE)
    proxy.start()

    # When the run's result is in
    assert running.get(timeout=BOUND)["note"] == "first", env.explain()
    # And the key is sent again
    later = task.apply_async(kwargs={"label": label, "note": "later"})

    # Then that send is not deduplicated onto the ended run: it is published and runs
    assert later.id != running.id, env.explain()
    assert later.get(timeout=BOUND)["note"] == "later", env.explain()
    assert [s["task_id"] for s in env.probe.starts(label)] == [running.id, later.id]


#: How late the lock store answers the retry's reservation: longer than the retry's countdown.
SLOW_RESERVATION = 1.5


class StoredStates:
    """The states the result backend stores for one task id, in order (the Redis result
    backend publishes each one on the result's key as it stores it)."""

    def __init__(self, env: FaultEnv, task_id: str) -> None:
        self._client = redis.Redis.from_url(env.settings["SINGLETASK_E2E_RESULTS"])
        self._pubsub = self._client.pubsub()
        self._pubsub.subscribe(f"celery-task-meta-{task_id}")
        confirmation = self._pubsub.get_message(timeout=5)
        assert confirmation is not None
        assert confirmation["type"] == "subscribe"
        self._seen: list[str] = []

    def seen(self) -> list[str]:
        while (message := self._pubsub.get_message(timeout=0.3)) is not None:
            if message["type"] == "message":
                self._seen.append(json.loads(message["data"])["status"])
        return list(self._seen)

    def close(self) -> None:
        self._pubsub.close()
        self._client.close()


def test_a_retry_superseded_while_the_store_is_slow_ends_with_its_retried_attempts_outcome(
    proxied: tuple[FaultEnv, TcpProxy],
) -> None:
    """Issue 37 (interaction campaign, seed 697186904): with ``lock_debounce``, a body that
    retries itself and a later send that supersedes the retry. The lock store answers the
    reservation for the retry late. The retried attempt ends superseded (SUCCESS, a Skipped),
    and that must be the outcome its caller sees: the first attempt's RETRY is stored before the
    retried attempt can end, never after it (Celery keeps a SUCCESS only against writes that
    read it: a RETRY read before and written after replaced it for good)."""
    env, proxy = proxied
    label = uuid.uuid4().hex[:12]
    task = env.app.tasks[PREFIX + "versioned_long_window"]
    first_id = str(uuid.uuid4())
    states = StoredStates(env, first_id)

    # Given a body (version 1) that retries itself after 0.3 s, in a 3 s debounce window
    # And the lock store answering the reservation it leaves for its retry 1.5 s late
    proxy.delay_reply_to(reservation_token(first_id, 1).encode(), SLOW_RESERVATION)
    first = task.apply_async((label, 1), {"countdown": 0.3}, task_id=first_id)
    env.probe.wait_for(label, "retrying")

    # When a later send (version 2) supersedes the retry
    second = task.delay(label, 2)

    # Then the retry ends as a Skipped naming it, and the later send runs
    superseded = first.get(timeout=BOUND)
    assert isinstance(superseded, Skipped), f"{superseded!r}\n{env.explain()}"
    assert superseded.reason == "debounced"
    assert superseded.holder == second.id
    assert second.get(timeout=BOUND) == 2, env.explain()
    # And once both attempts are over, the task's state is its retried attempt's outcome
    env.wait_until(lambda: env.log_lines(first_id, "Retry in"), "the first attempt's end")
    assert first.state == "SUCCESS", env.explain()
    # because the first attempt's RETRY was stored before the retried attempt's outcome
    seen = states.seen()
    states.close()
    assert seen == ["RETRY", "SUCCESS"], f"{seen}\n{env.explain()}"
