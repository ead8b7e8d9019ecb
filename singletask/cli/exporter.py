"""``singletask exporter``: the Prometheus exporter (see docs/metrics.rst).

Runs as ``celery -A proj singletask exporter`` (broker, lock store and key prefix from the app's
settings) and as ``singletask exporter --broker URL --url URL`` (no app needed). Needs the
``metrics`` extra: ``pip install "singletask[metrics]"``.

Exit status: 0 stopped (SIGTERM, Ctrl-C); 2 usage error (bad option, no broker, prometheus_client
missing, a store that cannot list its locks, the port cannot be bound).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from typing import Any

import click

from ..backends import backend_from_url
from ..backends.base import LockBackend
from ..backends.urls import mask_url
from ..conf.settings import check_key_prefix
from ..exceptions import ConfigurationError, UnsupportedOperation
from .base import CONTEXT, store_settings, url_option

__all__ = ["exporter"]


def _positive(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if value <= 0:
        raise click.BadParameter(f"must be above 0 seconds, got {value}")
    return value


def _store(app: Any, url: str | None, prefix: str | None) -> tuple[LockBackend | None, str, str]:
    """The lock store to read (None: none configured, standalone), the key prefix, and how to
    name the store in messages (password masked)."""
    url, key_prefix, options = store_settings(app, url, "exporter", required=False)
    if prefix is not None:
        try:
            key_prefix = check_key_prefix(prefix, "--prefix")
        except ConfigurationError as exc:
            raise click.UsageError(str(exc)) from None
    if url is None:
        return None, key_prefix, "no lock store"
    if url.partition("://")[0].lower() == "memory":
        raise click.UsageError(f"{mask_url(url)!r} lives inside one process: nothing to read")
    try:
        return backend_from_url(url, **options), key_prefix, f"lock store {mask_url(url)}"
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None


@click.command(context_settings=CONTEXT)
@url_option(
    "The lock store to read the gauges from. Default: the app's lock store under "
    "'celery -A proj'; none otherwise (the event counters only). "
    "Environment: SINGLETASK_BACKEND_URL."
)
@click.option(
    "--broker",
    metavar="URL",
    envvar="SINGLETASK_BROKER_URL",
    help="The broker whose events to follow. Default: the app's broker_url under "
    "'celery -A proj'; required otherwise. Environment: SINGLETASK_BROKER_URL.",
)
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="Listen on this address (0.0.0.0: every interface; mind who can read the metrics).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve /metrics on this port (0: any free one, printed). [default: 9846]",
)
@click.option(
    "--prefix",
    metavar="PREFIX",
    help="Key prefix of the locks (default: the app's singletask_key_prefix, else 'singletask:').",
)
@click.option(
    "--store-interval",
    type=float,
    default=15.0,
    show_default=True,
    callback=_positive,
    metavar="SECONDS",
    help="Read the lock store every SECONDS. A read still running after as long makes "
    "singletask_store_up 0.",
)
@click.pass_context
def exporter(
    ctx: click.Context,
    /,
    url: str | None,
    broker: str | None,
    address: str,
    port: int | None,
    prefix: str | None,
    store_interval: float,
    **kwargs: Any,  # Celery <= 5.6 passes its preload options to plugin commands
) -> None:
    """Serve Prometheus metrics of singletask's locks on http://ADDRESS:PORT/metrics.

    One process for the whole fleet: it follows the Celery event stream (run the workers with
    -E, or worker_send_task_events = True) for counters of lock outcomes per task and
    histograms of lock waits and holds, and reads the lock store every --store-interval for
    gauges of the locks held, reservations, follow-ups, debounce windows and the oldest hold.
    No worker opens a port. No metric carries a lock key. Stop it with Ctrl-C or SIGTERM.
    """
    try:
        from ..ops.exporter import DEFAULT_PORT, Exporter
    except ImportError as exc:
        raise click.UsageError(
            f'the exporter needs prometheus_client: pip install "singletask[metrics]" ({exc})'
        ) from None
    from celery import Celery

    app = getattr(ctx.obj, "app", None)  # Celery's CLIContext under `celery -A proj`
    if app is None and broker is None:
        raise click.UsageError(
            "no broker: give --broker URL (or set SINGLETASK_BROKER_URL), or run the command "
            "as 'celery -A proj singletask exporter'"
        )
    backend, key_prefix, store = _store(app, url, prefix)
    events_app = app if app is not None else Celery("singletask-exporter", set_as_current=False)
    service = Exporter(
        events_app, backend, prefix=key_prefix, broker_url=broker, store_interval=store_interval
    )
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        service.start_store(wait=store_interval)
        host, bound = service.bind(address, DEFAULT_PORT if port is None else port)
    except UnsupportedOperation as exc:
        service.close()
        raise click.UsageError(
            f"{exc}: the store gauges need a store that can list its locks; without --url the "
            "exporter serves the event counters only"
        ) from None
    except OSError as exc:
        service.close()
        raise click.UsageError(f"cannot listen on {address}:{port}: {exc}") from None
    where = mask_url(broker or events_app.conf.broker_url)
    shown = f"[{host}]" if ":" in host else host
    click.echo(
        f"singletask exporter: http://{shown}:{bound}/metrics (events from {where}, {store})",
        err=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        service.serve_forever()
