"""The contract of preemption (``lock_policy = "replace"``), run against every backend.

:meth:`LockBackend.preempt` takes the key, or the holder slot a named owner token holds, for a
newer execution in one atomic step, with a fencing token greater than the preempted holder's;
the preempted holder's renewals and release then fail, which is how it learns. A store that
cannot (``supports_replace`` False: memcached, the Django caches) refuses at once, and task
definitions on it are refused when they are bound (tests/execution/test_replace.py).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from singletask.backends.base import LockBackend
from singletask.exceptions import UnsupportedOperation
from singletask.protocol.slots import slot_keys

from ..conftest import ONE_HOLDER_BACKENDS
from .test_contract import (
    EXPIRY_WAIT,
    LEASE,
    every_record_expires,  # noqa: F401 - the contract's autouse check
)

LIMIT = 3
#: The preemptor's lease in the record's expiry test: short, yet long enough to read the record
#: once before it runs out on a loaded machine.
BRIEF = 1.0


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


@pytest.fixture
def replaceable(backend: LockBackend) -> LockBackend:
    """A backend that can preempt: tests that use it are not collected for the stores of
    ``ONE_HOLDER_BACKENDS`` (tests/conftest.py); the test below checks those refuse it."""
    return backend


def test_only_the_stores_that_keep_one_holder_refuse_to_preempt(
    backend: LockBackend, request: pytest.FixtureRequest
) -> None:
    """memcached and the Django caches refuse at once; every store with slots preempts."""
    if request.node.callspec.params["backend"] in ONE_HOLDER_BACKENDS:
        assert not backend.supports_replace
        with pytest.raises(UnsupportedOperation):
            backend.preempt("any", 1, "token", LEASE, "victim")
    else:
        assert backend.supports_replace
        assert backend.supports_limit


def test_a_newer_execution_takes_the_key_with_a_larger_fence(
    replaceable: LockBackend, key: str
) -> None:
    """The preempted holder's fence is older: its renewal and release fail, the newer one
    holds the key and names whom it replaced."""
    # Given a running holder
    old = replaceable.acquire(key, "token-old", LEASE, meta={"task_id": "t-old"})
    assert old.acquired
    assert old.fence is not None

    # When a newer execution preempts it
    new = replaceable.preempt(
        key, 1, "token-new", LEASE, "token-old", meta={"task_id": "t-new", "replaces": "token-old"}
    )

    # Then the newer one holds the key with a larger fence, naming the one it replaced
    assert new.acquired
    assert new.key in (key, None)
    assert new.fence is not None
    assert new.fence > old.fence
    holder = replaceable.holder(key)
    assert holder is not None
    assert holder.token == "token-new"
    assert holder.task_id == "t-new"
    assert holder.meta.get("replaces") == "token-old"
    # And the old holder can neither renew nor release it
    assert replaceable.extend(key, "token-old", LEASE) is False
    assert replaceable.extend_many([(key, "token-old", LEASE)]) == [False]
    assert replaceable.release(key, "token-old") is False
    assert replaceable.release(key, "token-new") is True


def test_preempting_a_holder_that_has_gone_takes_a_free_key_and_not_a_newer_holder(
    replaceable: LockBackend, key: str
) -> None:
    """The takeover is a compare-and-swap on the victim's token: a key that the victim left
    is simply taken, and one that another execution holds meanwhile is refused, naming it."""
    # Given a victim that released before the preemption came
    replaceable.acquire(key, "token-old", LEASE)
    replaceable.release(key, "token-old")

    # When the newer execution preempts it, the free key is taken
    taken = replaceable.preempt(key, 1, "token-new", LEASE, "token-old")
    assert taken.acquired

    # And a third execution naming the long-gone victim is refused, told the real holder
    refused = replaceable.preempt(key, 1, "token-third", LEASE, "token-old")
    assert not refused.acquired
    assert refused.holder is not None
    assert refused.holder.token == "token-new"
    holder = replaceable.holder(key)
    assert holder is not None
    assert holder.token == "token-new"
    replaceable.release(key, "token-new")


def test_with_every_slot_full_the_named_oldest_slot_is_taken(
    replaceable: LockBackend, key: str
) -> None:
    """With lock_limit = 3 full, preempting the oldest holder takes exactly its slot, with a
    fence above every holder's; the other holders keep theirs."""
    # Given three holders, token-0 the oldest (smallest fence)
    fences = []
    for n in range(LIMIT):
        taken = replaceable.acquire_slot(key, LIMIT, f"token-{n}", LEASE)
        assert taken.acquired
        assert taken.fence is not None
        fences.append(taken.fence)
    oldest = min(range(LIMIT), key=lambda n: fences[n])

    # When a newer execution preempts the oldest
    new = replaceable.preempt(key, LIMIT, "token-new", LEASE, f"token-{oldest}")

    # Then it holds the oldest's slot, with a larger fence than every holder's
    assert new.acquired
    assert new.fence is not None
    assert new.fence > max(fences)
    assert new.key == slot_keys(key, LIMIT)[oldest]
    assert replaceable.extend(new.key, f"token-{oldest}", LEASE) is False
    for n in range(LIMIT):
        if n != oldest:
            slot = slot_keys(key, LIMIT)[n]
            assert replaceable.extend(slot, f"token-{n}", LEASE) is True
            replaceable.release(slot, f"token-{n}")
    replaceable.release(new.key, "token-new")


