"""The contract of :meth:`LockBackend.iter_state`, run against every backend: the store's
bookkeeping records (pending follow-ups, debounce windows, rate records) listed by key prefix,
in bounded pages, read-only.

A store that cannot list its keys (memcached, the Django caches) raises UnsupportedOperation
when the iteration starts; every other store lists the live records of the keys under the
prefix, each under its lock key (never the store key it is kept under), and leaves out the
locks themselves, released keys' fence records and records that ran out.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from singletask.backends.base import LockBackend, StoreState
from singletask.exceptions import UnsupportedOperation
from singletask.ops.inventory import StateRecord, find_state

from ..conftest import ONE_HOLDER_BACKENDS
from .test_contract import (
    LEASE,
    SHORT,
    every_record_expires,  # noqa: F401 - the contract's autouse check
)

#: Starts of a key spaced by this much: it does not run out during a test.
INTERVAL = 30.0


def states(backend: LockBackend, prefix: str, page_size: int = 500) -> list[StoreState]:
    """``iter_state`` as a list; a store that cannot list its keys skips the test (it must say
    so at once: test_a_store_that_cannot_list_its_state_says_so_at_once)."""
    try:
        return list(backend.iter_state(prefix, page_size=page_size))
    except UnsupportedOperation as exc:
        pytest.skip(f"{backend!r} cannot list its keys: {exc}")


def by_kind(found: list[StoreState]) -> dict[tuple[str, str], StoreState]:
    pairs = {(state.kind, state.key): state for state in found}
    assert len(pairs) == len(found), f"a record was listed twice: {found}"
    return pairs


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_store_that_cannot_list_its_state_says_so_at_once(
    backend: LockBackend, key_prefix: str, request: pytest.FixtureRequest
) -> None:
    """iter_state lists (nothing, under a fresh prefix) or raises UnsupportedOperation on its
    first step; only the stores that keep one holder and no companion records refuse."""
    iterator = backend.iter_state(key_prefix)
    try:
        assert next(iterator, None) is None
    except UnsupportedOperation:
        assert request.node.callspec.params["backend"] in ONE_HOLDER_BACKENDS
        return
    assert request.node.callspec.params["backend"] not in ONE_HOLDER_BACKENDS


def test_iter_state_lists_follow_ups_windows_and_rate_records_under_their_lock_keys(
    backend: LockBackend, key_prefix: str
) -> None:
    """Each live record is listed once, under its lock key, with the task id it names and the
    seconds it has left; the locks themselves are not listed here."""
    # Given, under the prefix, a key with a pending follow-up (and a lock), one with an open
    # debounce window of two sends, one whose rate record was written by a start, and a key
    # with a closed window; and a follow-up under another prefix
    follow, window, rated, closed = (f"{key_prefix}app.t:{n}" for n in ("f", "w", "r", "c"))
    assert backend.acquire(follow, "token-a", LEASE).acquired
    assert backend.claim_next(follow, "next-id", LEASE) == "next-id"
    if backend.supports_debounce:
        backend.debounce(window, "send-1", LEASE)
        backend.debounce(window, "send-2", LEASE)
        backend.debounce(closed, "send-c", LEASE)
        assert backend.debounce_take(closed, "send-c") == ("send-c", 0.0)
    if backend.supports_rate:
        assert backend.acquire_slot(rated, 2, "token-r", LEASE, interval=INTERVAL).acquired
    backend.claim_next(f"other-{key_prefix}app.t:f", "elsewhere", LEASE)

    # When the prefix's bookkeeping is listed
    found = by_kind(states(backend, key_prefix))

    # Then the follow-up is there, naming the waiting task id, its claim's time left
    expected = {("follow_up", follow)}
    pending = found[("follow_up", follow)]
    assert pending.task_id == "next-id"
    assert pending.ttl is not None
    assert 0 < pending.ttl <= LEASE + 1
    if backend.supports_debounce:
        # And the open window names its latest send, the closed one the send that closed it
        expected |= {("window", window), ("window", closed)}
        open_window = found[("window", window)]
        assert open_window.task_id == "send-2"
        assert open_window.detail["open"] is True
        assert 0 <= open_window.detail["age"] < LEASE
        assert open_window.ttl is not None
        assert 0 < open_window.ttl <= LEASE + 1
        assert found[("window", closed)].task_id == "send-c"
        assert found[("window", closed)].detail["open"] is False
        assert found[("window", closed)].detail["age"] is None
    if backend.supports_rate:
        # And the rate record says when the key's next start is allowed
        expected.add(("rate", rated))
        rate = found[("rate", rated)]
        assert rate.task_id is None
        assert 0 < rate.detail["next_start_in"] <= INTERVAL + 1
        assert rate.ttl is not None
        assert 0 < rate.ttl <= INTERVAL + 1
    assert set(found) == expected


def test_iter_state_leaves_out_what_ran_out_or_was_cleared(
    backend: LockBackend, key_prefix: str
) -> None:
    """A cleared follow-up, a claim that ran out, a window taken back and a released lock's
    fence record are no records; nor is a held lock."""
    cleared, expired, undone, released = (f"{key_prefix}{n}" for n in ("c", "e", "u", "r"))
    assert backend.claim_next(cleared, "id-c", LEASE) == "id-c"
    assert backend.clear_next(cleared, "id-c")
    assert backend.claim_next(expired, "id-e", SHORT) == "id-e"
    if backend.supports_debounce:
        previous, _, closed = backend.debounce(undone, "send-u", LEASE)
        assert backend.debounce_undo(undone, "send-u", previous, closed=closed)
    assert backend.acquire(released, "token-r", LEASE).acquired
    assert backend.release(released, "token-r", completed="done")

    assert wait_for(lambda: states(backend, key_prefix) == [])


def test_iter_state_reads_in_pages_and_matches_the_prefix_literally(
    backend: LockBackend, key_prefix: str
) -> None:
    """Small pages list every record once; glob characters in the prefix are plain ones."""
    literal = f"{key_prefix}a*[b]?\\:"
    keys = sorted(f"{literal}k{n:02d}" for n in range(7))
    for name in keys:
        assert backend.claim_next(name, "id", LEASE) == "id"
    for lookalike in (f"{key_prefix}aZ[b]?\\:k", f"{key_prefix}a*b?\\:k"):
        assert backend.claim_next(lookalike, "id", LEASE) == "id"
    for page_size in (1, 3, 500):
        found = states(backend, literal, page_size=page_size)
        assert sorted(state.key for state in found) == keys
        assert {state.kind for state in found} == {"follow_up"}


def test_iter_state_finds_the_records_of_a_key_with_a_brace(
    backend: LockBackend, key_prefix: str
) -> None:
    """A key under a hash-tagged prefix (``{tag}...``) keeps its records under ``<key>}:...``;
    they are listed under the key."""
    tagged_prefix = "{" + key_prefix.rstrip(":") + "}:"
    tagged = f"{tagged_prefix}app.t"
    assert backend.claim_next(tagged, "id-t", LEASE) == "id-t"
    found = by_kind(states(backend, tagged_prefix))
    assert list(found) == [("follow_up", tagged)]


def test_find_state_names_the_task_and_filters_by_task_and_kind(
    backend: LockBackend, key_prefix: str
) -> None:
    """find_state reads the task name from the key (escaped characters and all), keeps one
    task's records with ``task=`` (not those of a longer name that starts with it), the kinds
    asked for with ``kinds=``, and at most ``limit``; its JSON form is plain JSON."""
    # Given follow-ups of the tasks "app:sync" (escaped in the key), "app" and "application"
    sync, bare, longer = (f"{key_prefix}{n}" for n in ("app%3Async:x", "app", "application:1"))
    for name in (sync, bare, longer):
        assert backend.claim_next(name, f"id-{name[-1]}", LEASE) == f"id-{name[-1]}"
    try:
        everything = list(find_state(backend, key_prefix))
    except UnsupportedOperation:
        pytest.skip(f"{backend!r} cannot list its keys")

    assert {(record.task, record.key) for record in everything} == {
        ("app:sync", sync), ("app", bare), ("application", longer),
    }  # fmt: skip
    only_app = list(find_state(backend, key_prefix, task="app"))
    assert [record.key for record in only_app] == [bare]
    assert list(find_state(backend, key_prefix, kinds=["window", "rate"])) == []
    assert len(list(find_state(backend, key_prefix, limit=2))) == 2
    record = only_app[0]
    assert isinstance(record, StateRecord)
    assert record.as_json() == {
        "kind": "follow_up", "key": bare, "task": "app", "task_id": "id-p",
        "ttl": record.as_json()["ttl"], "detail": {},
    }  # fmt: skip


def test_find_state_refuses_an_unknown_kind_at_the_call(backend: LockBackend) -> None:
    with pytest.raises(ValueError, match="lock"):
        find_state(backend, "x:", kinds=["lock"])
    with pytest.raises(ValueError, match="not the string"):
        find_state(backend, "x:", kinds="rate")
