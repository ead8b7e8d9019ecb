"""The operator surfaces under hostile data: the lock page, the exporter and ``singletask
locks``, on real servers.

* a secret query option of the store's URL (libpq's ``sslpassword``, however its name is
  spelled) never shows: not in the page's JSON, not on the start lines of ``singletask web`` and
  ``singletask exporter``, not in a log line;
* a stalled store answers each of ten concurrent page requests with its 503 within about the
  store's timeout, not one timeout after the other;
* a key or a field that is not UTF-8 (another application's, or one written under the prefix)
  fails no listing: it is shown with backslash escapes (``\\xff``);
* a named limit whose name, task id and task name hold markup, quotes and such escapes is
  listed as it is: in the page's JSON, by ``singletask locks --limits``, as a label value of
  the exporter (its task id never a label).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend, Units
from singletask.cli import singletask
from singletask.exceptions import ConfigurationError
from singletask.ops.exporter import StoreCollector
from singletask.ops.web import LockPage
from singletask.ops.web.server import make_server
from singletask.protocol.limits import limit_key
from singletask.protocol.tokens import execution_token

from ..faultproxy import FaultProxy
from ..prometheus_text import samples_of, value
from ..servers import SQL_URLS, free_port, sql_problem, sql_test_table, unavailable
from .web.helpers import call

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-Zq81xT"
#: A database of the session's private Redis no other test module uses (the exporter's
#: broker in the start line test).
BROKER_DB = 13


def postgres_url(option: str) -> str:
    """The test PostgreSQL server's URL with the secret as libpq option ``option``."""
    problem = sql_problem("postgresql")
    if problem:
        unavailable(problem)
    base = SQL_URLS["postgresql"]
    return f"{base}{'&' if '?' in base else '?'}{option}={SECRET}&sslmode=disable"


def started(args: list[str], marker: str) -> tuple[subprocess.Popen[str], str]:
    """``python -m singletask ARGS`` in a subprocess, and its standard error up to the line
    holding ``marker`` (the start line)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "singletask", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stderr is not None
    lines = []
    for line in process.stderr:
        lines.append(line)
        if marker in line:
            return process, "".join(lines)
    process.wait(10)
    raise AssertionError(f"{args[0]} did not start:\n" + "".join(lines))


def stop(process: subprocess.Popen[str]) -> str:
    process.terminate()
    return process.communicate(timeout=30)[1]


# -- secrets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["sslpassword", "ssl%70assword"])
def test_a_secret_option_of_the_url_is_masked_in_the_page_and_its_logs(
    option: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever the spelling of the option's name (libpq decodes it), the page's JSON names the
    store with its value masked; a store that fails names it masked in the 503 and in the log."""
    caplog.set_level(logging.DEBUG)
    url = postgres_url(option)
    page = LockPage(url)
    try:
        answer = call(page, "GET", "/api/locks")
    finally:
        page.close()
    assert answer.status == 200, answer.body
    assert answer.json()["store"].endswith(f"{option}=**&sslmode=disable")
    assert SECRET not in answer.body.decode()
    dead = url.replace(":5432/", f":{free_port()}/")
    page = LockPage(dead)
    try:
        answer = call(page, "GET", "/api/locks")
    finally:
        page.close()
    assert answer.status == 503
    assert SECRET not in answer.body.decode()
    assert answer.json()["store"].endswith(f"{option}=**&sslmode=disable")
    collector = StoreCollector(backend_from_url(dead), "singletask:", interval=5)
    try:
        collector.read()
    finally:
        collector.backend.close()
    assert any("reading the lock store failed" in r.getMessage() for r in caplog.records)
    assert all(SECRET not in r.getMessage() for r in caplog.records)


def test_a_secret_option_libpq_refuses_is_masked_in_the_error() -> None:
    """libpq's names are lower case: ``SSLPASSWORD`` is refused, and the error (with its
    causes) does not show its value either."""
    with pytest.raises(ConfigurationError) as refused:
        LockPage(postgres_url("SSLPASSWORD"))
    assert SECRET not in "".join(traceback.format_exception(refused.value))


def test_the_start_lines_of_web_and_exporter_mask_the_secret_option(redis_base_url: str) -> None:
    url = postgres_url("sslpassword")
    process, head = started(["web", "--port", "0", "--url", url], " at http://")
    try:
        address = head.rsplit(" at ", 1)[1].split()[0]
        with urllib.request.urlopen(address + "api/locks", timeout=30) as answer:
            body = answer.read().decode()
        assert json.loads(body)["store"].endswith("sslpassword=**&sslmode=disable")
    finally:
        rest = stop(process)
    assert "sslpassword=**" in head
    assert SECRET not in head + body + rest
    broker = f"{redis_base_url}/{BROKER_DB}"
    args = ["exporter", "--port", "0", "--broker", broker, "--url", url]
    process, head = started(args, "/metrics")
    rest = stop(process)
    assert "sslpassword=**" in head
    assert SECRET not in head + rest


