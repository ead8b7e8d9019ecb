"""docs/configuration.rst is the one reference of the settings and task options, and it agrees
with the code that validates them.

The reference has two tables: "App settings" (setting, default, meaning) and "Task options"
(option, default, values, app setting used when ``None``). In a default cell, the first inline
literal is the default (a Python literal, compared with the code's value); what follows it
explains it. The code's side is :data:`singletask.conf.settings.DEFAULTS` for the settings and the
``lock_*`` class attributes of :class:`~singletask.SingletonTask` for the task options.

So a setting or option added, renamed or removed in the code, or a changed default, fails here
until the reference says the same. Other pages may mention a default in passing ("``lock_ttl``,
30 seconds by default"); such a mention must give the reference's value.

Beyond the settings, every default or limit the other facts pages give (a store's timeouts and
leases, retentions, the backoff, the drift margin...) is written below as the sentence its one
home page says, built from the code's constant, and some facts are checked to be stated on
their home page only.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from singletask import SingletonTask
from singletask.conf.settings import DEFAULTS, MAX_COUNT, MAX_SECONDS

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "configuration.rst"

LITERAL = re.compile(r"``(.+?)``")


def list_tables(text: str) -> list[list[list[str]]]:
    """Every ``.. list-table::`` of an rST text, as rows of cells (whitespace collapsed)."""
    tables = []
    for match in re.finditer(r"^\.\. list-table::.*\n((?:[ \t]+.*\n|\n)+)", text, flags=re.M):
        rows: list[list[str]] = []
        for line in match.group(1).splitlines():
            if line.startswith("   * - "):
                rows.append([line[len("   * - ") :]])
            elif line.startswith("     - "):
                rows[-1].append(line[len("     - ") :])
            elif rows and line.strip():
                rows[-1][-1] += " " + line.strip()
        tables.append([[" ".join(cell.split()) for cell in row] for row in rows])
    return tables


def reference_table(first_header: str) -> dict[str, dict[str, str]]:
    """The reference's table whose first column is ``first_header``: {name: {column: cell}}."""
    for header, *rows in list_tables(REFERENCE.read_text()):
        if header[0] == first_header:
            for row in rows:
                assert len(row) == len(header), (
                    f"{REFERENCE.name}: a row of {len(row)} cells: {row}"
                )
            return {_literal(row[0]): dict(zip(header, row, strict=True)) for row in rows}
    raise AssertionError(f"{REFERENCE.name} has no table whose first column is {first_header!r}")


def _literal(cell: str) -> str:
    found = LITERAL.search(cell)
    assert found, f"no ``literal`` in the cell {cell!r}"
    return found.group(1)


def documented_default(cell: str) -> object:
    """The value of a default cell: its first inline literal, read as a Python literal."""
    return ast.literal_eval(_literal(cell))


def same_value(documented: object, actual: object) -> bool:
    """Equal, and of the same kind: ``30`` documents ``30.0``, but ``1`` does not document
    ``True`` nor ``"30"`` ``30``."""
    numbers = (int, float)
    if isinstance(documented, bool) or isinstance(actual, bool):
        return documented is actual
    if isinstance(documented, numbers) and isinstance(actual, numbers):
        return documented == actual
    return type(documented) is type(actual) and documented == actual


SETTINGS = reference_table("setting")
OPTIONS = reference_table("option")
#: The task options: the ``lock_*`` class attributes that SingletonTask declares.
CODE_OPTIONS = sorted(name for name in SingletonTask.__annotations__ if name.startswith("lock_"))


def differences(code: Iterable[str], reference: Iterable[str]) -> str:
    """What only the code has and what only the reference has, as a message."""
    only_code, only_reference = (
        sorted(set(code) - set(reference)),
        sorted(set(reference) - set(code)),
    )
    return f"in the code only: {only_code}; in the reference only: {only_reference}"


def test_the_reference_lists_every_setting_of_the_code_and_no_other():
    assert set(SETTINGS) == set(DEFAULTS), differences(DEFAULTS, SETTINGS)


