"""Signals singletask sends, in the style of :mod:`celery.signals`.

``lock_conflict``
    Sent in the process executing the task whenever an execution finds its lock held and acts
    on it. Arguments: ``sender`` (the task), ``key``, ``holder`` (task id or None), ``ttl``
    (seconds left on the holder's lease or None), ``task_id`` (of the locked-out execution),
    ``action`` (``"skip"``, ``"retry"`` or ``"raise"``).

Example::

    from singletask.signals import lock_conflict

    @lock_conflict.connect
    def count(sender, key, action, **kwargs):
        statsd.incr(f"singletask.{action}", tags=[f"task:{sender.name}"])
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_conflict"]

lock_conflict = Signal(name="lock_conflict")
