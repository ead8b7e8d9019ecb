"""The contract under faults: every networked lock store, reached through a fault proxy.

The ``link`` fixture builds each store (Redis, PostgreSQL, MariaDB, memcached, and ``django://``
over Django's Redis and memcached caches) with its URL pointed through a
:class:`~tests.faultproxy.FaultProxy` and short client timeouts, next to a ``direct`` backend
that reaches the same server without the proxy (to look at what the store really holds). The
proxy then delays replies past the timeout, stalls, cuts and re-points the link, and the tests
state what a caller sees:

* an error is a :class:`~singletask.BackendTimeout` or :class:`~singletask.BackendUnavailable`
  (a :class:`~singletask.SingletaskError`) with the driver's error chained as ``__cause__``,
  raised within the store's timeouts plus a margin, never a hang;
* a lock the store took for a call that failed is freed by its own lease;
* after a cut, or once the server is back, calls work again (no poisoned pool);
* re-pointed, the next calls reach the new server;
* fences strictly increase even when an acquire is held up between two other clients' steps.

Two more cases run on every store of the ``backend`` fixture (memory and SQLite included), with
no proxy: lock keys as long as a user may write, and lock keys shaped like another lock's
companion records (``key|fence``, ``key|next``, ``{key}:fence``).

Re-pointing runs on Redis and memcached (a second server of the test's own); the SQL servers are
the machine's, with no second one to re-point to.
"""

from __future__ import annotations

import contextlib
import random
import string
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from singletask import SingletaskError
from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    LockKeyError,
    UnsupportedOperation,
)

from ..faultproxy import FaultProxy, address_of
from ..servers import (
    SQL_URLS,
    MemcachedServer,
    RedisServer,
    redis_scripts_binary,
    redis_server_binary,
    sql_test_table,
    start_memcached,
    unavailable,
)
from .test_contract import wait_until_free

T = TypeVar("T")

#: The stores reached over the network, each through the proxy (``redis-scripts``: a Redis
#: older than 7, on which every call is a script; ``redis``: the session's server, a Redis 7
#: where the machine has one).
NETWORKED = [
    "redis",
    "redis-scripts",
    "postgresql",
    "mysql",
    "memcached",
    "django-redis",
    "django-memcached",
]
#: Those with a second server of the test's own to re-point to (a new server: one that does not
#: have singletask's functions or scripts yet).
REPOINTABLE = ["redis", "redis-scripts", "memcached", "django-redis", "django-memcached"]

#: Client timeout (seconds) per store: socket reads/writes and connects for Redis and memcached;
#: the ``timeout`` option of the SQL stores (PostgreSQL connects within at least 2 s).
TIMEOUTS = {"redis": 0.5, "memcached": 0.5, "postgresql": 1.0, "mysql": 1.0}
CONNECT_TIMEOUTS = {"redis": 0.5, "memcached": 0.5, "postgresql": 2.0, "mysql": 1.0}
#: Added to a store's timeouts for "returns within": a loaded machine, a thread to start.
MARGIN = 2.0
LEASE = 30.0
#: A lease short enough to see it end in a test (memcached counts whole seconds).
SHORT_LEASE = 1.0
#: How long a lease may take to be seen over, after its end (memcached's clock ticks in seconds).
EXPIRY_SLACK = 3.0


@dataclass
class Link:
    """A store through the proxy (``backend``) and the same server without it (``direct``)."""

    kind: str
    proxy: FaultProxy
    backend: LockBackend
    direct: LockBackend
    #: Builds another backend through the proxy, with the given client timeout.
    make: Callable[[float], LockBackend]
    #: The longest any one call may take under a fault: a reconnect and a request, twice (the
    #: SQL stores retry once on a dropped connection), plus a margin.
    bound: float
    built: list[LockBackend] = field(default_factory=list)

    def another(self, timeout: float) -> LockBackend:
        backend = self.make(timeout)
        self.built.append(backend)
        return backend


def _base(kind: str) -> str:
    return kind.removeprefix("django-").removesuffix("-scripts")


def _redis_url(base_url: str, timeout: float) -> str:
    return f"{base_url}?socket_timeout={timeout}&socket_connect_timeout={timeout}"


def _memcached_url(base_url: str, timeout: float) -> str:
    return f"{base_url}?timeout={timeout}&connect_timeout={timeout}"