@pytest.mark.parametrize("setting", sorted(DEFAULTS))
def test_the_documented_default_of_each_setting_is_the_codes(setting):
    if setting not in SETTINGS:
        pytest.fail(f"{setting} is not in the reference")
    documented = documented_default(SETTINGS[setting]["default"])
    assert same_value(documented, DEFAULTS[setting]), (
        f"{REFERENCE.name} gives {setting} the default {documented!r}; the code has "
        f"{DEFAULTS[setting]!r}"
    )


def test_the_reference_lists_every_task_option_of_the_code_and_no_other():
    assert CODE_OPTIONS, "SingletonTask declares no lock_* attribute: the scan is broken"
    assert set(OPTIONS) == set(CODE_OPTIONS), differences(CODE_OPTIONS, OPTIONS)


@pytest.mark.parametrize("option", CODE_OPTIONS)
def test_the_documented_default_of_each_task_option_is_the_codes(option):
    if option not in OPTIONS:
        pytest.fail(f"{option} is not in the reference")
    documented = documented_default(OPTIONS[option]["default"])
    assert same_value(documented, getattr(SingletonTask, option))


@pytest.mark.parametrize("option", CODE_OPTIONS)
def test_a_task_option_names_the_app_setting_it_falls_back_to_exactly_when_there_is_one(option):
    if option not in OPTIONS:
        pytest.fail(f"{option} is not in the reference")
    cell = OPTIONS[option]["app setting used when ``None``"]
    setting = f"singletask_{option}"
    if setting in DEFAULTS:
        assert _literal(cell) == setting
    else:
        assert "singletask_" not in cell, (
            f"{option} has no app setting, but the reference names one"
        )


def test_the_documented_bounds_are_the_validators():
    text = " ".join(REFERENCE.read_text().split())
    assert f"{MAX_SECONDS:,} seconds ({MAX_SECONDS // 86400} days)" in text
    assert f"at most **{MAX_COUNT}**" in text
    for option, row in OPTIONS.items():
        values = row["values"]
        if values.startswith("seconds"):
            assert f"at most {MAX_SECONDS // 86400} days" in values, option
        if values.startswith("a whole number"):
            assert f"from 0 to {MAX_COUNT}" in values, option


# -- defaults mentioned in passing on other pages -------------------------------------------

#: The pages a user reads besides the reference. (CHANGELOG.md is left out: an entry may give a
#: default a version had.) The API page renders SingletonTask's docstring, so it is one too.
PAGES = {
    "README.md": (ROOT / "README.md").read_text(),
    **{
        f"docs/{page.name}": page.read_text()
        for page in sorted((ROOT / "docs").glob("*.rst"))
        if page != REFERENCE
    },
    "SingletonTask docstring (docs/api.rst)": SingletonTask.__doc__ or "",
}

#: A setting or option, in rST or Markdown literal quotes, and the words that follow it up to
#: the next literal or the end of the sentence.
MENTION = re.compile(r"`{1,2}(?:singletask_)?(lock_\w+)`{1,2}((?:[^`.;]|\.(?=\d))*)")
#: A number given as a default in those words: "default 30", "default, 30" or "30 s by default".
DEFAULT_NUMBER = re.compile(
    r"\bdefault:?,? (\d[\d,]*(?:\.\d+)?)|(?<![\w.])(\d[\d,]*(?:\.\d+)?) ?(?:s|seconds)? by default"
)


