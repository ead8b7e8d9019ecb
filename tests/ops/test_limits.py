"""The named limits as :mod:`singletask.ops.inventory` lists them (:func:`find_limits`), on a
store that keeps them: what ``singletask locks --limits``, the lock page and the exporter show.
"""

from __future__ import annotations

import pytest

from singletask.backends.base import LockBackend
from singletask.ops.inventory import (
    HOLD_FIELDS,
    LIMIT_FIELDS,
    LimitRecord,
    find_limits,
    find_locks,
    find_state,
)

from .limits import LEASE, PERIOD, concurrency, new_id, rate, take


def test_each_limit_in_use_is_listed_with_its_kind_size_units_and_holds(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    # Given two executions holding units of a concurrency limit, one also starting a rate's
    _, backend = limits_store
    first, second = new_id(), new_id()
    token = take(backend, first, "proj.summarize",
                 concurrency(key_prefix, "openai-requests", 8, 2),
                 rate(key_prefix, "openai-tokens", 90000, 1200))  # fmt: skip
    take(backend, second, "proj.embed", concurrency(key_prefix, "openai-requests", 8, 1))

    # When the limits are listed
    found = {record.name: record for record in find_limits(backend, key_prefix)}

    # Then each is there by its name, with its kind, size, units in use and holds
    assert set(found) == {"openai-requests", "openai-tokens"}
    requests = found["openai-requests"]
    assert (requests.kind, requests.size, requests.period, requests.used) == (
        "concurrency", 8, None, 3,
    )  # fmt: skip
    assert [(h.task_id, h.task, h.units) for h in requests.holds] == [
        (first, "proj.summarize", 2), (second, "proj.embed", 1),
    ]  # fmt: skip
    assert requests.holds[0].token == token
    assert all(h.ttl is not None and 0 < h.ttl <= LEASE for h in requests.holds)
    assert requests.ttl is not None
    assert 0 < requests.ttl <= LEASE
    assert requests.key == f"{key_prefix}%limit:openai-requests"
    tokens = found["openai-tokens"]
    assert (tokens.kind, tokens.size, tokens.period, tokens.used) == ("rate", 90000, PERIOD, 1200)
    [start] = tokens.holds
    assert (start.task_id, start.units) == (first, 1200)
    assert start.ttl is not None
    assert LEASE < start.ttl <= PERIOD  # the start's time left in the window
    assert tokens.units_not_shown == 0

    # And the locks listing does not take a limit for a lock
    assert list(find_locks(backend, key_prefix)) == []


def test_a_limit_s_json_has_exactly_the_documented_fields(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    _, backend = limits_store
    task_id = new_id()
    take(backend, task_id, "proj.summarize", rate(key_prefix, "openai-tokens", 90000, 1200))

    [record] = [r.as_json() for r in find_limits(backend, key_prefix)]

    assert tuple(record) == LIMIT_FIELDS
    assert tuple(record["holds"][0]) == HOLD_FIELDS
    assert record["name"] == "openai-tokens"
    assert record["kind"] == "rate"
    assert record["size"] == 90000
    assert record["period"] == PERIOD
    assert record["used"] == 1200
    assert record["key"] == f"{key_prefix}%rate:openai-tokens"
    hold = record["holds"][0]
    assert (hold["task_id"], hold["task"], hold["units"]) == (task_id, "proj.summarize", 1200)
    assert hold["ttl"] == round(hold["ttl"], 3)
    assert record["ttl"] == round(record["ttl"], 3)


def test_the_listing_filters_by_task_and_stops_at_the_limit(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """``task`` keeps the limits that task holds units of; ``limit`` stops the listing."""
    _, backend = limits_store
    take(backend, new_id(), "proj.summarize", concurrency(key_prefix, "a", 4, 1),
         concurrency(key_prefix, "b", 4, 1))  # fmt: skip
    take(backend, new_id(), "proj.embed", concurrency(key_prefix, "b", 4, 1))

    assert sorted(r.name for r in find_limits(backend, key_prefix, task="proj.embed")) == ["b"]
    assert sorted(r.name for r in find_limits(backend, key_prefix, task="proj.summarize")) == [
        "a", "b",
    ]  # fmt: skip
    assert list(find_limits(backend, key_prefix, task="proj.other")) == []
    assert len(list(find_limits(backend, key_prefix, limit=1))) == 1
    assert list(find_limits(backend, key_prefix, limit=0)) == []


def test_only_the_limits_under_the_prefix_are_listed(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    _, backend = limits_store
    take(backend, new_id(), "proj.summarize", concurrency(key_prefix, "mine", 4, 1),
         concurrency("other:", "theirs", 4, 1))  # fmt: skip

    assert [r.name for r in find_limits(backend, key_prefix)] == ["mine"]


def test_a_limit_given_back_leaves_the_listing(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    _, backend = limits_store
    units = concurrency(key_prefix, "openai-requests", 8, 2)
    token = take(backend, new_id(), "proj.summarize", units)
    assert [r.used for r in find_limits(backend, key_prefix)] == [2]

    assert backend.give_units(token, [units]) == [True]

    assert list(find_limits(backend, key_prefix)) == []


def test_find_state_lists_a_limit_s_record_under_its_store_key_without_a_task(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """Beside the locks' bookkeeping, ``find_state`` lists each limit's record: kind
    ``limit``, keyed by the limit's store key, no task (its holds name theirs); the same record
    reads as a :class:`LimitRecord`."""
    _, backend = limits_store
    task_id = new_id()
    take(backend, task_id, "proj.summarize", concurrency(key_prefix, "openai-requests", 8, 2))

    [state] = find_state(backend, key_prefix, kinds=["limit"])

    assert (state.kind, state.key, state.task, state.task_id) == (
        "limit", f"{key_prefix}%limit:openai-requests", None, None,
    )  # fmt: skip
    detail = state.as_json()["detail"]
    assert detail["used"] == 2
    assert detail["holds"][0]["task_id"] == task_id
    assert detail["holds"][0]["ttl"] == round(detail["holds"][0]["ttl"], 3)
    record = LimitRecord.from_store(state, key_prefix)
    assert (record.name, record.kind, record.used) == ("openai-requests", "concurrency", 2)
    assert list(find_state(backend, key_prefix, task="proj.summarize")) == []


@pytest.mark.parametrize("name", ["{openai}-tokens", "a:b%limit:c", "<b>x</b>\"'\\xff"])
def test_a_name_is_read_back_as_written(
    limits_store: tuple[str, LockBackend], key_prefix: str, name: str
) -> None:
    """Braces (a Redis Cluster hash tag), colons, the marks themselves, markup and quotes."""
    _, backend = limits_store
    take(backend, new_id(), "proj.summarize", rate(key_prefix, name, 10, 1))

    assert [(r.name, r.kind) for r in find_limits(backend, key_prefix)] == [(name, "rate")]
