"""PostgreSQL-only options of the SQL lock store (the rest is in test_sql.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from singletask import ConfigurationError
from singletask.backends import backend_from_url

from ..servers import free_port, unavailable


@pytest.mark.parametrize("sql_store", ["postgresql"], indirect=True)
def test_prepare_threshold_is_psycopgs_option_not_libpqs(sql_store: tuple[str, str]) -> None:
    """prepare_threshold=none (for an old PgBouncer in transaction mode) is taken out of the
    connection string and set on each connection."""
    # Given a backend whose URL says never to prepare statements
    url, table = sql_store
    backend = backend_from_url(f"{url}?prepare_threshold=none", table=table)

    # When it runs more statements than psycopg's default threshold
    for _ in range(8):
        assert backend.acquire("k", "t", 30).acquired

    # Then its connections never prepare, and a bad value is refused at once
    with backend._pool.connection() as conn:
        assert conn.prepare_threshold is None
    backend.close()
    with pytest.raises(ConfigurationError, match="prepare_threshold"):
        backend_from_url(f"{url}?prepare_threshold=often")


@pytest.fixture
def pgbouncer(sql_store: tuple[str, str], tmp_path: Path) -> Iterator[str]:
    """The test server behind a PgBouncer in transaction mode (two server connections for
    every client). PgBouncer is no dependency of singletask; .ci/run installs it, so where it is
    missing the test is skipped locally and fails in CI."""
    binary = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None
    )
    if binary is None:
        unavailable("PgBouncer is not installed (apt-get install -y pgbouncer)")
    parts = urlsplit(sql_store[0])
    port = free_port()
    user = parts.username or "postgres"
    dbname = parts.path.lstrip("/")
    (tmp_path / "users.txt").write_text(f'"{user}" ""\n')
    (tmp_path / "pgbouncer.ini").write_text(
        f"[databases]\n{dbname} = host={parts.hostname} port={parts.port} dbname={dbname}\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {tmp_path}/users.txt\npool_mode = transaction\n"
        "default_pool_size = 2\n"
    )
    tmp_path.chmod(0o755)
    command = [binary, str(tmp_path / "pgbouncer.ini")]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        command[1:1] = ["-u", "postgres"]
    log = tmp_path / "pgbouncer.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "PgBouncer did not start"
            time.sleep(0.1)
    yield urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{port}"))
    process.terminate()
    process.wait(10)


@pytest.mark.parametrize("sql_store", ["postgresql"], indirect=True)
def test_it_works_behind_pgbouncer_in_transaction_mode(
    sql_store: tuple[str, str], pgbouncer: str
) -> None:
    """With ``transaction_pooling=1``: no startup parameter PgBouncer refuses, no session
    state and no prepared statement; six stores (more connections than PgBouncer's two server
    connections) share the server connections, and every operation behaves."""
    table = sql_store[1]
    url = f"{pgbouncer}?transaction_pooling=1"
    stores = [backend_from_url(url, table=table, timeout=2) for _ in range(6)]
    for n, store in enumerate(stores):
        assert store.acquire(f"k{n}", "t", 30, meta={"task_id": f"id{n}"}).acquired
        assert not stores[(n + 1) % 6].acquire(f"k{n}", "rival", 30).acquired
    for n, store in enumerate(stores):
        assert store.extend_many([(f"k{n}", "t", 30)]) == [True]
        assert store.claim_next(f"k{n}", "next", 30) == "next"
    assert [key for key, _ in stores[0].iter_locks("k")] == [f"k{n}" for n in range(6)]
    for n, store in enumerate(stores):
        assert store.release_held_by(f"k{n}", f"id{n}") is not None
        store.close()


@pytest.mark.parametrize("sql_store", ["postgresql"], indirect=True)
def test_transaction_pooling_is_a_flag_of_the_url(sql_store: tuple[str, str]) -> None:
    url, table = sql_store
    assert backend_from_url(f"{url}?transaction_pooling=1", table=table).transaction_pooling
    assert not backend_from_url(f"{url}?transaction_pooling=false").transaction_pooling
    assert not backend_from_url(url).transaction_pooling
    with pytest.raises(ConfigurationError, match="transaction_pooling"):
        backend_from_url(f"{url}?transaction_pooling=sometimes")
