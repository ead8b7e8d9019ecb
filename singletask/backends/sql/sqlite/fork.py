"""No ``fork()`` while a thread of the process is inside a SQLite store's transaction.

SQLite keeps, in each process, what the process's connections hold of a database file's locks
(the WAL write lock among them). ``fork()`` copies that bookkeeping into the child but not the
locks themselves, which stay with the parent: a child forked while another thread of its parent
was inside a write transaction believes for ever that a connection of its own holds the write
lock, and every write it makes waits the busy timeout and fails ("database is locked"), however
fresh its own connection is (or it hangs on a mutex copied while held). A Celery worker's main
process forks a new pool process when one ends (a hard time limit, a killed child), at the
moment its watcher thread releases the lock of the ended one: the new pool process then could
never take a lock.

So every :class:`~singletask.backends.sql.sqlite.SQLiteBackend` of the process is registered
here, and a fork waits for each store's mutex (the one every transaction runs under) before it
happens, and gives it back after, in the parent and in the child: no transaction is in progress
when the process is copied. The wait is at most one transaction (bounded by the store's busy
timeout); a fork made by the thread that holds a mutex, inside a transaction, is not delayed
longer than that bound and goes ahead without it.
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


#: The stores of this process (weakly: a store dropped is forgotten).
_stores: weakref.WeakSet[_Guarded] = weakref.WeakSet()
#: The mutexes taken before the fork in progress, given back after it.
_taken: list[threading.Lock] = []


def guard(store: _Guarded) -> None:
    """Hold ``store``'s mutex across every ``fork()`` of this process from now on."""
    _stores.add(store)


def _before_fork() -> None:
    for store in list(_stores):
        if store._mutex.acquire(timeout=store.timeout + 1.0):
            _taken.append(store._mutex)


def _after_fork() -> None:
    while _taken:
        _taken.pop().release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)
