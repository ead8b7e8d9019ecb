"""The Redis family of lock stores: one server, Sentinel and Cluster, with or without TLS.

* ``store``: :class:`RedisBackend` (``redis://``, ``rediss://``, ``unix://``);
* ``deploy``: :class:`RedisSentinelBackend` (``sentinel://``) and :class:`RedisClusterBackend`
  (``redis+cluster://``, ``rediss+cluster://``), and what the two share;
* ``scripts``: the rules every Lua script keeps and the Lua pieces they share; the scripts, each
  under its KEYS, ARGV and reply, by concept: ``lock_scripts`` (the lock key), ``slot_scripts``
  (holder slots, rated or not), ``debounce_scripts``, ``preempt_scripts``, ``limit_scripts``
  (named limits);
* ``slots``, ``rates``, ``replaced``, ``units``, ``bookkeeping``: holder slots; a key's
  companion records (rates, coalesce claims, debounce windows); preemption records; named
  limits (``take_units``, ``give_units``); the bookkeeping listed for operators;
* ``wire``, ``connections``, ``options``: how a script goes out and its reply comes
  back, the connections the store keeps, and its URL and transport options.
"""

from __future__ import annotations

from .deploy import RedisClusterBackend, RedisSentinelBackend
from .store import RedisBackend

__all__ = ["RedisBackend", "RedisClusterBackend", "RedisSentinelBackend"]