@contextlib.contextmanager
def _django_alias(kind: str, location: str, timeout: float) -> Iterator[str]:
    """A Django cache alias of our own for ``location`` (added to the configured CACHES)."""
    from django.core.cache import caches

    alias = f"faults-{uuid.uuid4().hex[:8]}"
    if kind == "redis":
        caches.settings[alias] = {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": location,
            "OPTIONS": {"socket_timeout": timeout, "socket_connect_timeout": timeout},
        }
    else:
        caches.settings[alias] = {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": location.removeprefix("memcached://"),
            "OPTIONS": {"timeout": timeout, "connect_timeout": timeout},
        }
    try:
        yield alias
    finally:
        caches.settings.pop(alias, None)


@pytest.fixture(params=NETWORKED)
def link(request: pytest.FixtureRequest) -> Iterator[Link]:
    kind: str = request.param
    base = _base(kind)
    timeout = TIMEOUTS[base]
    bound = 2 * (CONNECT_TIMEOUTS[base] + timeout) + MARGIN
    with contextlib.ExitStack() as stack:
        if base in SQL_URLS:
            table = stack.enter_context(sql_test_table(base))
            server_url = SQL_URLS[base]

            def build(url: str, seconds: float) -> LockBackend:
                return backend_from_url(url, table=table, timeout=seconds, pool_size=8)
        elif kind == "redis-scripts":
            server_url = request.getfixturevalue("redis_scripts_url")

            def build(url: str, seconds: float) -> LockBackend:
                return backend_from_url(_redis_url(url, seconds))
        elif base == "redis":
            server_url = request.getfixturevalue("redis_url")
            request.getfixturevalue("redis_client")  # fails / skips when the server is missing

            def build(url: str, seconds: float) -> LockBackend:
                return backend_from_url(_redis_url(url, seconds))
        else:
            server_url = request.getfixturevalue("memcached_url")

            def build(url: str, seconds: float) -> LockBackend:
                return backend_from_url(_memcached_url(url, seconds))

        proxy = stack.enter_context(FaultProxy(address_of(server_url)))
        proxied = proxy.url_for(server_url)
        if kind.startswith("django-"):
            request.getfixturevalue("django_caches")  # Django configured

            def make(seconds: float) -> LockBackend:
                alias = stack.enter_context(_django_alias(base, proxied, seconds))
                return backend_from_url(f"django://{alias}")
        else:

            def make(seconds: float) -> LockBackend:
                return build(proxied, seconds)

        direct = build(server_url, 5.0)
        stack.callback(direct.close)
        found = Link(kind, proxy, make(timeout), direct, make, bound)
        try:
            yield found
        finally:
            proxy.close()  # first: frees any call still blocked on the link
            for backend in (found.backend, *found.built):
                backend.close()


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


# -- helpers ------------------------------------------------------------------------------------


class Outcome:
    """What one call did: its result or its error, and how long it took."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.result: Any = None
        self.error: BaseException | None = None
        self.elapsed = 0.0
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def run(self, call: Callable[[], Any]) -> None:
        started = time.monotonic()
        try:
            self.result = call()
        except BaseException as exc:  # recorded for the test to judge
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - started
            self.done.set()


def start(name: str, call: Callable[[], Any]) -> Outcome:
    """Run ``call`` in a thread of its own (a call that hangs must not hang the test)."""
    outcome = Outcome(name)
    outcome.thread = threading.Thread(
        target=outcome.run, args=(call,), name=f"fault-call-{name}", daemon=True
    )
    outcome.thread.start()
    return outcome


def finish(outcome: Outcome, limit: float) -> Outcome:
    """Wait for ``outcome``; fail the test if the call is still blocked after ``limit`` s."""
    if not outcome.done.wait(limit):
        pytest.fail(f"{outcome.name}: still blocked after {limit:.1f}s", pytrace=False)
    return outcome


def bounded(name: str, call: Callable[[], T], limit: float) -> Outcome:
    return finish(start(name, call), limit)


def assert_store_error(outcome: Outcome, limit: float) -> None:
    """The call failed as a store failure must: BackendTimeout or BackendUnavailable, with the
    driver's error chained, within ``limit`` seconds."""
    error = outcome.error
    assert error is not None, f"{outcome.name}: returned {outcome.result!r} through the fault"
    assert isinstance(error, BackendTimeout | BackendUnavailable), (
        f"{outcome.name}: {type(error).__name__}: {error}"
    )
    assert isinstance(error, SingletaskError)
    assert error.__cause__ is not None, f"{outcome.name}: no driver error chained: {error!r}"
    assert outcome.elapsed < limit, f"{outcome.name}: took {outcome.elapsed:.1f}s"


