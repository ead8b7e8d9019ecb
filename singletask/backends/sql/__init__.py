"""The SQL family of lock stores: PostgreSQL, MySQL / MariaDB and SQLite.

* ``core``: what the server stores share, the table layout and URL options; ``pool``, their
  connection pool; ``slots``, their holder-slot arguments and outcomes;
* ``postgres`` (:class:`~singletask.backends.sql.postgres.PostgresBackend`), its statements in
  ``postgres_queries``, those of its debounce windows in ``postgres_windows``, and its
  client-side deadline in ``watchdog``;
* ``mysql`` (:class:`~singletask.backends.sql.mysql.MySQLBackend`), its statements in
  ``mysql_queries``;
* ``sqlite`` (:class:`~singletask.backends.sql.sqlite.SQLiteBackend`), its file in
  ``sqlite_files`` and its rate and debounce tables in ``sqlite_windows``.

Importing this package imports no driver: each store's module imports its own (psycopg,
PyMySQL, the standard library's sqlite3) when it is imported.
"""