def test_concurrent_preemptions_of_one_holder_let_exactly_one_win(
    replaceable: LockBackend, key: str
) -> None:
    """Eight newer executions preempt the same holder at once: the step is atomic, so exactly
    one takes the key and the others are refused naming it."""
    # Given a running holder
    replaceable.acquire(key, "token-old", LEASE)
    barrier = threading.Barrier(8)

    def preempt(n: int) -> bool:
        barrier.wait()
        return replaceable.preempt(key, 1, f"token-{n}", LEASE, "token-old").acquired

    # When they all preempt it at once
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(preempt, range(8)))

    # Then exactly one holds the key
    assert won.count(True) == 1
    holder = replaceable.holder(key)
    assert holder is not None
    assert holder.token == f"token-{won.index(True)}"
    replaceable.release(key, holder.token)


def test_the_preempted_holder_learns_its_successor_after_the_successor_ended(
    replaceable: LockBackend, key: str
) -> None:
    """The takeover leaves a preemption record: the preempted holder, whose renewal finds the
    key free because its successor has already released it (and another execution has taken
    it since), still learns that it was preempted, and by whom."""
    # Given a holder preempted by a newer execution that has already ended
    replaceable.acquire(key, "token-old", LEASE, meta={"task_id": "t-old"})
    new = replaceable.preempt(
        key, 1, "token-new", LEASE, "token-old", meta={"task_id": "t-new", "replaces": "token-old"}
    )
    assert new.acquired
    assert replaceable.release(key, "token-new") is True
    # And a third execution took the free key normally
    assert replaceable.acquire(key, "token-third", LEASE, meta={"task_id": "t-third"}).acquired

    # When the preempted holder's renewal fails
    assert replaceable.extend(key, "token-old", LEASE) is False

    # Then the store names its successor
    assert replaceable.replaced_by(key, "token-old") == "t-new"
    # And no other token counts as preempted
    assert replaceable.replaced_by(key, "token-new") is None
    assert replaceable.replaced_by(key, "token-third") is None
    assert replaceable.replaced_by(f"{key}-other", "token-old") is None
    replaceable.release(key, "token-third")