def primitives(backend: LockBackend, key: str, token: str) -> dict[str, Callable[[], Any]]:
    """One call of each execution-path primitive on ``key``, held by ``token``."""
    return {
        "acquire": lambda: backend.acquire(f"{key}:other", "token-other", LEASE),
        "extend": lambda: backend.extend(key, token, LEASE),
        "extend_many": lambda: backend.extend_many([(key, token, LEASE)]),
        "release": lambda: backend.release(key, token),
        "holder": lambda: backend.holder(key),
    }


# -- (a) a reply later than the client's timeout ------------------------------------------------


def test_a_reply_later_than_the_timeout_is_an_error_and_the_lease_frees_the_key(
    link: Link, key: str
) -> None:
    """The store acts, its answer comes too late: the caller gets a store error in time, and a
    lock the store took for it ends with its lease (nothing renews it)."""
    # Given a backend connected through a link that delays every reply past its timeout
    assert link.backend.holder(key) is None
    link.proxy.delay_replies(link.bound + 2)

    # When it acquires
    outcome = bounded("acquire", lambda: link.backend.acquire(key, "orphan", SHORT_LEASE), 60)

    # Then it gets a store error within its timeouts
    assert_store_error(outcome, link.bound)

    # And the key is either free or held by the orphan, which its lease frees
    link.proxy.delay_replies(0)
    holder = link.direct.holder(key)
    assert holder is None or holder.token == "orphan"
    assert wait_until_free(link.direct, key, SHORT_LEASE + EXPIRY_SLACK)

    # And the same backend works on (no late reply taken for a new call's)
    taken = bounded("acquire", lambda: link.backend.acquire(key, "next", LEASE), link.bound)
    assert taken.error is None, taken.error
    assert taken.result.acquired
    assert link.backend.holder(key).token == "next"  # type: ignore[union-attr]
    assert link.backend.release(key, "next")


# -- (b) a stalled link -------------------------------------------------------------------------


def test_on_a_stalled_link_every_primitive_fails_in_time(link: Link, key: str) -> None:
    """A server that accepts and never answers (or a black-holed link) costs each call its
    timeouts, never a hang: the renewer, the release in ``finally`` and the pool go on."""
    # Given a lock held through the link
    assert link.backend.acquire(key, "token-a", LEASE).acquired

    # When the link stalls, and each primitive is called (each on a connection of its own)
    link.proxy.stall()
    calls = [start(name, call) for name, call in primitives(link.backend, key, "token-a").items()]

    # Then each fails with a store error within its timeouts
    for outcome in calls:
        assert_store_error(finish(outcome, link.bound + 5), link.bound)

    # And once the link is back, the backend works again
    link.proxy.resume()
    again = bounded("acquire", lambda: link.backend.acquire(f"{key}:after", "t", LEASE), link.bound)
    assert again.error is None, again.error
    assert again.result.acquired
    assert link.backend.release(f"{key}:after", "t")
    link.direct.release(key, "token-a")


# -- (c) cut connections, a server gone and back ------------------------------------------------


def test_after_a_cut_the_next_calls_reconnect(link: Link, key: str) -> None:
    """Cutting every connection costs at most the next call (an error, or a reconnect): the one
    after it works."""
    assert link.backend.acquire(key, "token-a", LEASE).acquired
    for name, call in primitives(link.backend, key, "token-a").items():
        if name == "release":
            continue  # below, last
        link.proxy.cut()
        first = bounded(name, call, link.bound)
        if first.error is not None:
            assert_store_error(first, link.bound)
        second = bounded(name, call, link.bound)
        assert second.error is None, f"{name} after a cut and one call: {second.error!r}"
    link.proxy.cut()
    first = bounded("release", lambda: link.backend.release(key, "token-a"), link.bound)
    if first.error is not None:
        assert_store_error(first, link.bound)
        assert link.backend.release(key, "token-a")
    assert link.direct.holder(key) is None


def test_a_server_gone_is_unavailable_and_back_it_serves_at_once(link: Link, key: str) -> None:
    """Connects refused: BackendUnavailable in time. Back on the same address: the first call
    of each primitive works (the pool kept no dead connection)."""
    assert link.backend.acquire(key, "token-a", LEASE).acquired
    link.proxy.stop()
    for name, call in primitives(link.backend, key, "token-a").items():
        assert_store_error(bounded(name, call, link.bound + 5), link.bound)
    link.proxy.start()
    for name, call in primitives(link.backend, key, "token-a").items():
        outcome = bounded(name, call, link.bound)
        assert outcome.error is None, f"{name} once the server is back: {outcome.error!r}"
    assert link.direct.holder(key) is None  # released by the last call
    assert link.direct.release(f"{key}:other", "token-other")


# -- (d) re-pointed to another server -----------------------------------------------------------


