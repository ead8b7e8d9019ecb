"""The PostgreSQL lock store (``postgresql://``, ``postgres://``, ``postgresql+psycopg://``).

* ``store``: :class:`PostgresBackend`, how it holds its guarantees;
* ``queries``: its SQL, its own URL options, and how it classifies psycopg's errors;
* ``windows``: the SQL of its debounce windows.

Importing this package imports psycopg.
"""

from __future__ import annotations

from .store import PostgresBackend

__all__ = ["PostgresBackend"]
