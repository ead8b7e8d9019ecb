"""The SQLite lock store (``sqlite://``): one database file shared by the processes of one host.

* ``store``: :class:`SQLiteBackend`, its transactions;
* ``files``: the file: its URL, the filesystems it refuses, the tables in it;
* ``windows``: its rate records and debounce windows, in tables of their own;
* ``units``: its named limits (``take_units``), holds and starts in a table of its own;
* ``reads``: what it reads for operators and for ``holder``, creating and changing nothing;
* ``fork``: no ``fork()`` while a thread of the process is inside one of its transactions.
"""

from __future__ import annotations

from .store import SQLiteBackend

__all__ = ["SQLiteBackend"]
