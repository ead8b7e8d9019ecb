"""The contract of holder slots (``lock_limit``), run against every backend.

:meth:`LockBackend.acquire_slot` takes one of a key's N holder slots in one atomic step; each
slot is a store key of its own (:mod:`singletask.protocol.slots`) that renews, releases and lists
like any lock, and shares the key's fence record. A store without slots (``supports_limit`` False)
refuses at once with UnsupportedOperation, and task definitions on it are refused at worker
start (tests/execution/test_limit.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from singletask.backends.base import AcquireResult, LockBackend
from singletask.exceptions import UnsupportedOperation
from singletask.protocol.slots import base_key, slot_key, slot_keys

from ..conftest import ONE_HOLDER_BACKENDS
from .test_contract import (
    LEASE,
    SHORT,
    every_record_expires,  # noqa: F401 - the contract's autouse check
    listed,
    wait_until_free,
)

LIMIT = 3


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


@pytest.fixture
def slotted(backend: LockBackend) -> LockBackend:
    """A backend with holder slots: tests that use it are not collected for the stores of
    ``ONE_HOLDER_BACKENDS`` (tests/conftest.py); the test below checks those refuse them."""
    return backend


def test_only_the_stores_that_keep_one_holder_refuse_holder_slots(
    backend: LockBackend, request: pytest.FixtureRequest
) -> None:
    """memcached and the Django caches refuse slots at once; every other store has them."""
    if request.node.callspec.params["backend"] in ONE_HOLDER_BACKENDS:
        assert not backend.supports_limit
        with pytest.raises(UnsupportedOperation):
            backend.acquire_slot("any", 2, "token", LEASE)
    else:
        assert backend.supports_limit


def fill(backend: LockBackend, key: str, count: int = LIMIT) -> list[AcquireResult]:
    """Take ``count`` slots of ``key`` for ``token-0``, ``token-1``, ..."""
    results = []
    for n in range(count):
        result = backend.acquire_slot(key, LIMIT, f"token-{n}", LEASE, meta={"task_id": f"t-{n}"})
        assert result.acquired, (n, result)
        results.append(result)
    return results


def test_a_key_takes_up_to_limit_holders_lowest_slot_first(slotted: LockBackend, key: str) -> None:
    """N tokens take the N slots in order, slot 0 being the key itself; the N+1st is refused
    and told every holder."""
    # Given / When the key is filled
    taken = fill(slotted, key)

    # Then each holder got its own slot, in order, and holds it
    assert [r.key for r in taken] == slot_keys(key, LIMIT)
    assert taken[0].key == key
    for n, result in enumerate(taken):
        assert result.key is not None
        holder = slotted.holder(result.key)
        assert holder is not None
        assert holder.token == f"token-{n}"
        assert base_key(result.key) == key

    # And one more is refused, naming all three holders, slot 0 first
    refused = slotted.acquire_slot(key, LIMIT, "token-x", LEASE)
    assert not refused.acquired
    assert [h.token for h in refused.holders] == ["token-0", "token-1", "token-2"]
    assert [h.task_id for h in refused.holders] == ["t-0", "t-1", "t-2"]
    assert refused.holder == refused.holders[0]


def test_a_limit_of_one_is_the_key_itself(slotted: LockBackend, key: str) -> None:
    """Slot 0 is the key: a plain acquire and a one-slot acquire exclude each other."""
    assert slotted.acquire(key, "token-a", LEASE).acquired
    refused = slotted.acquire_slot(key, 1, "token-b", LEASE)
    assert not refused.acquired
    assert [h.token for h in refused.holders] == ["token-a"]

    assert slotted.release(key, "token-a")
    taken = slotted.acquire_slot(key, 1, "token-b", LEASE)
    assert taken.acquired
    assert taken.key == key
    assert not slotted.acquire(key, "token-c", LEASE).acquired


def test_a_holder_that_acquires_again_keeps_its_slot_and_fence(
    slotted: LockBackend, key: str
) -> None:
    """A redelivered message (same token) gets its own slot back, not a second one."""
    taken = fill(slotted, key, 2)
    again = slotted.acquire_slot(key, LIMIT, "token-1", LEASE)
    assert again.acquired
    assert again.key == taken[1].key
    assert again.fence == taken[1].fence
    assert slotted.holder(slot_key(key, 2)) is None


def test_a_takeover_prefix_takes_the_matching_slot_before_a_free_one(
    slotted: LockBackend, key: str
) -> None:
    """A retried attempt takes over the reservation its previous attempt left in its slot."""
    # Given slot 0 held, slot 1 reserved for a retry, slot 2 free
    assert slotted.acquire_slot(key, LIMIT, "token-a", LEASE).acquired
    assert slotted.acquire_slot(key, LIMIT, "reserved:task-r:1", LEASE).acquired

    # When the retry acquires with the reservation's prefix
    result = slotted.acquire_slot(key, LIMIT, "task-r:1:run", LEASE, takeover_prefix="reserved:")

    # Then it took the reserved slot, and slot 2 is still free
    assert result.acquired
    assert result.key == slot_key(key, 1)
    holder = slotted.holder(slot_key(key, 1))
    assert holder is not None
    assert holder.token == "task-r:1:run"
    assert slotted.holder(slot_key(key, 2)) is None


def test_a_released_or_expired_slot_is_free_again(slotted: LockBackend, key: str) -> None:
    # Given a full key, slot 1 released and slot 2 on a short lease
    fill(slotted, key, 2)
    assert slotted.acquire_slot(key, LIMIT, "token-2", SHORT).key == slot_key(key, 2)
    assert slotted.release(slot_key(key, 1), "token-1")

    # When two newcomers acquire after slot 2's lease ran out
    assert wait_until_free(slotted, slot_key(key, 2))
    first = slotted.acquire_slot(key, LIMIT, "token-x", LEASE)
    second = slotted.acquire_slot(key, LIMIT, "token-y", LEASE)

    # Then they took slots 1 and 2, and the key is full again
    assert (first.key, second.key) == (slot_key(key, 1), slot_key(key, 2))
    assert not slotted.acquire_slot(key, LIMIT, "token-z", LEASE).acquired


def test_fences_grow_across_every_slot_of_a_key(slotted: LockBackend, key: str) -> None:
    """Each new acquisition of any slot gets a fence above every earlier one of the key."""
    fences = [r.fence for r in fill(slotted, key)]
    assert slotted.release(slot_key(key, 1), "token-1")
    fences.append(slotted.acquire_slot(key, LIMIT, "token-x", LEASE).fence)
    assert slotted.release(key, "token-0")
    fences.append(slotted.acquire_slot(key, LIMIT, "token-y", LEASE).fence)
    fences.append(
        slotted.acquire_slot(key, LIMIT, "token-z", LEASE, takeover_prefix="token-2").fence
    )
    fences.append(slotted.acquire(key, "token-w", LEASE, takeover_prefix="token-y").fence)
    assert all(isinstance(f, int) for f in fences)
    assert fences == sorted(set(fences)), fences


def test_a_slot_renews_and_releases_like_a_lock(slotted: LockBackend, key: str) -> None:
    """extend, release, release_held_by and force_release act on a slot's store key."""
    fill(slotted, key)
    one, two = slot_key(key, 1), slot_key(key, 2)
    assert slotted.extend(one, "token-1", LEASE * 2)
    assert not slotted.extend(one, "token-2", LEASE)
    removed = slotted.release_held_by(one, "t-1")
    assert removed is not None
    assert removed.token == "token-1"
    assert slotted.release_held_by(two, "t-1") is None
    forced = slotted.force_release(two)
    assert forced is not None
    assert forced.token == "token-2"
    assert not slotted.extend(two, "token-2", LEASE)
    assert slotted.holder(key) is not None