@pytest.fixture
def second_server(link: Link, tmp_path: Path) -> Iterator[str]:
    """Base URL of a second server of the link's kind, of this test's own."""
    assert link.kind in REPOINTABLE, "only the stores of REPOINTABLE have a second server"
    if _base(link.kind) == "redis":
        binary = redis_scripts_binary() if link.kind == "redis-scripts" else None
        binary = binary or redis_server_binary()
        if binary is None:
            unavailable("no redis-server for a second server")
        assert binary is not None
        redis_server = RedisServer(binary, tmp_path / "second")
        redis_server.start()
        try:
            yield f"{redis_server.url}/0"
        finally:
            redis_server.stop()
    else:
        memcached: MemcachedServer | None = None
        try:
            memcached = start_memcached()
        except RuntimeError as exc:
            unavailable(str(exc))
        assert memcached is not None
        try:
            yield memcached.url
        finally:
            memcached.stop()


@pytest.mark.parametrize("link", REPOINTABLE, indirect=True)
def test_a_re_pointed_link_takes_the_next_calls_to_the_new_server(
    link: Link, second_server: str, key: str
) -> None:
    """The address a worker uses moves to another server (a failover behind a fixed name): after
    at most one failed call, its calls reach the new server."""
    assert link.backend.acquire(key, "on-first", LEASE).acquired
    link.proxy.repoint(address_of(second_server), cut=True)
    first = bounded("holder", lambda: link.backend.holder(key), link.bound)
    if first.error is not None:
        assert_store_error(first, link.bound)
    assert link.backend.holder(key) is None  # the new server has no lock
    assert link.backend.acquire(key, "on-second", LEASE).acquired
    second = backend_from_url(second_server)
    try:
        assert second.holder(key).token == "on-second"  # type: ignore[union-attr]
        assert second.release(key, "on-second")
    finally:
        second.close()
    assert link.direct.holder(key).token == "on-first"  # type: ignore[union-attr]
    assert link.direct.release(key, "on-first")


# -- (g) fences under an interleaving -----------------------------------------------------------


def test_fences_grow_when_an_acquire_is_held_up_between_its_steps(link: Link, key: str) -> None:
    """Client A's acquire is held up after its first reply; meanwhile B acquires with a short
    lease that ends; then A's acquire goes on. If both acquired, A holds after B, so A's fence
    must be the larger (on a store that computes it in the atomic step, B cannot get in)."""
    a = link.another(timeout=10.0)
    assert a.holder(key) is None  # connected
    link.proxy.delay_replies(60, after=1)
    pending = start("acquire A", lambda: a.acquire(key, "token-a", LEASE))
    deadline = time.monotonic() + link.bound
    while link.proxy.held_replies == 0 and not pending.done.is_set():
        assert time.monotonic() < deadline, "A's acquire sent nothing more"
        time.sleep(0.01)

    b: Any = None
    with contextlib.suppress(BackendError):  # a SQL row lock A holds may time B out
        b = link.direct.acquire(key, "token-b", SHORT_LEASE)
    if b is not None and b.acquired:
        assert wait_until_free(link.direct, key, SHORT_LEASE + EXPIRY_SLACK)
    link.proxy.delay_replies(0)

    finish(pending, link.bound + 10)
    assert pending.error is None, pending.error
    if b is not None and b.acquired and pending.result.acquired:
        assert pending.result.fence > b.fence, (
            f"A acquired after B's lease ended with fence {pending.result.fence}, "
            f"not above B's {b.fence}"
        )
    if pending.result.acquired:
        assert a.release(key, "token-a")


# -- (e) the longest keys a user writes (every store) ---------------------------------------------


