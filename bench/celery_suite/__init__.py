"""Celery's own unit suite (t/unit/tasks and t/unit/app), run once with Celery's Task and once
with SingletonTask as every task's base: :mod:`bench.celery_suite.run` diffs the two."""
