"""Issue 37: a message that waits in its worker for a pending publish of its debounce window
(docs/limits.rst, "While a send is being published"), under a time limit, on real prefork
workers and on each lock store that keeps debounce windows.

The pending send is written by the test itself, as a producer whose publish is still under
way writes it (``debounce`` with a publish deadline): a publish that is held for as long as the
test needs, on any store, without a broker outage.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend

from .conftest import sql_lock_store
from .faults import BOUND, FaultEnv
from .tasks_limits import PREFIX

pytestmark = [pytest.mark.e2e, pytest.mark.stores]

#: The debounced task: lock_debounce 1.5 s, lock_debounce_max 3 s, its key by label.
TASK = PREFIX + "rebuild_slow"
#: The pending send's publish deadline: far longer than the waiting message's time limits.
PENDING = 30.0
#: The waiting message's soft time limit: it comes long before the pending send settles.
SOFT_LIMIT = 2.0

STORES: dict[str, str | None] = {"redis": None, "mysql": "mysql", "postgresql": "postgresql"}


class WaitEnv:
    """A worker, and a client of its lock store that writes and reads debounce windows."""

    def __init__(self, env: FaultEnv, locks: LockBackend) -> None:
        self.env = env
        self.locks = locks
        self.task = env.app.tasks[TASK]

    def key(self, label: str) -> str:
        return str(self.task.lock_key_for((label, 0), {}))

    def pending_send(self, label: str) -> str:
        """A later send of the window of ``label`` whose publish is still under way."""
        ghost = f"held-{uuid.uuid4().hex[:8]}"
        self.locks.debounce(self.key(label), ghost, 60.0, pending=PENDING)
        return ghost


@pytest.fixture(params=list(STORES))
def waits(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[WaitEnv]:
    kind = STORES[request.param]
    store: AbstractContextManager[str | None] = (
        nullcontext() if kind is None else sql_lock_store(kind)
    )
    with store as url:
        env = FaultEnv(tmp_path, lock_store=url)
        locks = backend_from_url(env.lock_url)
        try:
            yield WaitEnv(env, locks)
        finally:
            env.close()
            locks.close()


def test_a_soft_time_limit_ends_the_wait_and_the_message_takes_its_window_and_runs(
    waits: WaitEnv,
) -> None:
    """The wait for a pending publish ends before the message's soft time limit: the message
    treats the pending send as a publish that outlasted its deadline (the "late publish" of
    docs/limits.rst), takes its window and runs its body; the pending send, if it is ever
    published, then ends superseded by it, and if it is taken back, changes nothing."""
    # Given a debounced send whose message has a soft time limit of 2 s, and a later send of
    # its window whose publish is held for 30 s
    waits.env.start_worker()
    label = f"wait-{time.time_ns()}"
    sent = waits.task.apply_async((label, 1), soft_time_limit=SOFT_LIMIT)
    ghost = waits.pending_send(label)

    # When the message starts (1.5 s later) and finds the pending send as its window's latest
    outcome = sent.get(timeout=BOUND)

    # Then it ran its body, once, within its soft time limit
    assert outcome == 1
    assert [s["version"] for s in waits.env.probe.starts(label)] == [1]
    assert waits.env.log_lines(sent.id, "waits up to", ghost)
    # and its window is closed, naming it: the pending send's undo changes nothing, and the
    # pending send, if published, finds that it was superseded
    key = waits.key(label)
    assert not waits.locks.debounce_undo(key, ghost, sent.id)
    assert waits.locks.debounce_take(key, ghost) == (sent.id, 0.0)


def test_a_soft_time_limit_that_ends_the_wait_leaves_the_window_to_the_ended_message(
    waits: WaitEnv,
) -> None:
    """A time limit the execution cannot see (``celery worker --soft-time-limit``: only the
    pool knows it) ends the wait with SoftTimeLimitExceeded. The message ends FAILURE, and its
    window is closed naming it: a pending send taken back afterwards must not leave the window
    open naming a message that will never run (nor would a later start of the pending send
    run: it ends superseded, as after a late publish)."""
    # Given a worker whose pool ends every task after 2 s (its own setting), a debounced send,
    # and a later send of its window whose publish is held for 30 s
    waits.env.start_worker(f"--soft-time-limit={SOFT_LIMIT}")
    label = f"wait-{time.time_ns()}"
    sent = waits.task.apply_async((label, 1))
    ghost = waits.pending_send(label)

    # When the message waits for the pending send and its soft time limit comes
    with pytest.raises(SoftTimeLimitExceeded):
        sent.get(timeout=BOUND)

    # Then its body never ran, and the window names it, closed: taking the pending send back
    # changes nothing, and the pending send, if it starts, finds that it was superseded
    assert waits.env.probe.starts(label) == []
    assert waits.env.log_lines(sent.id, "waits up to", ghost)
    key = waits.key(label)
    assert not waits.locks.debounce_undo(key, ghost, sent.id)
    assert waits.locks.debounce_take(key, ghost) == (sent.id, 0.0)
