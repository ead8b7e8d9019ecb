"""Helpers to test your own singleton tasks: no lock server, no worker needed.

::

    from singletask.testing import hold_lock, isolated_locks, lock_key_for

    def test_a_duplicate_sync_is_skipped():
        with isolated_locks(app) as locks:               # a fresh in-process lock store
            with hold_lock(sync_customer, 42) as held:   # as another execution would
                value = sync_customer.delay(42).get()    # task_always_eager
            locks.assert_skipped(held)
            assert lock_key_for(sync_customer, 42) == lock_key_for(sync_customer, 42, full=True)

With pytest, the ``singletask_locks`` and ``singletask_locks_disabled`` fixtures of the plugin in
:mod:`singletask.testing.plugin` do the first line for you. Nothing here imports pytest.

While :func:`isolated_locks` (or :func:`locks_disabled`) is in effect, every
:class:`~singletask.SingletonTask` of the app uses the store it installed, in this process
only, whatever ``singletask_backend_url`` says (the app needs none). Tasks then run exactly as
in production: the same keys, policies, logs and signals.
"""

from __future__ import annotations

from .conflicts import IsolatedLocks, LockConflict, isolated_locks
from .locks import DEFAULT_HOLDER_ID, DEFAULT_LEASE, HeldLock, hold_lock, lock_key_for
from .stores import locks_disabled

__all__ = [
    "DEFAULT_HOLDER_ID",
    "DEFAULT_LEASE",
    "HeldLock",
    "IsolatedLocks",
    "LockConflict",
    "hold_lock",
    "isolated_locks",
    "lock_key_for",
    "locks_disabled",
]
