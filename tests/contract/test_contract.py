"""The contract of the lock backend primitives, run against every backend.

Every backend (the ``backend`` fixture: memory, the private Redis, SQLite, PostgreSQL, MySQL,
the private memcached and Django caches over both servers) must pass this suite unchanged; the
semantics are those documented in :mod:`singletask.backends.base`. A lease is only ever asserted
to end *within* a generous wait, never at an exact time: memcached ends leases in whole seconds of
its own clock.

After every backend operation of every test, and at the end of each test, the suite checks that
no record of the test's keys is left without an expiry (``every_record_expires`` below). It reads
the store through the ``backend_records`` fixture (``tests/conftest.py``, one inspector per store
in ``tests/contract/expiry.py``; see ``tests/contract/README.md``).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from singletask import ConfigurationError
from singletask.backends.base import MAX_LEASE, AcquireResult, Holder, LockBackend
from singletask.exceptions import UnsupportedOperation

from .expiry import without_expiry

LEASE = 30.0
#: A lease short enough to watch it run out in a test ...
SHORT = 0.2
#: ... and a wait long enough that it has run out, even on a loaded machine.
EXPIRY_WAIT = 10.0
#: A lease that outlasts a few round trips on any deployment, far below LEASE.
HELD = 5.0


def wait_until_free(backend: LockBackend, key: str, timeout: float = EXPIRY_WAIT) -> bool:
    """Poll until ``key`` has no holder; False if it still has one after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if backend.holder(key) is None:
            return True
        time.sleep(0.05)
    return backend.holder(key) is None


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


#: Serialises the expiry checks of the threads of one test.
_INSPECTING = threading.Lock()

#: The backend operations after which every record must still have an expiry. (Operations a
#: backend does not have are skipped; one that writes is added here.)
OPERATIONS = (
    "acquire",
    "acquire_slot",
    "debounce",
    "debounce_take",
    "debounce_published",
    "debounce_undo",
    "release",
    "extend",
    "extend_many",
    "claim_next",
    "clear_next",
    "release_held_by",
    "force_release",
    "preempt",
    "take_units",
    "give_units",
)


