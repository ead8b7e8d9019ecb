"""Send a burst of duplicate order syncs from Django code, the way a view would, and report.

Run a worker first, from this folder: ``celery -A proj worker -l INFO``; then
``python send_orders.py``. Each sync is sent with ``transaction.on_commit``, so a task never
runs before the data it reads is committed (and is never sent if the transaction rolls back).
"""

import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

import django

django.setup()

from django.db import transaction  # noqa: E402
from shop.tasks import sync_order  # noqa: E402

from singletask import Skipped  # noqa: E402

DUPLICATES = 10


def main() -> int:
    results = []
    with transaction.atomic():
        # ... save the order here ...
        for _ in range(DUPLICATES):
            transaction.on_commit(lambda: results.append(sync_order.delay(42)))
    outcomes = [result.get(timeout=60) for result in results]
    ran = [r for r, value in zip(results, outcomes, strict=True) if not isinstance(value, Skipped)]
    skipped = [value for value in outcomes if isinstance(value, Skipped)]
    print(f"sent {DUPLICATES} syncs of order 42: {len(ran)} ran, {len(skipped)} skipped")
    for value in skipped:
        print(f"skipped: lock held by {value.holder}")
    ran_ids = {r.id for r in ran}
    return 0 if ran and all(value.holder in ran_ids for value in skipped) else 1


if __name__ == "__main__":
    sys.exit(main())
