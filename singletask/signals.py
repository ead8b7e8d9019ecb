"""Signals singletask sends, in the style of :mod:`celery.signals`.

``lock_acquired``
    Sent in the process executing the task when an execution has taken its lock, before the
    body runs. Arguments: ``sender`` (the task), ``key``, ``task_id`` (None for a direct call),
    ``fence`` (the acquisition's fencing token).

``lock_conflict``
    Sent in the process executing the task whenever an execution finds its lock held (or a start
    refused by ``lock_rate`` or a named limit) and acts on it, and, for the queue and coalesce
    scopes, in the process that sends. Arguments: ``sender`` (the task), ``key``, ``holder``
    (task id or None), ``ttl`` (seconds left on the holder's lease or None), ``task_id`` (of the
    locked-out execution or call), ``action``. Every ``action`` and when it is sent: the API
    reference (docs/api.rst, "Signals").

``lock_lost``
    Sent in the process executing the task when its lock is found lost while the body runs (a
    renewal found it gone or owned by another, or its lease passed while renewals failed).
    Arguments: ``sender`` (the task), ``key``, ``task_id``, ``reason``. Sent from the renewer
    thread.

``lock_released_by_operator``
    Sent in the process that released a lock through :func:`singletask.ops.inventory.release_lock`
    (the ``singletask release`` command). Arguments: ``sender`` (None), ``key``, ``task`` (the
    holder's task name or None), ``holder`` (its task id or None), ``forced`` (True for
    ``--force``, False for ``--holder``). The holder's own worker reports the loss separately,
    with ``lock_lost``, at its next renewal.

Example::

    from singletask.signals import lock_conflict

    @lock_conflict.connect
    def count(sender, key, action, **kwargs):
        statsd.incr(f"singletask.{action}", tags=[f"task:{sender.name}"])
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_conflict", "lock_lost", "lock_released_by_operator"]

lock_acquired = Signal(name="lock_acquired")
lock_conflict = Signal(name="lock_conflict")
lock_lost = Signal(name="lock_lost")
lock_released_by_operator = Signal(name="lock_released_by_operator")
