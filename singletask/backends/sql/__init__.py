"""The SQL family of lock stores: PostgreSQL, MySQL / MariaDB and SQLite.

* ``core``: what the server stores share, the table layout and URL options; ``pool``, their
  connection pool; ``slots``, their holder-slot arguments and outcomes; ``bookkeeping``, the
  records they list for operators; ``replaced``, every store's preemption records; ``units``,
  their named limits (``take_units``) above each store's SQL (``postgres/units``,
  ``mysql/units``);
* ``postgres/`` (:class:`~singletask.backends.sql.postgres.PostgresBackend`, in ``store``), its
  statements in ``queries``, those of its debounce windows in ``windows``, and its client-side
  deadline in ``watchdog``;
* ``mysql/`` (:class:`~singletask.backends.sql.mysql.MySQLBackend`, in ``store``), its
  statements in ``queries``;
* ``sqlite/`` (:class:`~singletask.backends.sql.sqlite.SQLiteBackend`, in ``store``), its file
  in ``files``, its rate and debounce tables in ``windows``, its reads in ``reads`` and its
  guard of ``fork()`` in ``fork``.

Importing this package imports no driver: each store's package imports its own (psycopg,
PyMySQL, the standard library's sqlite3) when it is imported.
"""