def numeric_default(name: str) -> float | None:
    value = DEFAULTS.get(f"singletask_{name}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def passing_mentions() -> list[tuple[str, str, str, float]]:
    """(page, name, words, number) for each "``name`` ... N by default" on the pages."""
    found = []
    for page, text in PAGES.items():
        for match in MENTION.finditer(" ".join(text.split())):
            name, words = match.groups()
            number = DEFAULT_NUMBER.search(words)
            if number and numeric_default(name) is not None:
                digits = (number.group(1) or number.group(2)).replace(",", "")
                found.append((page, name, words.strip(), float(digits)))
    return found


def test_the_scan_of_other_pages_finds_the_mentions_it_is_meant_for():
    names = {name for _, name, _, _ in passing_mentions()}
    assert "lock_ttl" in names, "no page says lock_ttl's default in passing: is the scan broken?"


def test_other_pages_mention_only_the_documented_defaults():
    wrong = [
        f"{page}: ``{name}`` {words!r} (the default is {numeric_default(name):g})"
        for page, name, words, number in passing_mentions()
        if number != numeric_default(name)
    ]
    assert not wrong, "\n".join(wrong)


# -- every number the facts pages give for a default or a limit -----------------------------
#
# Each fact lives on one page (its home). Below, each is written once as the sentence its home
# page says, built from the code's value; the sentence must be on that page, word for word (in
# whitespace-collapsed text). So a changed constant fails here until its page says the new
# value, and a page that drops or rewords a fact fails until this list follows. A few values
# are literals inside a function rather than named constants: for those, the function's
# source must contain the expression the page describes.


def _fact_sentences() -> list[tuple[str, str]]:
    """(page, sentence) for every default or limit the facts pages give."""
    import inspect

    from singletask import policies
    from singletask.backends import memory, urls
    from singletask.backends.django import DjangoCacheBackend
    from singletask.backends.holders import MAX_LEASE
    from singletask.backends.memcached import items
    from singletask.backends.memcached.store import MemcachedBackend
    from singletask.backends.redis import store as redis_store
    from singletask.backends.redis.options import MAX_RETENTION, ReplicaWait
    from singletask.backends.sql import core
    from singletask.backends.sql.mysql import MySQLBackend
    from singletask.backends.sql.mysql import queries as mysql_queries
    from singletask.backends.sql.postgres import PostgresBackend
    from singletask.backends.sql.postgres import queries as postgres_queries
    from singletask.backends.sql.sqlite import store as sqlite
    from singletask.conf.settings import MIN_RATE_INTERVAL
    from singletask.execution import outcomes
    from singletask.execution.acquire import RATE_WAIT
    from singletask.lease import DRIFT_FACTOR, DRIFT_MIN, IDLE_EXIT, RETRY_INTERVAL, drift_margin
    from singletask.protocol.slots import MAX_LIMIT

    def days(seconds: float) -> str:
        return f"{seconds / 86400:g} days"

    def default(function: object, name: str) -> object:
        return inspect.signature(function).parameters[name].default  # type: ignore[arg-type]

    # The store-error backoff: 2**n seconds times a jitter factor, capped. The page gives the
    # retries below the cap (jittered) and the capped ones (not jittered), and the total.
    cap, retries = outcomes.BACKEND_RETRY_CAP, DEFAULTS["singletask_lock_backend_retry_max"]
    low, high = 1.0, 1.25
    steps = [2.0**n for n in range(retries)]
    assert all(s * high <= cap or s >= cap for s in steps), "a retry is capped only sometimes"
    jittered = [s for s in steps if s * high <= cap]
    total = (sum(min(cap, s * low) for s in steps), sum(min(cap, s * high) for s in steps))
    words = {10: "ten"}
    ttl = DEFAULTS["singletask_lock_ttl"]
    assert DjangoCacheBackend.max_lease == MemcachedBackend.max_lease
    # The longest part of a SQL table name, from the pattern that checks it.
    table_part = int(re.search(r"\{0,(\d+)\}", urls.TABLE_NAME.pattern).group(1)) + 1  # type: ignore[union-attr]

    return [
        # configuration.rst: bounds of every duration and count, the stores' leases, backoff
        (
            "configuration.rst",
            f"a lease above its ``max_lease`` ({days(MAX_LEASE)}; "
            f"{MemcachedBackend.max_lease:,.0f} seconds on ``memcached://`` and ``django://``, "
            "whose items cannot be kept longer than 30 days)",
        ),
        (
            "configuration.rst",
            f"(at most {MemcachedBackend.max_lease:.0f}s); use a shorter lease",
        ),
        (
            "configuration.rst",
            "countdown of "
            + ", ".join(f"{s:g}" for s in jittered[:-1])
            + f" and {jittered[-1]:g} seconds, each multiplied by a random factor between "
            f"{low:g} and {high:g}, then {cap:g} seconds (``BACKEND_RETRY_CAP``, no jitter) "
            "for every further retry",
        ),
        (
            "configuration.rst",
            f"With the defaults, {words[retries]} retries wait {total[0]:g} to {total[1]:g} "
            "seconds in all",
        ),
        (
            "configuration.rst",
            'Delay before a lock retry of the ``"retry"`` policy, plus up to 25 % jitter',
        ),
        ("configuration.rst", f"a count of holders from 1 to {MAX_LIMIT}"),
        (
            "configuration.rst",
            f"spacing starts by {MIN_RATE_INTERVAL * 1000:g} ms to {days(MAX_SECONDS)}",
        ),
        (
            "limits.rst",
            f"must be from {MIN_RATE_INTERVAL * 1000:g} millisecond to {days(MAX_SECONDS)}",
        ),
        (
            "limits.rst",
            f"an execution that finds the start allowed within {RATE_WAIT:g} s waits for it",
        ),
        (
            "configuration.rst",
            f"lower-case letters, digits and ``_``, at most {table_part} per part",
        ),
        # deployments.rst: the replica wait
        (
            "deployments.rst",
            f"seconds to wait for them (default {ReplicaWait.DEFAULT_TIMEOUT:g})",
        ),
        # guarantees.rst: the holder's drift margin and how long tokens are kept
        (
            "guarantees.rst",
            f"a drift margin is taken off: ``lock_ttl * {DRIFT_FACTOR:.0%} + "
            f"{DRIFT_MIN * 1000:g} ms``",
        ),
        (
            "guarantees.rst",
            f"{drift_margin(ttl):g} s of the default {ttl:g} s lease",
        ),
        (
            "guarantees.rst",
            f"token is kept {days(memory.FENCE_RETENTION)} after the key's last acquisition",
        ),
        (
            "guarantees.rst",
            f"the row keeps the last token for {days(core.FENCE_RETENTION)} after its last lease",
        ),
        # lifecycle.rst: the renewer
        (
            "lifecycle.rst",
            f"nothing to renew for {IDLE_EXIT:g} seconds (a third of the shortest lease, if less)",
        ),
        (
            "lifecycle.rst",
            "tried again every second (or every third of the lease, if that is shorter)"
            if RETRY_INTERVAL == 1.0
            else f"tried again every {RETRY_INTERVAL:g} seconds",
        ),
        (
            "lifecycle.rst",
            f"every third of the shortest lease it holds ({ttl / 3:g} s by default)",
        ),
        # store-redis.rst: the client's defaults and what a released key keeps
        (
            "store-redis.rst",
            f"``socket_timeout={redis_store.CLIENT_DEFAULTS['socket_timeout']:g}`` and "
            f"``socket_connect_timeout={redis_store.CLIENT_DEFAULTS['socket_connect_timeout']:g}``",
        ),
        (
            "store-redis.rst",
            f"``health_check_interval={redis_store.CLIENT_DEFAULTS['health_check_interval']}``",
        ),
        ("store-redis.rst", "two retries with exponential backoff (from 50 ms, at most 1 s)"),
        (
            "store-redis.rst",
            f"0 (nothing is kept) or from 1 to {MAX_RETENTION:,.0f} ({days(MAX_RETENTION)})",
        ),
        (
            "store-redis.rst",
            f"``fence_retention`` {redis_store.FENCE_RETENTION:g}: nothing",
        ),
        (
            "store-redis.rst",
            f"``marker_retention`` {redis_store.MARKER_RETENTION:,.0f}: one day",
        ),
        # store-sql.rst: options, retention, reclaiming, long keys, SQLite
        ("store-sql.rst", f"``pool_size`` (default {default(PostgresBackend, 'pool_size')})"),
        ("store-sql.rst", f"``timeout`` (default {default(PostgresBackend, 'timeout'):g} seconds)"),
        (
            "store-sql.rst",
            "``prepare_threshold`` (PostgreSQL only, default "
            f"{default(PostgresBackend, 'prepare_threshold')})",
        ),
        (
            "store-sql.rst",
            f"at least {days(core.FENCE_RETENTION)} after its last lease (``FENCE_RETENTION``)",
        ),
        (
            "store-sql.rst",
            f"at most once a minute, deletes up to {core.RECLAIM_BATCH:,} rows",
        ),
        (
            "store-sql.rst",
            f"A key longer than {postgres_queries.KEY_BYTES:,} UTF-8 bytes (PostgreSQL) or "
            f"{mysql_queries.KEY_BYTES} bytes (MySQL)",
        ),
        (
            "store-sql.rst",
            f"a process waits up to {default(sqlite.SQLiteBackend, 'timeout'):g} seconds for "
            "another process's transaction",
        ),
        (
            "store-sql.rst",
            f"rows untouched for {days(sqlite.FENCE_RETENTION)} when it opens its connection",
        ),
        # store-memcached.rst: timeouts, expiries and the 30-day limit
        (
            "store-memcached.rst",
            f"``timeout`` and ``connect_timeout`` (seconds, "
            f"{items.CLIENT_DEFAULTS['timeout']:g} by default)",
        ),
        (
            "store-memcached.rst",
            f"It gets ``ceil(lease) + {items.EXPIRY_SLACK}`` seconds: a lease lasts at least the "
            f"time asked for and less than {items.EXPIRY_SLACK + 1} seconds longer",
        ),
        (
            "store-memcached.rst",
            f"{days(items.RECORD_RETENTION)} for a free record, "
            f"{days(items.FENCE_EXPIRY)} for a fence counter",
        ),
        (
            "store-memcached.rst",
            f"an expiry above {days(items.MAX_RELATIVE_EXPIRY)} ({items.MAX_RELATIVE_EXPIRY:,} s)",
        ),
        (
            "store-memcached.rst",
            f"{MemcachedBackend.max_lease:,.0f} s (30 days less the "
            f"{ {1: 'second', 2: 'two seconds'}[items.EXPIRY_SLACK] } an item is kept longer)",
        ),
        # store-custom.rst: the memory store
        (
            "store-custom.rst",
            f"{days(memory.FENCE_RETENTION)} after a key's last acquisition",
        ),
        # literals inside functions, which the pages above describe
        ("source:" + inspect.getsource(outcomes.store_unreachable), "random.uniform(1.0, 1.25)"),
        (
            "source:" + inspect.getsource(policies.Conflict.countdown),
            "base + random.uniform(0, base / 4)",
        ),
        (
            "source:" + inspect.getsource(redis_store.RedisBackend.client.fget),
            "ExponentialBackoff(cap=1.0, base=0.05)",
        ),
        ("source:" + inspect.getsource(items.expiry), "math.ceil(check_lease(seconds"),
        ("source:" + inspect.getsource(MySQLBackend.__init__), "timeout: float = 5.0"),
    ]


FACTS = _fact_sentences()


@pytest.mark.parametrize(("page", "sentence"), FACTS, ids=[f"{p[:40]}: {s[:50]}" for p, s in FACTS])
def test_each_default_or_limit_is_given_on_its_home_page_with_the_codes_value(page, sentence):
    if page.startswith("source:"):
        assert sentence in page, f"the code no longer has {sentence!r}: update the page"
        return
    text = " ".join((ROOT / "docs" / page).read_text().split())
    assert sentence in text, f"docs/{page} does not say {sentence!r} (the code's value)"


#: A fact with one home: a pattern that states it, and the one page allowed to state it.
#: Other pages link to the home instead.
ONE_HOME = {
    r"\d+ bytes of Redis memory|bytes (of Redis memory )?per (held )?lock": "performance.rst",
    r"ten retries wait": "configuration.rst",
    r"``socket_timeout=\d": "store-redis.rst",
    r"(less than|up to about) \d seconds? (more|longer)": "store-memcached.rst",
    r"deletes up to [\d,]+ rows": "store-sql.rst",
}


@pytest.mark.parametrize("pattern", sorted(ONE_HOME))
def test_a_fact_with_a_home_is_stated_on_that_page_only(pattern):
    home = ONE_HOME[pattern]
    found = [
        page.name
        for page in sorted((ROOT / "docs").glob("*.rst"))
        if re.search(pattern, " ".join(page.read_text().split()))
    ]
    assert found == [home], f"{pattern!r} is stated on {found}; only {home} should, others link"