# -- a stalled store --------------------------------------------------------------------------

#: The store's socket timeout in the stalled store test.
TIMEOUT = 2.0


def test_a_stalled_store_answers_each_concurrent_request_within_its_timeout(
    redis_base_url: str,
) -> None:
    """Ten requests at once on a store that answers nothing: each gets its 503 after about one
    store timeout (all within 3x), rather than the tenth after ten of them."""
    target = f"{redis_base_url}/0?socket_timeout={TIMEOUT}&socket_connect_timeout={TIMEOUT}"
    with FaultProxy.for_url(target)[0] as proxy:
        page = LockPage(proxy.url_for(target))
        server = make_server(page, "127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        address = f"http://127.0.0.1:{server.server_address[1]}/api/locks"
        try:
            with urllib.request.urlopen(address, timeout=30) as answer:
                assert answer.status == 200  # the store answers: the client is made
            proxy.stall()
            results: list[tuple[int, float]] = []

            def ask() -> None:
                begun = time.monotonic()
                try:
                    urllib.request.urlopen(address, timeout=60).close()
                    status = 200
                except urllib.error.HTTPError as exc:
                    status = exc.code
                    exc.close()
                results.append((status, time.monotonic() - begun))

            askers = [threading.Thread(target=ask) for _ in range(10)]
            for asker in askers:
                asker.start()
            for asker in askers:
                asker.join(120)
        finally:
            server.shutdown()
            server.server_close()
            proxy.resume()
            page.close()
    assert [status for status, _ in results] == [503] * 10
    slowest = max(seconds for _, seconds in results)
    assert slowest < 3 * TIMEOUT, sorted(seconds for _, seconds in results)


# -- names and fields that are not UTF-8 ------------------------------------------------------


@pytest.fixture
def hostile_redis(redis_url: str, key_prefix: str) -> Iterator[tuple[str, str, str]]:
    """The private Redis holding, beside one lock of ``key_prefix``: another application's key
    whose name holds the prefix and is not UTF-8, a lock hash under the prefix whose name is not
    UTF-8, and a field that is not UTF-8 in the real lock. Yields the URL, the prefix, and how
    the page shows the name that is not UTF-8."""
    client = redis.Redis.from_url(redis_url)
    backend = backend_from_url(redis_url)
    key = f"{key_prefix}proj.sync:1"
    task_id = str(uuid.uuid4())
    meta = {"task_id": task_id, "task": "proj.sync", "since": f"{time.time():.3f}"}
    assert backend.acquire(key, execution_token(task_id, 0), 60, meta=meta).acquired
    prefix = key_prefix.encode()
    foreign = b"other:" + prefix + b"\xff\xfe"
    odd = prefix + b"proj.sync:\xff"
    client.set(foreign, b"\xff", ex=60)
    client.hset(odd, mapping={b"token": b"tok\xfe", b"_note\xff": b"\xff"})
    client.expire(odd, 60)
    # (the real lock is a plain lock: one string record, its fields NUL-separated)
    client.set(key, client.get(key) + b"\0_extra\xff\0\xfe", keepttl=True)
    try:
        yield redis_url, key_prefix, f"{key_prefix}proj.sync:\\xff"
    finally:
        client.delete(foreign, odd, key)
        client.close()
        backend.close()


def test_a_name_or_field_that_is_not_utf8_is_shown_escaped_on_the_page(
    hostile_redis: tuple[str, str, str],
) -> None:
    url, prefix, escaped = hostile_redis
    page = LockPage(url, prefix=prefix)
    try:
        answer = call(page, "GET", "/api/locks")
        one = call(page, "GET", f"/api/lock?key={prefix}proj.sync:1")
    finally:
        page.close()
    assert answer.status == 200, answer.body
    locks = {lock["key"]: lock for lock in answer.json()["locks"]}
    assert set(locks) == {f"{prefix}proj.sync:1", escaped}
    assert locks[escaped]["token"] == "tok\\xfe"
    assert answer.json()["state"] == []
    assert one.status == 200, one.body
    assert [holder["task"] for holder in one.json()["holders"]] == ["proj.sync"]


def test_a_name_or_field_that_is_not_utf8_leaves_the_exporter_up(
    hostile_redis: tuple[str, str, str],
) -> None:
    url, prefix, _ = hostile_redis
    backend = backend_from_url(url)
    registry = CollectorRegistry()
    collector = StoreCollector(backend, prefix, interval=5)
    registry.register(collector)
    try:
        collector.read()
    finally:
        backend.close()
    samples = samples_of(generate_latest(registry).decode())
    assert value(samples, "singletask_store_up") == 1
    # the lock hash whose name is not UTF-8 is named as a lock of proj.sync: counted too
    assert value(samples, "singletask_locks_held", task="proj.sync") == 2


def test_a_name_or_field_that_is_not_utf8_is_listed_escaped_by_singletask_locks(
    hostile_redis: tuple[str, str, str],
) -> None:
    url, prefix, escaped = hostile_redis
    runner = CliRunner()
    for args in ([], ["--json"]):
        done = runner.invoke(singletask, ["locks", "--url", url, "--prefix", prefix, *args])
        assert done.exit_code == 0, done.output
        assert f"{prefix}proj.sync:1" in done.output
        shown = json.dumps(escaped)[1:-1] if args else escaped
        assert shown in done.output


def test_mysql_rows_whose_key_is_not_utf8_are_listed_escaped_page_after_page(
    key_prefix: str,
) -> None:
    """Rows another program wrote into the lock table (its key is VARBINARY), at page
    boundaries: each listed once, escaped, and the listing goes on past them."""
    import pymysql

    with sql_test_table("mysql") as table:
        url = SQL_URLS["mysql"]
        backend = backend_from_url(url, table=table)
        try:
            key = f"{key_prefix}proj.sync:a"
            task_id = str(uuid.uuid4())
            token = execution_token(task_id, 0)
            assert backend.acquire(key, token, 60, meta={"task": "proj.sync"}).acquired
            parts = urlsplit(url)
            connection = pymysql.connect(
                host=parts.hostname, port=parts.port or 3306, user=parts.username or "root",
                password=parts.password or "", database=parts.path.lstrip("/"),
            )  # fmt: skip
            with contextlib.closing(connection), connection.cursor() as cursor:
                for tail in (b"\xfe", b"\xff"):
                    cursor.execute(
                        f"INSERT INTO {table} (`key`, token, lease_expires, fence, expires_at) "
                        "VALUES (%s, %s, UTC_TIMESTAMP(6) + INTERVAL 60 SECOND, 1, "
                        "UTC_TIMESTAMP(6) + INTERVAL 60 SECOND)",
                        (key_prefix.encode() + b"proj.sync:" + tail, b"tok" + tail),
                    )
                connection.commit()
            listed = [
                (name, held.token) for name, held in backend.iter_locks(key_prefix, page_size=1)
            ]
            state = list(backend.iter_state(key_prefix, page_size=1))
        finally:
            backend.close()
    assert listed == [
        (key, token),
        (f"{key_prefix}proj.sync:\\xfe", "tok\\xfe"),
        (f"{key_prefix}proj.sync:\\xff", "tok\\xff"),
    ]
    assert state == []


@pytest.mark.parametrize("reader", ["the writing process", "a read-only process"])
def test_sqlite_rows_whose_key_is_not_utf8_are_listed_escaped_page_after_page(
    key_prefix: str, tmp_path: Path, reader: str
) -> None:
    """Text another program wrote into the database file (SQLite stores what it is given): each
    row listed once, escaped, page after page, its records too; the listing never fails."""
    import sqlite3

    path = tmp_path / "locks.db"
    url = f"sqlite:///{path}"
    key = f"{key_prefix}proj.sync:a"
    token = execution_token(str(uuid.uuid4()), 0)
    writer = backend_from_url(url)
    try:
        assert writer.acquire(key, token, 60, meta={"task": "proj.sync"}).acquired
        with contextlib.closing(sqlite3.connect(path)) as other:
            later = time.time() + 60
            for tail in (b"\xfe", b"\xff"):
                name = key_prefix.encode() + b"proj.sync:" + tail
                other.execute(
                    "INSERT INTO singletask_locks (key, token, expires_at, meta, fence) "
                    "VALUES (CAST(? AS TEXT), CAST(? AS TEXT), ?, '{}', 1)",
                    (name, b"tok" + tail, later),
                )
                other.execute(
                    "INSERT INTO singletask_debounce (key, latest, opened, until) "
                    "VALUES (CAST(? AS TEXT), CAST(? AS TEXT), ?, ?)",
                    (name, b"send" + tail, time.time(), later),
                )
            other.commit()
        backend = writer if reader == "the writing process" else backend_from_url(url)
        listed = [(name, held.token) for name, held in backend.iter_locks(key_prefix, page_size=1)]
        windows = [(s.key, s.task_id) for s in backend.iter_state(key_prefix, page_size=1)]
    finally:
        writer.close()
    assert listed == [
        (key, token),
        (f"{key_prefix}proj.sync:\\xfe", "tok\\xfe"),
        (f"{key_prefix}proj.sync:\\xff", "tok\\xff"),
    ]
    assert windows == [
        (f"{key_prefix}proj.sync:\\xfe", "send\\xfe"),
        (f"{key_prefix}proj.sync:\\xff", "send\\xff"),
    ]


# -- a named limit whose name and holder are hostile ------------------------------------------

#: A limit name, task id and task name with markup, quotes, a backslash escape as a store shows a
#: byte that is not UTF-8, and the characters of the exposition format's labels.
HOSTILE = '<script>x()</script>"\'><img src=x onerror=y()>\\xff {a="b",c} %rate:'


@pytest.fixture
def hostile_limit(limits_store: tuple[str, LockBackend], key_prefix: str) -> tuple[str, str]:
    """A store holding units of the limit named :data:`HOSTILE` for a task id and task name
    :data:`HOSTILE`, beside a lock; yields the store's URL and the prefix."""
    url, backend = limits_store
    units = Units(limit_key(key_prefix, HOSTILE), 4, 1)
    token = execution_token(HOSTILE, 0)
    assert backend.take_units(token, 60, [units], meta={"task_id": HOSTILE, "task": HOSTILE}).taken
    meta = {"task_id": "id-1", "task": "proj.sync", "since": f"{time.time():.3f}"}
    assert backend.acquire(f"{key_prefix}proj.sync:1", execution_token("id-1", 0), 60,
                           meta=meta).acquired  # fmt: skip
    return url, key_prefix


def test_a_hostile_limit_is_listed_as_it_is_in_the_page_s_json(
    hostile_limit: tuple[str, str],
) -> None:
    """JSON, served as such (never sniffed as HTML); the page's script shows it as text
    (tests/visibility/test_web_limits.py)."""
    url, prefix = hostile_limit
    page = LockPage(url, prefix=prefix)
    try:
        answer = call(page, "GET", "/api/locks")
    finally:
        page.close()
    assert answer.status == 200, answer.body
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["x-content-type-options"] == "nosniff"
    [limit] = answer.json()["limits"]
    assert (limit["name"], limit["kind"], limit["key"]) == (
        HOSTILE, "concurrency", limit_key(prefix, HOSTILE),
    )  # fmt: skip
    [hold] = limit["holds"]
    assert (hold["task_id"], hold["task"]) == (HOSTILE, HOSTILE)
    assert [lock["key"] for lock in answer.json()["locks"]] == [f"{prefix}proj.sync:1"]


def test_a_hostile_limit_is_listed_as_it_is_by_singletask_locks(
    hostile_limit: tuple[str, str],
) -> None:
    url, prefix = hostile_limit
    runner = CliRunner()
    listed = runner.invoke(singletask, ["locks", "--url", url, "--prefix", prefix, "--limits",
                                        "--json"])  # fmt: skip
    assert listed.exit_code == 0, listed.output
    [limit] = json.loads(listed.stdout)
    assert (limit["name"], limit["holds"][0]["task_id"]) == (HOSTILE, HOSTILE)
    table = runner.invoke(singletask, ["locks", "--url", url, "--prefix", prefix, "--limits"])
    assert table.exit_code == 0, table.output
    [row] = table.stdout.splitlines()[1:]
    cells = re.split(r" {2,}", row)  # the name has single spaces only
    assert cells[:7] == [HOSTILE, "concurrency", "1", "4", "1", HOSTILE, HOSTILE]


def test_a_hostile_limit_name_is_a_label_value_of_the_exporter(
    hostile_limit: tuple[str, str],
) -> None:
    url, prefix = hostile_limit
    backend = backend_from_url(url)
    registry = CollectorRegistry()
    collector = StoreCollector(backend, prefix, interval=5)
    registry.register(collector)
    try:
        collector.read()
    finally:
        backend.close()
    text = generate_latest(registry).decode()
    samples = samples_of(text)
    assert value(samples, "singletask_store_up") == 1
    labels = {"limit": HOSTILE, "kind": "concurrency"}
    assert value(samples, "singletask_limit_units_used", **labels) == 1
    assert value(samples, "singletask_limit_units_size", **labels) == 4
    assert value(samples, "singletask_locks_held", task="proj.sync") == 1
    tasks = {task for name, pairs in samples for label, task in pairs if label == "task"}
    assert tasks == {"proj.sync"}  # the limit's holder is no task label
