"""The in-process lock store, ``memory://``: locks in this process only, for eager mode, unit
tests and single-process tools (:mod:`~singletask.backends.memory.store`), and its named limits'
records (:mod:`~singletask.backends.memory.limits`).
"""

from .store import FENCE_RETENTION, MemoryBackend

__all__ = ["FENCE_RETENTION", "MemoryBackend"]
