"""The Redis family of lock stores: one server, Sentinel and Cluster, with or without TLS.

* ``store``: :class:`RedisBackend` (``redis://``, ``rediss://``, ``unix://``);
* ``deploy``: :class:`RedisSentinelBackend` (``sentinel://``) and :class:`RedisClusterBackend`
  (``redis+cluster://``, ``rediss+cluster://``), and what the two share;
* ``scripts``: every Lua script, each under its KEYS, ARGV and reply (``limit_scripts``: those
  of named limits);
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
