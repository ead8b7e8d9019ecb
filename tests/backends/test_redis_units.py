"""Named limits on the Redis stores (``take_units``, ``give_units``): what only Redis has, on the
private Redis server and the session's cluster. The contract is tests/contract/
test_contract_units.py."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from singletask import BackendError, BackendUnavailable, ConfigurationError, LockKeyError
from singletask.backends import backend_from_url
from singletask.backends.base import Turn, Units
from singletask.backends.memory import MemoryBackend
from singletask.backends.redis.deploy import RedisClusterBackend
from singletask.backends.redis.limit_scripts import TAKE_UNITS_SCRIPT
from singletask.backends.redis.store import RedisBackend
from singletask.backends.redis.units import (
    limit_keys,
    line_key,
    log_key,
    script_keys,
    units_key,
)
from singletask.backends.turns import Line
from singletask.protocol.limits import limit_key

from ..deployments import ClusterDeployment
from ..servers import free_port

LEASE = 30.0
PERIOD = 30.0


@pytest.fixture
def redis_backend(redis_url: str) -> Iterator[RedisBackend]:
    backend = RedisBackend.from_url(redis_url)
    yield backend
    backend.close()


def reads(client: redis.Redis) -> int:
    """How many requests the server has read (INFO stats)."""
    return int(client.info("stats")["total_reads_processed"])


# -- storage format -----------------------------------------------------------------------------


def test_a_limit_is_a_record_a_log_and_a_units_hash_that_expire_together(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A rate is its record (size, period, units counted), a sorted set of starts by server
    time and a hash of each start's units and metadata, all three expiring with the last start
    (its period after it)."""
    # Given two starts of a rate, the first with metadata
    tokens = Units(limit_key(key_prefix, "tokens", rate=True), 100, 30, PERIOD)
    meta = {"task_id": "task-a", "task": "app.summarize", "hostname": "h"}
    assert redis_backend.take_units("token-a", LEASE, [tokens], meta=meta).taken
    assert redis_backend.take_units("token-b", LEASE, [Units(tokens.key, 100, 5, PERIOD)]).taken

    # Then the record keeps the size, the period in ms and the units counted
    record, log, units = limit_keys(tokens.key)
    assert (log, units) == (f"{{{tokens.key}}}:holds", f"{{{tokens.key}}}:units")
    assert redis_client.hgetall(record) == {b"s": b"100", b"p": b"30000", b"n": b"35"}
    # And the log holds the starts by server time in microseconds, oldest first
    starts: Any = redis_client.zrange(log, 0, -1, withscores=True)
    assert [token for token, _ in starts] == [b"token-a", b"token-b"]
    now_s, now_us = (int(part) for part in redis_client.time())
    assert 0 <= now_s * 1_000_000 + now_us - starts[0][1] < 5_000_000
    # And the units hash each start's units, with the task id and task name only
    assert redis_client.hgetall(units) == {
        b"utoken-a": b"30", b"itoken-a": b"task-a", b"ttoken-a": b"app.summarize",
        b"utoken-b": b"5",
    }  # fmt: skip
    # And the three expire together, a period after the last start
    pttls = [redis_client.pttl(name) for name in limit_keys(tokens.key)]
    assert max(pttls) - min(pttls) <= 50
    assert PERIOD * 1000 - 5000 < min(pttls) <= PERIOD * 1000


