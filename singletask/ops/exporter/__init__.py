"""The Prometheus exporter (``singletask exporter``, see docs/metrics.rst).

One process, beside the workers: it follows the Celery event stream for the counters and
histograms (:mod:`.events`) and reads the lock store on a timer for the gauges (:mod:`.store`),
and serves both on ``/metrics`` (:mod:`.service`). No worker opens a port, and prefork needs no
multiprocess setup. Needs the ``metrics`` extra (prometheus_client). No label holds a lock key
or a task id: keys are unbounded and may carry customer data; the labels are ``task`` and
``outcome``, and a named limit's ``limit`` (its name, from the configuration) and ``kind``.
"""

from __future__ import annotations

from .events import OUTCOMES, EventMetrics, task_of_key
from .service import DEFAULT_PORT, EventFollower, Exporter
from .store import StoreCollector

__all__ = [
    "DEFAULT_PORT",
    "OUTCOMES",
    "EventFollower",
    "EventMetrics",
    "Exporter",
    "StoreCollector",
    "task_of_key",
]