def test_a_completion_marker_left_in_a_slot_is_the_keys(slotted: LockBackend, key: str) -> None:
    """A redelivered copy of a completed message sees the marker, whichever slot it lands in."""
    fill(slotted, key, 2)
    assert slotted.release(slot_key(key, 1), "token-1", completed="t-1:0")
    assert slotted.acquire_slot(key, LIMIT, "token-x", LEASE).completed == "t-1:0"


def test_racing_acquisitions_fill_exactly_the_limit(slotted: LockBackend, key: str) -> None:
    """24 threads acquiring one key with 3 slots at once: exactly 3 win, one per slot."""
    contenders = 24
    barrier = threading.Barrier(contenders)

    def contend(index: int) -> AcquireResult:
        barrier.wait(timeout=30)
        return slotted.acquire_slot(key, LIMIT, f"token-{index}", LEASE)

    with ThreadPoolExecutor(max_workers=contenders) as pool:
        outcomes = list(pool.map(contend, range(contenders)))

    winners = [r for r in outcomes if r.acquired]
    assert sorted(str(r.key) for r in winners) == sorted(slot_keys(key, LIMIT))
    assert all(len(r.holders) == LIMIT for r in outcomes if not r.acquired)
    fences = [r.fence for r in winners]
    assert len(set(fences)) == LIMIT


def test_the_slots_of_a_key_are_listed_under_its_prefix(
    slotted: LockBackend, key_prefix: str
) -> None:
    """Each holder is one listed row; slots of keys under another prefix are not listed."""
    export = f"{key_prefix}app.export:acme"
    fill(slotted, export)
    assert slotted.acquire_slot(f"other-{key_prefix}x", LIMIT, "token-o", LEASE).acquired
    assert slotted.acquire_slot(f"other-{key_prefix}x", LIMIT, "token-p", LEASE).acquired

    found = listed(slotted, key_prefix)

    assert sorted(found) == sorted(slot_keys(export, LIMIT))
    assert {h.token for h in found.values()} == {"token-0", "token-1", "token-2"}
