"""No SQLite connection of a store carried across ``fork()``, and no fork inside a transaction.

SQLite keeps, in each process, what the process's connections hold of a database file's locks.
``fork()`` copies that record into the child but not the locks themselves, which stay with the
parent, and a connection the child opens later on the same file shares the copied record. Two
failures follow, both seen here:

* A child forked while another thread of its parent was inside a write transaction believes for
  ever that a connection of its own holds the write lock: every write it makes waits the busy
  timeout and fails ("database is locked"), however fresh its own connection is (or it hangs on
  a mutex copied while held). A Celery worker's main process forks a new pool process when one
  ends (a hard time limit, a killed child), at the moment its watcher thread releases the lock
  of the ended one: the new pool process then could never take a lock.
* A child forked while its parent merely had the file open takes none of the file's locks of its
  own: it relies on the parent's. When the parent then closes its connection (a store closed, or
  dropped and collected), it finds itself the file's last user, checkpoints, and deletes the WAL
  and shared-memory files under the running child; a process that opens the file afterwards
  uses new ones, and it and the child both take the same lock.

So every :class:`~singletask.backends.sql.sqlite.SQLiteBackend` of the process is registered
here, and a fork first waits for each store's mutex (the one every transaction runs under),
closes the store's connection (the store opens a new one at its next use), and gives the mutex
back after, in the parent and in the child: no transaction is in progress and no connection of
a store is open when the process is copied. The wait is at most one transaction (bounded by the
store's busy timeout); a fork made by the thread that holds a mutex, inside a transaction, is
not delayed longer than that bound and goes ahead without it (and with that store's connection).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Protocol

__all__ = ["guard"]


class _Guarded(Protocol):
    """A store whose transactions all run under ``_mutex``, waiting at most ``timeout``."""

    _mutex: threading.Lock
    timeout: float

    def _disconnect(self) -> None:
        """Close this process's connection, ``_mutex`` held (the next use opens a new one)."""


#: The stores of this process (weakly: a store dropped is forgotten).
_stores: weakref.WeakSet[_Guarded] = weakref.WeakSet()
#: The mutexes taken before the fork in progress, given back after it.
_taken: list[threading.Lock] = []


def guard(store: _Guarded) -> None:
    """Close ``store``'s connection before, and hold its mutex across, every ``fork()`` of this
    process from now on."""
    _stores.add(store)


def _before_fork() -> None:
    failed: Exception | None = None
    for store in list(_stores):
        if store._mutex.acquire(timeout=store.timeout + 1.0):
            _taken.append(store._mutex)
            try:
                store._disconnect()
            except Exception as exc:  # the store forgot the connection all the same
                failed = failed or exc
    if failed is not None:  # every store was seen to; Python reports it (sys.unraisablehook)
        raise failed


def _after_fork() -> None:
    while _taken:
        _taken.pop().release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)
