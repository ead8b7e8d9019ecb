"""The exporter process: the event follower thread, the store reader thread and ``/metrics``.

Everything hangs off one :class:`Exporter` and its private
:class:`~prometheus_client.CollectorRegistry`: nothing is kept at module level, so two exporters
(of two apps) can live in one process.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from celery import Celery
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...backends.base import LockBackend
from .events import EventMetrics
from .store import StoreCollector

__all__ = ["DEFAULT_PORT", "EventFollower", "Exporter"]

logger = logging.getLogger("singletask.exporter")

#: The default port of ``/metrics``. Not 9808 (celery-exporter's) nor 5555 (Flower's): the
#: exporter is meant to run beside those, on the same host.
DEFAULT_PORT = 9846

#: The events the exporter's queue is bound to: singletask's only (Celery routes an event by its
#: type, dashes made dots), so a busy fleet's other task events and heartbeats never reach it.
#: A broker that cannot route by pattern (Redis with ``fanout_patterns`` off) delivers them all,
#: and the handler ignores the others.
ROUTING_KEY = "task.singletask.#"

#: Seconds between two attempts to reach the broker again: doubled from the first to the last.
RECONNECT_DELAYS = (1.0, 30.0)


class EventFollower:
    """Follows the Celery event stream of ``app`` in a daemon thread, calling ``handle`` for each
    event; reconnects (with a growing pause) whenever the broker goes away."""

    def __init__(self, app: Celery, handle: Any, *, broker_url: str | None = None) -> None:
        self.app = app
        self.handle = handle
        self.broker_url = broker_url
        #: Whether the receiver is consuming now (its queue bound to the event exchange).
        self.connected = False
        self._stop = threading.Event()
        self._receiver: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="singletask-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._receiver is not None:
            self._receiver.should_stop = True
        if self._thread is not None:
            self._thread.join(timeout)

    def _on_event(self, event: dict[str, Any]) -> None:
        try:
            self.handle(event)
        except Exception:  # one odd event must not end the stream
            logger.exception("singletask exporter: could not count event %r", event.get("type"))

    def _run(self) -> None:
        delay, logged = RECONNECT_DELAYS[0], False
        while not self._stop.is_set():
            try:
                with self.app.connection_for_read(self.broker_url) as connection:
                    receiver = self.app.events.Receiver(
                        connection, handlers={"*": self._on_event}, routing_key=ROUTING_KEY
                    )
                    receiver.connect_max_retries = 1  # the pause and the retry are ours
                    ready = receiver.on_consume_ready

                    def on_ready(*args: Any, _ready: Any = ready, **kwargs: Any) -> None:
                        _ready(*args, **kwargs)
                        self.connected = True
                        logger.info("singletask exporter: following the events")

                    receiver.on_consume_ready = on_ready
                    self._receiver = receiver
                    if self._stop.is_set():
                        return
                    for _ in receiver.itercapture(limit=None, timeout=None, wakeup=False):
                        delay, logged = RECONNECT_DELAYS[0], False
            except Exception as exc:  # the broker went away (or is not there yet)
                if not logged:
                    logger.warning(
                        "singletask exporter: lost the event stream (%s: %s); reconnecting",
                        type(exc).__name__, exc,
                    )  # fmt: skip
                    logged = True
            finally:
                self.connected = False
            self._stop.wait(delay)
            delay = min(delay * 2, RECONNECT_DELAYS[1])


class _StatusCollector(Collector):
    """``singletask_broker_up``: whether the event stream is followed now."""

    def __init__(self, follower: EventFollower) -> None:
        self.follower = follower

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "singletask_broker_up",
            "1 when the exporter is connected to the broker and following the events, else 0",
            value=1.0 if self.follower.connected else 0.0,
        )


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _V6Server(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class Exporter:
    """The exporter of one Celery app: events from its broker, gauges from ``backend``.

    ``backend`` None: the event counters only (no store gauges, no ``singletask_store_up``).
    """

    def __init__(
        self,
        app: Celery,
        backend: LockBackend | None,
        *,
        prefix: str,
        broker_url: str | None = None,
        store_interval: float = 15.0,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.events = EventMetrics(self.registry, prefix=prefix)
        self.follower = EventFollower(app, self.events.handle, broker_url=broker_url)
        self.registry.register(_StatusCollector(self.follower))
        self.store: StoreCollector | None = None
        if backend is not None:
            self.store = StoreCollector(backend, prefix, interval=store_interval)
            self.registry.register(self.store)
        self._server: WSGIServer | None = None

    def start_store(self, wait: float) -> None:
        """Start reading the store (every ``store_interval``), and wait up to ``wait`` seconds
        for the first read: a store that is down or hangs is reported by the gauges, one that
        cannot list its locks raises.

        Raises:
            UnsupportedOperation: The store cannot list its locks (memcached, also behind a
                Django cache).
        """
        if self.store is not None:
            self.store.start(wait)

    def bind(self, address: str, port: int) -> tuple[str, int]:
        """Open the ``/metrics`` socket; return the address and port it listens on.

        Raises:
            OSError: The address cannot be bound (in use, not local).
        """
        server_class = _V6Server if ":" in address else _Server
        self._server = make_server(
            address, port, make_wsgi_app(self.registry), server_class, _QuietHandler
        )
        host, bound = self._server.server_address[:2]
        return str(host), int(bound)

    def serve_forever(self) -> None:
        """Follow the events, read the store on its timer and answer scrapes until
        :meth:`shutdown` (from another thread) or an exception such as KeyboardInterrupt."""
        assert self._server is not None, "bind() first"
        self.follower.start()
        self.start_store(0.0)
        try:
            self._server.serve_forever()
        finally:
            self.close()

    def shutdown(self) -> None:
        if self._server is not None:
            threading.Thread(target=self._server.shutdown, daemon=True).start()

    def close(self) -> None:
        self.follower.stop()
        if self.store is not None:
            self.store.stop()
            self.store.backend.close()
        if self._server is not None:
            self._server.server_close()
