"""Without pytest: the same check with unittest and the context managers behind the fixtures.

Run it in this folder with ``python -m unittest test_unittest`` (pytest collects it too). It
needs no server: ``apply()`` runs the task here, at the call, so nothing goes to the app's
broker, and ``isolated_locks`` keeps the locks in this process.
"""

from __future__ import annotations

import unittest

from singletask import Skipped
from singletask.testing import hold_lock, isolated_locks

from webshop import app, sync_customer


class SyncTests(unittest.TestCase):
    def test_duplicate_is_skipped(self) -> None:
        with isolated_locks(app) as locks, hold_lock(sync_customer, 42) as held:
            result = sync_customer.apply((42,))
            assert isinstance(result.get(), Skipped)
            locks.assert_skipped(held)


if __name__ == "__main__":
    unittest.main()
