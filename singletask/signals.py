"""Signals singletask sends, in the style of :mod:`celery.signals`.

``lock_conflict``
    Sent in the process executing the task whenever an execution finds its lock held and acts
    on it. Arguments: ``sender`` (the task), ``key``, ``holder`` (task id or None), ``ttl``
    (seconds left on the holder's lease or None), ``task_id`` (of the locked-out execution),
    ``action``: the policy's ``"skip"``, ``"retry"`` or ``"raise"``; or, when the holder has the
    same task id, ``"defer"`` (another delivery of this message holds it: check again later)
    or ``"drop"`` (a newer attempt of the task holds it: this copy is stale).

``lock_lost``
    Sent in the process executing the task when its lock is found lost while the body runs (a
    renewal found it gone or owned by another, or its lease passed while renewals failed).
    Arguments: ``sender`` (the task), ``key``, ``task_id``, ``reason``. Sent from the renewer
    thread.

Example::

    from singletask.signals import lock_conflict

    @lock_conflict.connect
    def count(sender, key, action, **kwargs):
        statsd.incr(f"singletask.{action}", tags=[f"task:{sender.name}"])
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_conflict", "lock_lost"]

lock_conflict = Signal(name="lock_conflict")
lock_lost = Signal(name="lock_lost")
