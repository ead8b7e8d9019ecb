"""The MySQL / MariaDB lock store (``mysql://``, ``mariadb://``, ``mysql+pymysql://``).

* ``store``: :class:`MySQLBackend`, how it holds its guarantees;
* ``queries``: its SQL, and how a script is sent and the table created.

Importing this package imports PyMySQL.
"""

from __future__ import annotations

from .store import MySQLBackend

__all__ = ["MySQLBackend"]
