"""PostgreSQL-only options of the SQL lock store (the rest is in test_sql.py)."""

from __future__ import annotations

import pytest

from singletask import ConfigurationError
from singletask.backends import backend_from_url


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