@pytest.fixture(autouse=True)
def every_record_expires(
    backend: LockBackend,
    backend_records: Callable[[str], dict[str, float | None]],
    key_prefix: str,
) -> Iterator[None]:
    """Check, after each operation on ``backend`` and at the end of the test, that every record
    the store holds for this test's keys has an expiry no later than MAX_LEASE (plus the 7 days
    a fence record is kept) from now.

    ``backend_records(match)`` lists the store's records whose key contains ``match``, with the
    seconds each has left (None: never expires); see tests/contract/README.md.
    """

    def check(after: str) -> None:
        with _INSPECTING:  # one inspection at a time (memcached dumps its items to one client)
            immortal = without_expiry(backend_records(key_prefix))
        assert not immortal, f"after {after}: records without an expiry: {immortal}"

    def checked(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:
                check(f"{name}{args!r}")

        return call

    for name in OPERATIONS:
        method = getattr(backend, name, None)
        if method is not None:
            setattr(backend, name, checked(name, method))
    yield
    check("the test")


# -- acquire ------------------------------------------------------------------------------------


def test_acquire_takes_a_free_key(backend: LockBackend, key: str) -> None:
    """A free key is acquired, and the backend then names the caller as its holder."""
    # Given a key nobody holds
    assert backend.holder(key) is None

    # When a token acquires it
    result = backend.acquire(key, "token-a", LEASE, meta={"task_id": "task-a"})

    # Then it succeeds with a fencing token, and the token holds the key
    assert result.acquired
    assert result.holder is None
    assert isinstance(result.fence, int)
    assert result.completed is None
    holder = backend.holder(key)
    assert holder is not None
    assert holder.token == "token-a"
    assert holder.task_id == "task-a"
    assert holder.ttl is not None
    assert 0 < holder.ttl <= LEASE


def test_acquire_of_a_held_key_fails_and_names_the_holder(backend: LockBackend, key: str) -> None:
    """A conflicting acquire fails and returns the holder's token, task id and lease left."""
    # Given a key held by token A with a 30 s lease
    assert backend.acquire(key, "token-a", LEASE, meta={"task_id": "task-a"}).acquired

    # When token B tries to acquire it
    result = backend.acquire(key, "token-b", LEASE, meta={"task_id": "task-b"})

    # Then B is refused and told who holds it
    assert result.acquired is False
    assert result.holder is not None
    assert result.holder.token == "token-a"
    assert result.holder.task_id == "task-a"
    assert result.holder.ttl is not None
    assert 0 < result.holder.ttl <= LEASE
    # And nothing changed
    holder = backend.holder(key)
    assert holder is not None
    assert (holder.token, holder.task_id) == ("token-a", "task-a")


def test_conflict_without_task_id_reports_none(backend: LockBackend, key: str) -> None:
    """A holder that stored no task id is reported with task_id None."""
    # Given a key held by a token that stored no metadata
    assert backend.acquire(key, "token-a", LEASE).acquired

    # When another token tries to acquire it
    result = backend.acquire(key, "token-b", LEASE)

    # Then the holder is named by token only
    assert result.holder is not None
    assert result.holder.token == "token-a"
    assert result.holder.task_id is None


def test_reacquire_by_the_same_token_succeeds_and_restarts_the_lease(
    backend: LockBackend, key: str
) -> None:
    """Acquire is idempotent for the owner: a repeated call succeeds and restarts the lease."""
    # Given a key held by token A with a short lease
    assert backend.acquire(key, "token-a", 5.0).acquired

    # When token A acquires it again with a longer lease
    result = backend.acquire(key, "token-a", LEASE)

    # Then it succeeds, and the lease is the new one
    assert result.acquired is True
    holder = backend.holder(key)
    assert holder is not None
    assert holder.token == "token-a"
    assert holder.ttl is not None
    assert 5.0 < holder.ttl <= LEASE


def test_takeover_prefix_takes_over_a_matching_holder(backend: LockBackend, key: str) -> None:
    """A holder whose token starts with takeover_prefix is replaced by the caller."""
    # Given a key held by the previous attempt of a task
    assert backend.acquire(key, "task-1:0:aaaa", LEASE, meta={"task_id": "task-1"}).acquired

    # When the next attempt acquires with that attempt's prefix
    result = backend.acquire(
        key, "task-1:1:bbbb", LEASE, meta={"task_id": "task-1"}, takeover_prefix="task-1:0:"
    )

    # Then it holds the key now
    assert result.acquired is True
    holder = backend.holder(key)
    assert holder is not None
    assert holder.token == "task-1:1:bbbb"


def test_takeover_prefix_does_not_take_over_another_holder(backend: LockBackend, key: str) -> None:
    """takeover_prefix never takes over a holder whose token does not start with it."""
    # Given a key held by another task
    assert backend.acquire(key, "task-2:0:cccc", LEASE, meta={"task_id": "task-2"}).acquired

    # When an attempt of task-1 acquires with its own takeover prefix
    result = backend.acquire(
        key, "task-1:1:bbbb", LEASE, meta={"task_id": "task-1"}, takeover_prefix="task-1:0:"
    )

    # Then it is refused and task-2 still holds the key
    assert result.acquired is False
    assert result.holder is not None
    assert result.holder.token == "task-2:0:cccc"
    holder = backend.holder(key)
    assert holder is not None
    assert holder.token == "task-2:0:cccc"
    assert holder.task_id == "task-2"


def test_empty_takeover_prefix_takes_over_nothing(backend: LockBackend, key: str) -> None:
    """An empty takeover_prefix means "no takeover", not "every token matches"."""
    # Given a held key
    assert backend.acquire(key, "token-a", LEASE).acquired

    # When another token acquires with an empty prefix
    result = backend.acquire(key, "token-b", LEASE, takeover_prefix="")

    # Then it is refused
    assert result.acquired is False
    holder = backend.holder(key)
    assert holder is not None
    assert holder.token == "token-a"


def test_meta_is_replaced_on_takeover(backend: LockBackend, key: str) -> None:
    """On a successful acquire the stored metadata is replaced, not merged."""
    # Given a key held with two metadata fields
    meta_a = {"task_id": "task-1", "hostname": "host-a", "pid": "11"}
    assert backend.acquire(key, "task-1:0:aaaa", LEASE, meta=meta_a).acquired

    # When the next attempt takes it over with different metadata (no hostname)
    meta_b = {"task_id": "task-1", "pid": "22", "since": "1700000000.000"}
    assert backend.acquire(
        key, "task-1:1:bbbb", LEASE, meta=meta_b, takeover_prefix="task-1:0:"
    ).acquired

    # Then the metadata is exactly the new one
    holder = backend.holder(key)
    assert holder is not None
    assert dict(holder.meta) == meta_b


def test_meta_is_replaced_on_reacquire_by_the_owner(backend: LockBackend, key: str) -> None:
    """A repeated acquire by the owner also replaces the metadata."""
    # Given a key held with metadata
    assert backend.acquire(key, "token-a", LEASE, meta={"task_id": "t", "pid": "1"}).acquired

    # When the owner acquires again with other metadata
    assert backend.acquire(key, "token-a", LEASE, meta={"task_id": "t", "pid": "2"}).acquired

    # Then only the new metadata is stored
    holder = backend.holder(key)
    assert holder is not None
    assert dict(holder.meta) == {"task_id": "t", "pid": "2"}


def test_holder_returns_all_meta(backend: LockBackend, key: str) -> None:
    """holder() returns every metadata field, as strings, and the token separately."""
    # Given a key acquired with the full set of metadata fields
    meta = {
        "task_id": "9f1c-task",
        "task": "proj.tasks.sync",
        "hostname": "worker-1@host",
        "pid": "4242",
        "since": "1700000000.123",
    }
    assert backend.acquire(key, "token-a", LEASE, meta=meta).acquired

    # When it is inspected
    holder = backend.holder(key)

    # Then the holder carries all of them
    assert isinstance(holder, Holder)
    assert holder.token == "token-a"
    assert holder.task_id == "9f1c-task"
    assert dict(holder.meta) == meta
    assert holder.ttl is not None
    assert 0 < holder.ttl <= LEASE


def test_holder_of_a_free_key_is_none(backend: LockBackend, key: str) -> None:
    """holder() of a key nobody holds is None."""
    assert backend.holder(key) is None


def test_keys_are_independent(backend: LockBackend, key: str) -> None:
    """Holding one key does not affect another."""
    # Given a held key
    assert backend.acquire(key, "token-a", LEASE).acquired

    # When another token acquires a different key
    result = backend.acquire(f"{key}:other", "token-b", LEASE)

    # Then it succeeds
    assert result.acquired is True


# -- release ------------------------------------------------------------------------------------


def test_release_by_the_owner_frees_the_key(backend: LockBackend, key: str) -> None:
    """The owner's release deletes the lock; another token can acquire it at once."""
    # Given a key held by token A
    assert backend.acquire(key, "token-a", LEASE).acquired

    # When A releases it
    released = backend.release(key, "token-a")

    # Then it was released and is free for B
    assert released is True
    assert backend.holder(key) is None
    assert backend.acquire(key, "token-b", LEASE).acquired


def test_release_by_another_token_changes_nothing(backend: LockBackend, key: str) -> None:
    """Only the owner can release: another token's release returns False, the lock stays."""
    # Given a key held by token A
    assert backend.acquire(key, "token-a", LEASE, meta={"task_id": "task-a"}).acquired

    # When token B releases it
    released = backend.release(key, "token-b")

    # Then nothing happened
    assert released is False
    holder = backend.holder(key)
    assert holder is not None
    assert (holder.token, holder.task_id) == ("token-a", "task-a")
    assert holder.ttl is not None
    assert holder.ttl > LEASE / 2


def test_release_of_a_free_key_returns_false(backend: LockBackend, key: str) -> None:
    """Releasing a key nobody holds is harmless and returns False."""
    assert backend.release(key, "token-a") is False
    assert backend.holder(key) is None


def test_release_twice_returns_false_the_second_time(backend: LockBackend, key: str) -> None:
    """A release is done once: a repeated release by the same owner returns False."""
    # Given a key acquired then released by token A
    assert backend.acquire(key, "token-a", LEASE).acquired
    assert backend.release(key, "token-a") is True

    # When A releases again / Then there was nothing left to release
    assert backend.release(key, "token-a") is False


# -- extend -------------------------------------------------------------------------------------


def test_extend_by_the_owner_sets_the_lease(backend: LockBackend, key: str) -> None:
    """The owner's extend sets the lease to the new value from now."""
    # Given a key held by token A with a 5 s lease
    assert backend.acquire(key, "token-a", 5.0).acquired

    # When A extends it to 30 s
    extended = backend.extend(key, "token-a", LEASE)

    # Then the lease is longer than the original one
    assert extended is True
    holder = backend.holder(key)
    assert holder is not None
    assert holder.ttl is not None
    assert 5.0 < holder.ttl <= LEASE


def test_extend_can_shorten_the_lease(backend: LockBackend, key: str) -> None:
    """Shortening a lease is allowed, and the shortened lease runs out."""
    # Given a key held by token A with a 30 s lease
    assert backend.acquire(key, "token-a", LEASE).acquired

    # When A shortens it to 0.2 s
    assert backend.extend(key, "token-a", SHORT) is True

    # Then the key is free again soon after (within 10 s)
    holder = backend.holder(key)
    assert holder is None or (holder.ttl is not None and holder.ttl <= 1.0)
    assert wait_until_free(backend, key)


def test_extend_by_another_token_changes_nothing(backend: LockBackend, key: str) -> None:
    """Only the owner can extend: another token's extend returns False, the lease stays."""
    # Given a key held by token A with a 30 s lease
    assert backend.acquire(key, "token-a", LEASE).acquired

    # When token B tries to shorten it
    extended = backend.extend(key, "token-b", SHORT)

    # Then nothing happened: A still holds it with (about) its 30 s lease
    assert extended is False
    time.sleep(SHORT * 2)
    holder = backend.holder(key)
    assert holder is not None
    assert holder.token == "token-a"
    assert holder.ttl is not None
    assert holder.ttl > LEASE / 2


def test_extend_of_a_free_key_returns_false_and_creates_nothing(
    backend: LockBackend, key: str
) -> None:
    """Extending a key nobody holds returns False and does not create a lock."""
    assert backend.extend(key, "token-a", LEASE) is False
    assert backend.holder(key) is None


# -- lease expiry -------------------------------------------------------------------------------


def test_lease_expiry_frees_the_key(backend: LockBackend, key: str) -> None:
    """A lease always runs out: the key is free again once its lease has passed."""
    # Given a key held with a 0.2 s lease
    assert backend.acquire(key, "token-a", SHORT).acquired

    # When the lease passes / Then the key is free (within 10 s)
    assert wait_until_free(backend, key)
    # And another token acquires it
    assert backend.acquire(key, "token-b", LEASE).acquired


def test_expired_owner_cannot_release_or_extend_the_new_owners_lock(
    backend: LockBackend, key: str
) -> None:
    """After expiry a new owner holds the key; the old owner's release and extend return False.

    This is the "a finished task deletes someone else's lock" bug: the old owner's late release
    must not free the key the new owner holds.
    """
    # Given token A's lease ran out and token B acquired the key
    assert backend.acquire(key, "token-a", SHORT, meta={"task_id": "task-a"}).acquired
    assert wait_until_free(backend, key)
    assert backend.acquire(key, "token-b", LEASE, meta={"task_id": "task-b"}).acquired

    # When A (finishing late) releases and extends
    released = backend.release(key, "token-a")
    extended = backend.extend(key, "token-a", SHORT)

    # Then both refused, and B still holds the key with its full lease
    assert released is False
    assert extended is False
    time.sleep(SHORT * 2)
    holder = backend.holder(key)
    assert holder is not None
    assert (holder.token, holder.task_id) == ("token-b", "task-b")
    assert holder.ttl is not None
    assert holder.ttl > LEASE / 2


def test_expired_owner_is_not_the_holder_any_more(backend: LockBackend, key: str) -> None:
    """Once its lease ran out, even the old owner's own release returns False."""
    # Given token A's lease ran out
    assert backend.acquire(key, "token-a", SHORT).acquired
    assert wait_until_free(backend, key)

    # When A releases / Then there was nothing to release
    assert backend.release(key, "token-a") is False


# -- concurrency --------------------------------------------------------------------------------


def test_racing_acquires_have_exactly_one_winner(backend: LockBackend, key: str) -> None:
    """32 threads acquiring one free key at the same moment: exactly one of them gets it."""
    # Given 32 threads, released together by a barrier
    contenders = 32
    barrier = threading.Barrier(contenders)

    def contend(index: int) -> tuple[str, AcquireResult]:
        token = f"token-{index}"
        barrier.wait(timeout=30)
        return token, backend.acquire(key, token, LEASE, meta={"task_id": f"task-{index}"})

    # When they all acquire the same key
    with ThreadPoolExecutor(max_workers=contenders) as pool:
        outcomes = list(pool.map(contend, range(contenders)))

    # Then exactly one won, every loser was told the winner, and the winner holds the key
    winners = [token for token, result in outcomes if result.acquired]
    assert len(winners) == 1
    losers = [result for _, result in outcomes if not result.acquired]
    assert all(r.holder is not None and r.holder.token == winners[0] for r in losers)
    holder = backend.holder(key)
    assert holder is not None
    assert holder.token == winners[0]


def test_every_new_acquisition_gets_a_greater_fence(backend: LockBackend, key: str) -> None:
    """Fencing tokens of one key strictly increase: after a release, a takeover, an expiry."""
    # Given a first acquisition
    first = backend.acquire(key, "token-a", LEASE)
    assert first.fence is not None

    # When the key is released and taken again, then taken over, then left to expire and taken
    assert backend.release(key, "token-a")
    second = backend.acquire(key, "token-b", LEASE)
    third = backend.acquire(key, "token-c", SHORT, takeover_prefix="token-b")
    assert wait_until_free(backend, key)
    fourth = backend.acquire(key, "token-d", LEASE)

    # Then each fence is greater than the one before
    fences = [first.fence, second.fence, third.fence, fourth.fence]
    assert all(isinstance(fence, int) for fence in fences)
    assert fences == sorted(set(fences)), fences


def test_re_acquiring_by_the_holder_keeps_its_fence(backend: LockBackend, key: str) -> None:
    first = backend.acquire(key, "token-a", LEASE)
    again = backend.acquire(key, "token-a", LEASE)
    assert again.acquired
    assert again.fence == first.fence


def test_a_conflict_reports_the_holders_fence(backend: LockBackend, key: str) -> None:
    held = backend.acquire(key, "token-a", LEASE)
    conflict = backend.acquire(key, "token-b", LEASE)
    assert conflict.holder is not None
    assert conflict.holder.fence == held.fence
    inspected = backend.holder(key)
    assert inspected is not None
    assert inspected.fence == held.fence


def test_a_release_can_record_a_completion_marker(backend: LockBackend, key: str) -> None:
    """The marker of the last normal release is reported to later acquisitions of the key."""
    # Given a lock released with a completion marker
    assert backend.acquire(key, "token-a", LEASE).acquired
    assert backend.release(key, "token-a", completed="task-a:0")

    # When the key is acquired again
    result = backend.acquire(key, "token-b", LEASE)

    # Then the acquisition sees the marker
    assert result.acquired
    assert result.completed == "task-a:0"


def test_a_release_by_a_non_owner_records_no_marker(backend: LockBackend, key: str) -> None:
    assert backend.acquire(key, "token-a", LEASE).acquired
    assert not backend.release(key, "token-b", completed="task-b:0")
    assert backend.release(key, "token-a")
    assert backend.acquire(key, "token-c", LEASE).completed is None


def test_extend_many_renews_only_the_leases_still_held(
    backend: LockBackend, key_prefix: str
) -> None:
    """One call renews many locks; a lock that is gone or held by another token is not touched."""
    # Given two locks held, one released, and one held by someone else (the held ones for a few
    # seconds: long enough to outlast the setup's round trips on a slow deployment, TLS Cluster)
    held_a, held_b, gone, other = (f"{key_prefix}{name}" for name in "abcd")
    for name in (held_a, held_b, gone):
        assert backend.acquire(name, "mine", HELD).acquired
    assert backend.release(gone, "mine")
    assert backend.acquire(other, "theirs", SHORT).acquired

    # When all four are extended for the same token
    results = backend.extend_many(
        [
            (held_a, "mine", LEASE),
            (held_b, "mine", LEASE),
            (gone, "mine", LEASE),
            (other, "mine", LEASE),
        ]
    )

    # Then only the held ones were extended, and the others are unchanged: the other token's
    # short lease runs out (waited for: memcached ends leases in whole seconds, see its module)
    assert results == [True, True, False, False]
    assert wait_until_free(backend, other)
    for name in (held_a, held_b):
        holder = backend.holder(name)
        assert holder is not None
        # renewed to LEASE: more left than they were taken for (where the store tells the lease)
        assert holder.ttl is None or holder.ttl > HELD
    assert backend.holder(gone) is None


def test_extend_many_of_nothing_is_nothing(backend: LockBackend) -> None:
    assert backend.extend_many([]) == []


# -- leases out of range ------------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [0, -1.0, math.nan, math.inf, 1e16, MAX_LEASE * 2], ids=repr)
def test_a_lease_out_of_range_is_refused_before_anything_is_written(
    backend: LockBackend, key: str, ttl: float
) -> None:
    """A lease that is not a finite number of seconds in (0, MAX_LEASE] is refused with
    ConfigurationError by every writing operation, and nothing is written or changed.

    (Redis once wrote the lock hash and then failed on PEXPIRE: a lock without an expiry.)
    """
    # When a free key is acquired with such a lease / Then it is refused, and the key stays free
    with pytest.raises(ConfigurationError, match="lease"):
        backend.acquire(key, "token-a", ttl)
    assert backend.holder(key) is None
    with pytest.raises(ConfigurationError, match="lease"):
        backend.claim_next(key, "task-a", ttl)

    # Given the key held with a normal lease
    assert backend.acquire(key, "token-a", LEASE).acquired

    # When its owner extends it with such a lease, alone or among others
    with pytest.raises(ConfigurationError, match="lease"):
        backend.extend(key, "token-a", ttl)
    with pytest.raises(ConfigurationError, match="lease"):
        backend.extend_many([(key, "token-a", SHORT), (key, "token-a", ttl)])

    # Then the lease is the one it had (not even the valid item of extend_many was applied)
    holder = backend.holder(key)
    assert holder is not None
    assert holder.ttl is not None
    assert LEASE / 2 < holder.ttl <= LEASE


def test_the_longest_lease_is_accepted_and_expires(backend: LockBackend, key: str) -> None:
    """The store's longest lease (MAX_LEASE, or less where the store cannot keep as long) is
    allowed; the lock then has that expiry (checked by the fixture)."""
    longest = backend.max_lease
    assert 0 < longest <= MAX_LEASE
    assert backend.acquire(key, "token-a", longest).acquired
    assert backend.claim_next(key, "task-b", longest) == "task-b"
    holder = backend.holder(key)
    assert holder is not None
    assert holder.ttl is not None
    assert longest - 60 < holder.ttl <= longest + 2


# -- operator primitives: iter_locks, release_held_by, force_release ---------------------------


def listed(backend: LockBackend, prefix: str, page_size: int = 500) -> dict[str, Holder]:
    """``iter_locks`` as a dict; a store that cannot list its keys skips the listing tests.

    Such a store must say so with UnsupportedOperation as soon as the iteration starts (see
    test_a_store_that_cannot_list_says_so_at_once).
    """
    try:
        pairs = list(backend.iter_locks(prefix, page_size=page_size))
    except UnsupportedOperation as exc:
        pytest.skip(f"{backend!r} cannot list its keys: {exc}")
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key was listed twice: {keys}"
    return dict(pairs)


def test_a_store_that_cannot_list_says_so_at_once(backend: LockBackend, key_prefix: str) -> None:
    """iter_locks either lists or raises UnsupportedOperation on the first step, never later."""
    iterator = backend.iter_locks(key_prefix)
    try:
        assert next(iterator, None) is None  # nothing is held under a fresh prefix
    except UnsupportedOperation:
        return
    assert list(iterator) == []


def test_iter_locks_lists_every_held_lock_under_the_prefix(
    backend: LockBackend, key_prefix: str
) -> None:
    """Each held lock is listed once, with the same holder ``holder(key)`` reports."""
    # Given three locks under the prefix, with metadata, and one under another prefix
    meta = {"task_id": "id-1", "task": "app.sync", "hostname": "w1@host", "pid": "42"}
    keys = [f"{key_prefix}app.sync:{n}" for n in range(3)]
    for n, name in enumerate(keys):
        assert backend.acquire(name, f"token-{n}", LEASE, meta={**meta, "task_id": f"id-{n}"})
    other = f"other-{key_prefix}app.sync"
    assert backend.acquire(other, "token-x", LEASE).acquired

    # When the prefix is listed
    found = listed(backend, key_prefix)

    # Then exactly the three are listed, each as holder() sees it
    assert sorted(found) == keys
    for n, name in enumerate(keys):
        direct = backend.holder(name)
        assert direct is not None
        holder = found[name]
        assert holder.token == direct.token == f"token-{n}"
        assert holder.task_id == f"id-{n}"
        assert holder.fence == direct.fence
        assert isinstance(holder.fence, int)
        assert dict(holder.meta) == dict(direct.meta)
        assert holder.meta["task"] == "app.sync"
        assert holder.meta["hostname"] == "w1@host"
        assert holder.meta["pid"] == "42"
        assert holder.ttl is not None
        assert 0 < holder.ttl <= LEASE


def test_iter_locks_leaves_out_released_and_expired_locks_and_bookkeeping(
    backend: LockBackend, key_prefix: str
) -> None:
    """Only live locks are listed: not a released or expired one, nor fence or follow-up records."""
    # Given a held lock, a released one (with a completion marker), an expired one, and a
    # pending follow-up claim on the held one
    held, released, expired = (f"{key_prefix}{name}" for name in ("held", "released", "expired"))
    assert backend.acquire(held, "token-a", LEASE).acquired
    assert backend.claim_next(held, "next-id", LEASE) == "next-id"
    assert backend.acquire(released, "token-b", LEASE).acquired
    assert backend.release(released, "token-b", completed="task-b:0")
    assert backend.acquire(expired, "token-c", SHORT).acquired
    assert wait_until_free(backend, expired)

    # When the prefix is listed
    found = listed(backend, key_prefix)

    # Then only the held lock is there
    assert list(found) == [held]


def test_iter_locks_reads_in_pages_of_the_given_size(backend: LockBackend, key_prefix: str) -> None:
    """Small pages list every lock exactly once."""
    keys = sorted(f"{key_prefix}k{n:02d}" for n in range(11))
    for name in keys:
        assert backend.acquire(name, "token", LEASE).acquired
    for page_size in (1, 3, 11, 500):
        assert sorted(listed(backend, key_prefix, page_size=page_size)) == keys


def test_iter_locks_matches_the_prefix_literally(backend: LockBackend, key_prefix: str) -> None:
    """Glob characters in the prefix are plain characters (Redis MATCH must escape them)."""
    # Given keys that a glob pattern built from the prefix would wrongly match
    literal = f"{key_prefix}a*[b]?\\:"
    mine = f"{literal}x"
    lookalikes = [f"{key_prefix}aZ[b]?\\:x", f"{key_prefix}a*b?\\:x", f"{key_prefix}a*[b]Q\\:x"]
    for name in [mine, *lookalikes]:
        assert backend.acquire(name, "token", LEASE).acquired

    # When the literal prefix is listed, then only the key that really starts with it is there
    assert list(listed(backend, literal)) == [mine]


def test_release_held_by_releases_only_for_the_holders_task_id(
    backend: LockBackend, key: str
) -> None:
    """A release naming another task id changes nothing; naming the holder's releases it."""
    # Given a lock held by task id-a
    held = backend.acquire(key, "token-a", LEASE, meta={"task_id": "id-a", "task": "t"})
    assert held.acquired

    # When another task id is named, then nothing changes
    assert backend.release_held_by(key, "id-b") is None
    still = backend.holder(key)
    assert still is not None
    assert still.token == "token-a"

    # When the holder's task id is named, then the lock is released and its holder returned
    removed = backend.release_held_by(key, "id-a")
    assert removed is not None
    assert removed.token == "token-a"
    assert removed.task_id == "id-a"
    assert removed.fence == held.fence
    assert removed.meta["task"] == "t"
    assert backend.holder(key) is None


def test_release_held_by_of_a_free_key_is_none(backend: LockBackend, key: str) -> None:
    assert backend.release_held_by(key, "id-a") is None
    assert backend.holder(key) is None


def test_force_release_releases_whoever_holds_it(backend: LockBackend, key: str) -> None:
    """A forced release removes any holder, even one without a task id (a direct call)."""
    # Given a lock held without a task id
    held = backend.acquire(key, "direct:abc", LEASE)
    assert held.acquired

    # When it is released by force
    removed = backend.force_release(key)

    # Then it returned that holder and the key is free; a second forced release finds nothing
    assert removed is not None
    assert removed.token == "direct:abc"
    assert removed.task_id is None
    assert removed.fence == held.fence
    assert removed.ttl is not None
    assert 0 < removed.ttl <= LEASE
    assert backend.holder(key) is None
    assert backend.force_release(key) is None


@pytest.mark.parametrize("how", ["held_by", "force"])
def test_an_operator_release_is_safe_for_the_old_and_the_next_holder(
    backend: LockBackend, key: str, how: str
) -> None:
    """After an operator release the old holder can neither renew nor release, the next
    acquisition starts at once with a larger fence, and the key's bookkeeping is kept."""
    # Given a lock held by id-a, with a pending follow-up and a completion marker from before
    assert backend.acquire(key, "token-0", LEASE).acquired
    assert backend.release(key, "token-0", completed="id-0:0")
    old = backend.acquire(key, "token-a", LEASE, meta={"task_id": "id-a"})
    assert backend.claim_next(key, "next-id", LEASE) == "next-id"

    # When an operator releases it
    force = how == "force"
    removed = backend.force_release(key) if force else backend.release_held_by(key, "id-a")
    assert removed is not None

    # Then the old holder's renewal and release report that it no longer holds it
    assert backend.extend(key, "token-a", LEASE) is False
    assert backend.extend_many([(key, "token-a", LEASE)]) == [False]
    assert backend.release(key, "token-a") is False
    # And a new execution acquires it at once, with a larger fence
    new = backend.acquire(key, "token-b", LEASE, meta={"task_id": "id-b"})
    assert new.acquired
    assert new.fence is not None
    assert old.fence is not None
    assert new.fence > old.fence
    # And the follow-up claim survived the release
    assert backend.claim_next(key, "other-id", LEASE) == "next-id"


# -- follow-up claims: claim_next, clear_next ------------------------------------------------


def test_clear_next_ends_only_the_claim_of_its_own_task_id(backend: LockBackend, key: str) -> None:
    """A coalescing follow-up whose message cannot be published takes its claim back with
    clear_next: that must end its own claim only, never one another send made since."""
    # Given a pending follow-up claimed by next-a
    assert backend.claim_next(key, "next-a", LEASE) == "next-a"

    # When another task id clears it / Then nothing changes: next-a is still the follow-up
    assert backend.clear_next(key, "next-b") is False
    assert backend.claim_next(key, "next-c", LEASE) == "next-a"

    # When next-a clears its own claim / Then the next claim takes
    assert backend.clear_next(key, "next-a") is True
    assert backend.claim_next(key, "next-c", LEASE) == "next-c"
    # And a late clear by next-a leaves next-c's claim alone
    assert backend.clear_next(key, "next-a") is False
    assert backend.claim_next(key, "next-d", LEASE) == "next-c"