def test_a_preemption_record_names_a_direct_call_and_the_slot_taken(
    replaceable: LockBackend, key: str
) -> None:
    """With every slot full, the record is the slot's: the preempted holder of that slot reads
    it under its slot key; a preemptor without a task id (a direct call) is named ``""``."""
    # Given three holders, token-0 the oldest
    for n in range(LIMIT):
        assert replaceable.acquire_slot(key, LIMIT, f"token-{n}", LEASE).acquired
    slot = slot_keys(key, LIMIT)[0]

    # When a direct call preempts token-0 and ends
    new = replaceable.preempt(
        key, LIMIT, "token-new", LEASE, "token-0", meta={"replaces": "token-0"}
    )
    assert new.acquired
    assert new.key == slot
    assert replaceable.release(slot, "token-new") is True

    # Then token-0 learns it under its own slot, the successor without a task id
    assert replaceable.replaced_by(slot, "token-0") == ""
    assert replaceable.replaced_by(slot_keys(key, LIMIT)[1], "token-1") is None
    for n in range(1, LIMIT):
        replaceable.release(slot_keys(key, LIMIT)[n], f"token-{n}")


def test_the_preemption_record_lasts_the_preemptor_s_lease(
    replaceable: LockBackend, key: str
) -> None:
    """The record is kept one lease of the preemptor (here a short one), then runs out: a
    token preempted long ago is told nothing."""
    # Given a holder preempted with a short lease
    replaceable.acquire(key, "token-old", LEASE)
    taken = replaceable.preempt(key, 1, "token-new", BRIEF, "token-old", meta={"task_id": "t-new"})
    assert taken.acquired
    assert replaceable.replaced_by(key, "token-old") == "t-new"

    # When the lease and the record have run out
    deadline = time.monotonic() + EXPIRY_WAIT
    while replaceable.replaced_by(key, "token-old") is not None and time.monotonic() < deadline:
        time.sleep(0.05)

    # Then nothing is left to name the preemptor
    assert replaceable.replaced_by(key, "token-old") is None


@pytest.mark.parametrize("limit", [1, LIMIT])
def test_a_preemption_s_record_is_readable_the_instant_preempt_returns(
    replaceable: LockBackend, key: str, limit: int
) -> None:
    """The takeover and its record are one atomic step: the moment :meth:`preempt` returns,
    the victim's renewal fails and :meth:`replaced_by` names the preemptor, even when that
    preemptor is preempted in turn at once (a storm of replace sends), so the victim never
    mistakes its preemption for a plain loss. Many rounds, with a reader racing each one."""
    for n in range(20):
        # Given a holder (with every slot full, the oldest), and a reader watching its record
        victim = f"token-v{n}"
        taken = replaceable.acquire_slot(key, limit, victim, LEASE)
        assert taken.acquired
        for m in range(1, limit):
            replaceable.acquire_slot(key, limit, f"token-f{n}-{m}", LEASE)
        slot = taken.key or key
        seen: list[str | None] = []
        started = threading.Event()

        def read(
            slot: str = slot,
            victim: str = victim,
            seen: list[str | None] = seen,
            started: threading.Event = started,
        ) -> None:
            started.set()
            deadline = time.monotonic() + 5
            while replaceable.extend(slot, victim, LEASE) and time.monotonic() < deadline:
                time.sleep(0.001)  # renewing, as the victim's renewer does, until it is gone
            seen.append(replaceable.replaced_by(slot, victim))

        reader = threading.Thread(target=read)
        reader.start()
        started.wait()
        # When a newer execution preempts it, and a newer one still preempts that one at once
        first = replaceable.preempt(
            key, limit, f"token-a{n}", LEASE, victim, meta={"task_id": f"a{n}"}
        )
        second = replaceable.preempt(
            key, limit, f"token-b{n}", LEASE, f"token-a{n}", meta={"task_id": f"b{n}"}
        )
        reader.join(10)

        # Then the victim read its preemptor the first time it found its lock gone
        assert first.acquired
        assert second.acquired
        assert seen == [f"a{n}"]
        assert replaceable.replaced_by(slot, victim) == f"a{n}"
        assert replaceable.replaced_by(second.key or key, f"token-a{n}") == f"b{n}"
        replaceable.release(second.key or key, f"token-b{n}")
        for m in range(1, limit):
            for name in slot_keys(key, limit):
                replaceable.release(name, f"token-f{n}-{m}")
        replaceable.release(slot, victim)  # nothing: it holds nothing
