"""A recorder that task bodies write to and tests read: who ran, when, and how many at once.

Every body under test wraps its work in ``probe().running(label, task_id)``. The probe keeps, in
the private Redis, a counter of bodies running per label, the highest value it ever reached (the
overlap detector: it must stay 1 for a singleton) and a list of start/end events.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import redis

PROBE_URL_ENV = "SINGLETASK_E2E_PROBE"

# KEYS[1] running counter, KEYS[2] high-water mark. Returns the counter after the increment.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
local m = tonumber(redis.call('GET', KEYS[2]) or '0')
if n > m then redis.call('SET', KEYS[2], n) end
return n
"""


class Probe:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self._enter = self.client.register_script(_ENTER)

    def _record(self, label: str, event: str, task_id: str | None, **extra: Any) -> None:
        payload = {
            "event": event,
            "task_id": task_id,
            "pid": os.getpid(),
            "t": time.time(),
            **extra,
        }
        self.client.rpush(f"probe:{label}:events", json.dumps(payload))

    @contextlib.contextmanager
    def running(self, label: str, task_id: str | None, **extra: Any) -> Iterator[int]:
        """Count this body as running under ``label`` for the duration of the block."""
        concurrent = self._enter(keys=[f"probe:{label}:running", f"probe:{label}:max"])
        self._record(label, "start", task_id, concurrent=concurrent, **extra)
        try:
            yield concurrent
        finally:
            self.client.decr(f"probe:{label}:running")
            self._record(label, "end", task_id, **extra)

    def mark(self, label: str, event: str, task_id: str | None = None, **extra: Any) -> None:
        """Record a one-off event (e.g. ``"finally"`` from a cleanup block)."""
        self._record(label, event, task_id, **extra)

    # -- reading, from the tests -------------------------------------------------------

    def events(self, label: str, event: str | None = None) -> list[dict[str, Any]]:
        items = [json.loads(raw) for raw in self.client.lrange(f"probe:{label}:events", 0, -1)]
        return [item for item in items if event is None or item["event"] == event]

    def starts(self, label: str) -> list[dict[str, Any]]:
        return self.events(label, "start")

    def max_overlap(self, label: str) -> int:
        return int(self.client.get(f"probe:{label}:max") or 0)

    def wait_for(
        self, label: str, event: str, count: int = 1, timeout: float = 20.0
    ) -> list[dict[str, Any]]:
        """Wait until ``count`` events of a kind are recorded; return them (fails on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(label, event)
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"probe {label!r}: expected {count} {event!r} events within {timeout}s, "
                    f"got {len(found)}: {self.events(label)}"
                )
            time.sleep(0.05)


_probe: dict[int, Probe] = {}


def probe() -> Probe:
    """The probe of this process (worker child or test process), from ``SINGLETASK_E2E_PROBE``."""
    pid = os.getpid()
    if pid not in _probe:
        _probe.clear()
        _probe[pid] = Probe(os.environ[PROBE_URL_ENV])
    return _probe[pid]