@pytest.mark.parametrize("length", [3_000, 10_000])
def test_a_key_as_long_as_a_user_writes_is_a_lock_like_any_other(
    backend: LockBackend, key_prefix: str, length: int
) -> None:
    """Lock key texts of thousands of characters (a task keyed on a long argument) take, list,
    renew and release; two that differ only in their last character are two locks. (The text
    is random, so that no store can compress it below a size limit.)"""
    letters = string.ascii_letters + string.digits + "éß✓-:|{}"
    noise = "".join(random.Random(length).choices(letters, k=length - len(key_prefix) - 1))
    stem = key_prefix + noise
    first, second = f"{stem}a", f"{stem}b"
    assert len(first) == length

    taken = backend.acquire(first, "token-a", LEASE, meta={"task_id": "task-a"})
    assert taken.acquired
    assert backend.acquire(second, "token-b", LEASE).acquired
    refused = backend.acquire(first, "token-c", LEASE)
    assert not refused.acquired
    assert refused.holder is not None
    assert refused.holder.token == "token-a"
    assert backend.holder(first).token == "token-a"  # type: ignore[union-attr]
    assert backend.holder(second).token == "token-b"  # type: ignore[union-attr]
    assert backend.extend(first, "token-a", LEASE)
    assert backend.extend_many([(first, "token-a", LEASE), (second, "token-b", LEASE)]) == [
        True,
        True,
    ]
    assert backend.claim_next(first, "follow-up", LEASE) == "follow-up"
    assert backend.claim_next(second, "other", LEASE) == "other"
    assert backend.clear_next(first, "follow-up")
    try:
        listed = {name: holder.token for name, holder in backend.iter_locks(key_prefix)}
    except UnsupportedOperation:
        listed = None  # memcached cannot list
    if listed is not None:
        assert listed == {first: "token-a", second: "token-b"}
    assert backend.release(first, "token-a")
    assert backend.holder(first) is None
    assert backend.holder(second).token == "token-b"  # type: ignore[union-attr]
    again = backend.acquire(first, "token-d", LEASE)
    assert again.acquired
    assert again.fence is not None
    assert taken.fence is not None
    assert again.fence > taken.fence
    assert backend.release(first, "token-d")
    assert backend.release(second, "token-b")
    assert backend.clear_next(second, "other")


# -- (f) keys shaped like another lock's companion records (every store) ------------------------


@pytest.mark.parametrize(
    ("base_shape", "twin_shape"),
    [
        ("{p}job", "{key}|fence"),
        ("{p}job", "{key}|next"),
        ("{p}job", "{key}:fence"),
        ("{p}job", "{{{key}}}:fence"),
        ("{{{p}job}}", "{key}:fence"),
    ],
    ids=["pipe-fence", "pipe-next", "colon-fence", "tag-fence", "tagged-key-colon-fence"],
)
def test_a_key_shaped_like_another_locks_companion_is_a_lock_of_its_own(
    backend: LockBackend, key_prefix: str, base_shape: str, twin_shape: str
) -> None:
    """A lock key text (``job|fence``, ``{job}:fence``, ...) never reaches the fence or the
    pending follow-up of the lock ``job``, nor they it. A store may instead refuse, with
    LockKeyError and before it writes anything, a raw key that singletask never builds and that
    could name another lock's companion (Redis: a key ending in ``}:fence``, since singletask
    escapes every ``}`` of a key's text)."""
    base = base_shape.format(p=key_prefix)
    twin = twin_shape.format(key=base)
    # Given the lock `base`, with a fence and a pending follow-up
    first = backend.acquire(base, "base-1", LEASE)
    assert first.acquired
    assert first.fence is not None
    assert backend.claim_next(base, "follow-1", LEASE) == "follow-1"

    # When the twin key is taken as a lock, with a follow-up of its own
    assert backend.holder(twin) is None
    try:
        twin_first = backend.acquire(twin, "twin-1", LEASE)
    except LockKeyError:
        # (refused) then nothing of `base` changed
        assert not twin.endswith(("|fence", "|next")), "memcached-shaped keys are never refused"
        assert backend.claim_next(base, "follow-2", LEASE) == "follow-1"
        assert backend.clear_next(base, "follow-1")
        assert backend.holder(base).token == "base-1"  # type: ignore[union-attr]
        assert backend.release(base, "base-1")
        return
    assert twin_first.acquired
    assert twin_first.fence is not None
    assert backend.claim_next(twin, "twin-follow", LEASE) == "twin-follow"

    # Then `base` keeps its follow-up, and its next fence is still larger
    assert backend.claim_next(base, "follow-2", LEASE) == "follow-1"
    assert backend.release(base, "base-1")
    second = backend.acquire(base, "base-2", LEASE)
    assert second.acquired
    assert second.fence is not None
    assert second.fence > first.fence
    # And the twin kept its holder, its follow-up and its own growing fences
    assert backend.holder(twin).token == "twin-1"  # type: ignore[union-attr]
    assert backend.claim_next(twin, "twin-follow-2", LEASE) == "twin-follow"
    assert backend.release(twin, "twin-1")
    twin_second = backend.acquire(twin, "twin-2", LEASE)
    assert twin_second.acquired
    assert twin_second.fence is not None
    assert twin_second.fence > twin_first.fence
    assert backend.holder(base).token == "base-2"  # type: ignore[union-attr]

    assert backend.clear_next(base, "follow-1")
    assert backend.clear_next(twin, "twin-follow")
    assert backend.release(base, "base-2")
    assert backend.release(twin, "twin-2")