def test_a_concurrency_limit_expires_with_its_last_hold_and_drops_those_that_ran_out(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The keys of a concurrency limit expire with the hold that runs out last; a take drops
    the holds whose lease ran out (their units with them); the last hold given back deletes
    the limit."""
    # Given a short hold and a long one
    limit = Units(limit_key(key_prefix, "warehouse"), 3, 1)
    assert redis_backend.take_units("token-a", 0.2, [limit]).taken
    assert redis_backend.take_units("token-b", LEASE, [Units(limit.key, 3, 2)]).taken
    record, log, units = limit_keys(limit.key)
    assert LEASE * 1000 - 5000 < redis_client.pttl(record) <= LEASE * 1000
    assert redis_client.hget(record, "p") is None

    # When the short hold runs out and another token takes a unit
    time.sleep(0.3)
    assert redis_backend.take_units("token-c", LEASE, [limit]).taken

    # Then the hold that ran out is gone, units and all
    assert set(redis_client.zrange(log, 0, -1)) == {b"token-b", b"token-c"}
    assert redis_client.hget(record, "n") == b"3"
    assert not redis_client.hexists(units, "utoken-a")

    # And when the last holds are given back, nothing is left
    assert redis_backend.give_units("token-b", [limit]) == [True]
    assert redis_backend.give_units("token-c", [limit]) == [True]
    assert redis_client.exists(record, log, units) == 0


def test_the_limits_records_are_never_listed_as_locks(
    redis_backend: RedisBackend, key_prefix: str
) -> None:
    """iter_locks leaves a limit's record and its companions out; iter_state lists each limit
    once, under its key."""
    requests = Units(limit_key(key_prefix, "requests"), 2, 1)
    tokens = Units(limit_key(key_prefix, "{llm}-tokens", rate=True), 10, 1, PERIOD)
    assert redis_backend.take_units("token-a", LEASE, [requests]).taken
    assert redis_backend.take_units("token-a", LEASE, [tokens]).taken
    assert redis_backend.acquire(f"{key_prefix}lock", "token-l", LEASE).acquired

    assert [key for key, _ in redis_backend.iter_locks(key_prefix)] == [f"{key_prefix}lock"]
    for prefix in (key_prefix, ""):
        listed = [s for s in redis_backend.iter_state(prefix) if s.key.startswith(key_prefix)]
        assert sorted((s.kind, s.key) for s in listed) == [
            ("limit", requests.key), ("limit", tokens.key),
        ]  # fmt: skip


def test_a_name_ending_as_a_limits_companion_is_refused(
    redis_backend: RedisBackend, key_prefix: str
) -> None:
    """A limit named like another limit's log or units hash (``<name>}:holds``) could be that
    record: refused before anything is sent; so is a raw lock key ending so."""
    clash = Units(limit_key(key_prefix, "{llm}-tokens}:holds"), 2, 1)
    with pytest.raises(ConfigurationError, match="holds"):
        redis_backend.take_units("token-a", LEASE, [clash])
    with pytest.raises(ConfigurationError, match="holds"):
        redis_backend.check_units_together([clash.key], "lock_limits of app.task")
    with pytest.raises(LockKeyError):
        redis_backend.acquire(f"{key_prefix}lock}}:units", "token-a", LEASE)


def test_a_limits_line_is_a_json_string_that_expires_with_its_last_ticket(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A refused turn's ticket waits in ``{<limit key>}:turns``: the JSON of Line.to_json
    (times in microseconds of the server's clock), expiring with the last ticket's lease; a
    ticket given back leaves it, and the line is deleted when its last ticket is served. It is
    never listed as a lock, nor as a limit of its own."""
    # Given a limit of one unit, held, and two turns refused, the second with a longer lease
    limit = Units(limit_key(key_prefix, "requests"), 1, 1)
    assert redis_backend.take_units("first", LEASE, [limit]).taken
    short = Units(limit.key, 1, 1, None, Turn("a1", "A", lease=20.0, hold=5.0))
    long = Units(limit.key, 1, 1, None, Turn("b1", "B", weight=0.3, priority=-2, lease=40.0))
    assert not redis_backend.take_units("a1", LEASE, [short], meta={"task_id": "a1"}).taken
    assert not redis_backend.take_units("b1", LEASE, [long], meta={"task": "app.t"}).taken

    # Then the line holds both tickets, in the fields of Line.to_json, numbers read back exact
    name = line_key(limit.key)
    assert name == f"{{{limit.key}}}:turns"
    raw: Any = redis_client.get(name)
    value = json.loads(raw)
    assert set(value) == {"v", "q", "k"}
    assert value["q"] == 2
    line = Line.from_json(value)
    a1, b1 = line.tickets["a1"], line.tickets["b1"]
    assert (a1.group, a1.units, a1.seq, a1.ready, a1.meta) == ("A", 1, 0, None, {"task_id": "a1"})
    assert (a1.finish, a1.tag, a1.hold) == (1.0, 1.0, 5_000_000)
    assert (b1.finish, b1.tag, b1.meta) == (1 / 0.3, 1 / 0.3 + 2, {"task": "app.t"})
    now_s, now_us = (int(part) for part in redis_client.time())
    assert 19_000_000 < a1.expires - (now_s * 1_000_000 + now_us) <= 20_000_000
    # And the line expires with the last ticket's lease; the limit's records keep theirs
    assert 39_000 < redis_client.pttl(name) <= 40_000
    assert LEASE * 1000 - 5000 < redis_client.pttl(limit.key) <= LEASE * 1000
    # And it is neither a lock nor a limit of its own
    assert list(redis_backend.iter_locks(key_prefix)) == []
    assert [(s.kind, s.key) for s in redis_backend.iter_state(key_prefix)] == [("limit", limit.key)]

    # When a1 gives its ticket back, b1 is left, and the line still expires with it
    assert redis_backend.give_units("a1", [short]) == [False]
    assert set(json.loads(redis_client.get(name) or "{}")["k"]) == {"b1"}
    assert 39_000 < redis_client.pttl(name) <= 40_000
    # And when b1 is served, the line is gone
    assert redis_backend.give_units("first", [limit]) == [True]
    assert redis_backend.take_units("b1", LEASE, [long]).taken
    assert redis_client.exists(name) == 0


def test_a_take_without_a_turn_reads_the_line_once_and_writes_nothing_more(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Nobody waiting and no turn: a take reads each limit's line key once (a GET that finds
    nothing), sends no turn arguments and writes nothing to the line; a refused one neither."""
    limits = [
        Units(limit_key(key_prefix, "{llm}-requests"), 1, 1),
        Units(limit_key(key_prefix, "{llm}-tokens", rate=True), 10, 1, PERIOD),
    ]
    assert redis_backend.take_units("token-0", LEASE, limits).taken  # the script cached

    def calls() -> dict[str, int]:
        stats = redis_client.info("commandstats")
        return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
                for name in ("get", "set", "del")}  # fmt: skip

    for token, taken in (("token-1", False), ("token-0", True)):
        before = calls()
        assert redis_backend.take_units(token, LEASE, limits).taken is taken
        after = calls()
        assert {name: after[name] - before[name] for name in after} == {
            "get": 2, "set": 0, "del": 0,
        }  # fmt: skip
    assert redis_client.exists(*[line_key(item.key) for item in limits]) == 0


def test_the_take_script_checks_every_turn_argument_before_its_first_write(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A turn's weight, priority, lease or hold out of range (as a client that skips the
    checks of check_turn would send it) fails the script before it writes anything."""
    good = Units(limit_key(key_prefix, "good"), 5, 1)
    bad = Units(limit_key(key_prefix, "bad"), 5, 1)
    keys = [*script_keys(good.key), *script_keys(bad.key)]
    head: list[str | int] = [
        "token-a",
        30_000,
        "",
        "",
        "",
        5,
        1,
        0,
        5,
        1,
        0,
        "",
        "",
        "",
        "",
        "",
        "",
    ]
    for turn, what in (
        (["b", "B", "0", 0, 1000, 1000], "weight"),
        (["b", "B", "-1.0", 0, 1000, 1000], "weight"),
        (["b", "B", "nan", 0, 1000, 1000], "weight"),
        (["b", "B", "inf", 0, 1000, 1000], "weight"),
        (["b", "B", "1000.5", 0, 1000, 1000], "weight"),
        (["b", "B", "1.0", 11, 1000, 1000], "priority"),
        (["b", "B", "1.0", "1.5", 1000, 1000], "priority"),
        (["b", "B", "1.0", 0, 0, 1000], "duration"),
        (["b", "B", "1.0", 0, 1000, -1], "duration"),
    ):
        with pytest.raises(
            redis.ResponseError, match=f"singletask: turn {what}|singletask: {what}"
        ):
            redis_client.eval(TAKE_UNITS_SCRIPT, len(keys), *keys, *head, *turn)
        assert redis_client.exists(*keys) == 0


@pytest.mark.parametrize("seed", range(12))
def test_the_scripts_keep_the_line_as_the_python_reference_does(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str, seed: int
) -> None:
    """Random takes and givings back, with and without turns, of two concurrency limits and a
    rate (one take asking one or two of them), decided the same on Redis as on the in-process
    store (singletask.backends.turns in Python): taken or refused, which limit, its units in
    use, a rate's wait (within a second: the two clocks differ), what each giving back found;
    and after each, every line the same: its virtual time, its next seq, its tickets in order,
    each with the same finish, tag, seq, units and whether it is ready. Leases, holds and the
    period are long enough that nothing runs out during the test."""
    rnd = random.Random(seed)
    memory = MemoryBackend()
    keys = [limit_key(key_prefix, "{fz}-a"), limit_key(key_prefix, "{fz}-b"),
            limit_key(key_prefix, "{fz}-r", rate=True)]  # fmt: skip
    sizes = [rnd.randint(1, 4), rnd.randint(1, 4), rnd.randint(2, 8)]
    tickets = [f"t{i}" for i in range(8)]
    groups = {t: rnd.choice("ABC") for t in tickets}
    weights = {g: rnd.choice([0.5, 1.0, 2.0, 3.0]) for g in "ABC"}
    priorities = {t: rnd.choice([0, 0, 0, 1, -1, 10, -10]) for t in tickets}
    wants = {t: rnd.randint(1, 2) for t in tickets}

    def lined(line: Line) -> Any:
        return (
            line.vt,
            line.seq,
            [
                (name, t.group, t.finish, t.tag, t.seq, t.units, t.ready is not None)
                for name, t in line.ordered()
            ],
        )

    def seen(result: Any) -> Any:
        if isinstance(result, list):
            return result
        return result.taken, result.limit, result.used, result.retry_after

    def same(got: Any, expected: Any) -> bool:
        """Equal, but for a rate's wait: within a second (the two clocks differ, so rounding
        each to the second can still differ by one, as 599.4 and 599.6 do)."""
        if isinstance(expected, list) or isinstance(got, list):
            return bool(got == expected)
        (*decided, wait), (*reference, reference_wait) = got, expected
        if decided != reference or (wait is None) != (reference_wait is None):
            return False
        return wait is None or abs(wait - reference_wait) < 1.0

    for step in range(100):
        token = rnd.choice(tickets)
        turn = Turn(token, groups[token], weights[groups[token]], priorities[token], 600.0, 600.0)
        with_turn = rnd.random() < 0.8
        items = [
            Units(keys[i], sizes[i], min(wants[token], sizes[i]), 600.0 if i == 2 else None,
                  turn if with_turn else None)
            for i in rnd.choice([[0], [1], [0, 1], [2], [0, 2], [1, 2]])
        ]  # fmt: skip
        if rnd.random() < 0.6:
            meta = {"task_id": token}
            expected = seen(memory.take_units(token, 600.0, items, meta=meta))
            got = seen(redis_backend.take_units(token, 600.0, items, meta=meta))
        else:
            expected, got = memory.give_units(token, items), redis_backend.give_units(token, items)
        assert same(got, expected), f"step {step}: {token} {items}: {got} != {expected}"
        for key in keys:  # and each line holds the same tickets, in the same order, as ready
            raw = redis_client.get(line_key(key))
            assert lined(Line.from_json(json.loads(raw) if raw else None)) == lined(
                memory._limits.lines.get(key) or Line()
            ), f"step {step}: the line of {key}"


# -- one atomic step ----------------------------------------------------------------------------


def test_a_take_and_a_give_cost_one_round_trip_each(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """take_units checks and takes every limit in one script: one request, whether it takes,
    is refused by a concurrency limit or by a rate (with its wait); give_units is one too."""
    # Given a backend that has already connected and cached its scripts
    warm = Units(limit_key(key_prefix, "warm"), 1, 1)
    assert redis_backend.take_units("token-0", LEASE, [warm]).taken
    assert redis_backend.give_units("token-0", [warm]) == [True]
    requests = Units(limit_key(key_prefix, "{llm}-requests"), 1, 1)
    tokens = Units(limit_key(key_prefix, "{llm}-tokens", rate=True), 10, 8, PERIOD)
    calls: list[Callable[[], Any]] = [
        lambda: redis_backend.take_units("token-1", LEASE, [requests, tokens]),
        lambda: redis_backend.take_units("token-2", LEASE, [requests, tokens]),
        lambda: redis_backend.take_units("token-2", LEASE, [tokens]),
        lambda: redis_backend.give_units("token-1", [requests, tokens]),
    ]
    outcomes: list[Any] = []
    for call in calls:
        before = reads(redis_client)
        outcomes.append(call())
        # Then the server read one request (and the INFO that reads the count)
        assert reads(redis_client) - before - 1 == 1
    taken, held, rated, given = outcomes
    assert taken.taken
    assert (held.taken, held.limit) == (False, requests.key)
    assert (rated.taken, rated.limit, rated.used) == (False, tokens.key, 8)
    assert rated.retry_after is not None
    assert given == [True, True]


def test_the_take_script_checks_every_argument_before_its_first_write(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Called with a period, a lease or units out of range, the script fails before it writes
    anything: no key is left, let alone one without an expiry."""
    good = Units(limit_key(key_prefix, "good"), 5, 1)
    bad = Units(limit_key(key_prefix, "bad"), 5, 1)
    keys = [*script_keys(good.key), *script_keys(bad.key)]
    head: list[str | int | float] = ["token-a", 30_000, "", "", ""]
    for args in (
        [*head, 5, 1, 0, 5, 1, -1],  # a negative period
        [*head, 5, 1, 0, 5, 1, 10**12],  # a period beyond the longest lease
        [*head, 5, 1, 0, 5, 6, 0],  # more units than the size
        [*head, 5, 1, 0, 5, 1.5, 0],  # units that are no whole number
        [*head[:1], 0, *head[2:], 5, 1, 0, 5, 1, 0],  # no lease
    ):
        with pytest.raises(redis.ResponseError, match="singletask"):
            redis_client.eval(TAKE_UNITS_SCRIPT, len(keys), *keys, *args)
        assert redis_client.exists(*keys) == 0


# -- errors -------------------------------------------------------------------------------------


def test_driver_errors_are_translated(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A limit's key holding another application's value is a BackendError naming the
    operation; a server that does not answer is BackendUnavailable."""
    foreign = Units(limit_key(key_prefix, "foreign"), 2, 1)
    redis_client.set(foreign.key, "not a limit", ex=60)
    with pytest.raises(BackendError, match=r"take_units.*not a singletask lock"):
        redis_backend.take_units("token-a", LEASE, [foreign])
    assert redis_client.get(foreign.key) == b"not a limit"

    nowhere = RedisBackend.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    try:
        with pytest.raises(BackendUnavailable):
            nowhere.take_units("token-a", LEASE, [Units(limit_key(key_prefix, "x"), 1, 1)])
        with pytest.raises(BackendUnavailable):
            nowhere.give_units("token-a", [Units(limit_key(key_prefix, "x"), 1, 1)])
    finally:
        nowhere.close()


# -- Redis Cluster ------------------------------------------------------------------------------


def test_the_cluster_store_refuses_limits_of_several_slots_before_sending_anything() -> None:
    """Limits of one take must share a hash slot: a cluster store refuses others with a
    ConfigurationError that says how to name them, before it connects (here: to nothing)."""
    backend = backend_from_url(f"redis+cluster://127.0.0.1:{free_port()}")
    assert isinstance(backend, RedisClusterBackend)
    apart = [
        Units(limit_key("app:", "openai-requests"), 8, 1),
        Units(limit_key("app:", "openai-tokens", rate=True), 100, 10, 60.0),
    ]
    with pytest.raises(ConfigurationError, match=r'"\{openai\}-requests" and "\{openai\}-tokens"'):
        backend.take_units("token-a", LEASE, apart)
    with pytest.raises(ConfigurationError, match="hash slot"):
        backend.give_units("token-a", apart)
    with pytest.raises(ConfigurationError, match=r"lock_limits of app\.summarize"):
        backend.check_units_together([u.key for u in apart], "lock_limits of app.summarize")
    # a name with a '}' but no hash tag: its own records are in several slots
    with pytest.raises(ConfigurationError, match="hash tag"):
        backend.check_units_together([limit_key("app:", "odd}name")], "lock_limits")
    # one hash tag: one slot, nothing to refuse
    backend.check_units_together(
        [limit_key("app:", "{openai}-requests"), limit_key("app:", "{openai}-tokens", rate=True)],
        "lock_limits",
    )
    backend.check_units_together([limit_key("{app}:", "a"), limit_key("{app}:", "b")], "x")
    backend.close()


def test_a_single_server_takes_limits_of_any_names_together(
    redis_backend: RedisBackend, key_prefix: str
) -> None:
    """One server has no hash slots: check_units_together refuses nothing, and one take holds
    limits of any names."""
    apart = [Units(limit_key(key_prefix, "a"), 1, 1), Units(limit_key(key_prefix, "b"), 1, 1)]
    redis_backend.check_units_together([u.key for u in apart], "lock_limits")
    assert redis_backend.take_units("token-a", LEASE, apart).taken


def test_every_key_of_the_limits_of_one_take_is_in_one_cluster_slot(
    redis_cluster: ClusterDeployment,
) -> None:
    """On the cluster, a take of limits with one hash tag writes their records, logs and units
    hashes in the tag's slot; limits of several slots are refused and nothing is written."""
    prefix = f"app{uuid.uuid4().hex[:8]}:"
    requests = Units(limit_key(prefix, "{llm}-requests"), 8, 1)
    tokens = Units(limit_key(prefix, "{llm}-tokens", rate=True), 100, 10, PERIOD)
    apart = Units(limit_key(prefix, "elsewhere"), 8, 1)
    client: Any = redis_cluster.client()
    try:
        with backend_from_url(redis_cluster.url) as backend:
            assert backend.take_units("token-a", LEASE, [requests, tokens]).taken
            with pytest.raises(ConfigurationError, match="hash tag"):
                backend.take_units("token-b", LEASE, [requests, apart])
            assert backend.give_units("token-a", [Units(tokens.key, 100, 4, PERIOD)]) == [True]
            states = {s.key: s for s in backend.iter_state(prefix) if s.kind == "limit"}
        written = [k.decode() for k in client.scan_iter(match=f"*{prefix}*")]
        assert sorted(written) == sorted([*limit_keys(requests.key), *limit_keys(tokens.key)])
        assert {client.keyslot(k) for k in written} == {client.keyslot("{llm}")}
        assert states[tokens.key].detail["used"] == 4
        assert states[requests.key].detail["holds"][0]["token"] == "token-a"
        assert log_key(apart.key) not in written
        assert units_key(apart.key) not in written
    finally:
        client.close()


def test_a_key_and_its_units_cost_one_round_trip_to_take_and_one_to_give_back(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """On one server the lock and the units of its limits go in one script each way: an
    execution with named limits costs the two round trips of one without."""
    key = f"{key_prefix}lock"
    requests = Units(limit_key(key_prefix, "{llm}-requests"), 1, 1)
    tokens = Units(limit_key(key_prefix, "{llm}-tokens", rate=True), 10, 3, PERIOD)
    warm = redis_backend.acquire(key, "token-0", LEASE, units=[requests, tokens])
    assert redis_backend.release(key, "token-0", units=[requests, tokens])
    assert warm.acquired
    calls: list[Callable[[], Any]] = [
        lambda: redis_backend.acquire(key, "token-1", LEASE, units=[requests, tokens]),
        lambda: redis_backend.acquire(f"{key}2", "token-2", LEASE, units=[requests]),
        lambda: redis_backend.release(key, "token-1", units=[requests, tokens]),
    ]
    outcomes: list[Any] = []
    for call in calls:
        before = reads(redis_client)
        outcomes.append(call())
        assert reads(redis_client) - before - 1 == 1
    taken, refused, released = outcomes
    assert taken.acquired
    assert (refused.acquired, refused.limit) == (False, requests.key)
    assert released is True
