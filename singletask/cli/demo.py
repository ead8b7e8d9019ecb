"""``singletask demo``: singletask at work on a real prefork worker (:mod:`singletask.demo`),
and the checks of its ``--broker``, ``--backend`` and ``--locks`` URLs."""

from __future__ import annotations

import sys
from typing import Any

import click

from ..backends.urls import mask_url
from .base import CONTEXT

__all__ = ["demo"]


def _scheme(value: str, what: str) -> str:
    scheme, sep, _ = value.partition("://")
    if not sep or not scheme:
        raise click.BadParameter(f"expected a URL such as {what}, got {mask_url(value)!r}")
    return scheme.lower()


def _in_process_only(value: str) -> click.BadParameter:
    return click.BadParameter(
        f"{mask_url(value)!r} lives inside one process; the demo's worker is another process"
    )


def _broker(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    scheme = _scheme(value, "redis://localhost:6379/0 or amqp://guest@localhost//")
    if scheme == "memory":
        raise _in_process_only(value)
    from kombu.transport import resolve_transport

    try:
        resolve_transport(scheme)
    except (KeyError, ImportError) as exc:
        raise click.BadParameter(f"no kombu transport for {mask_url(value)!r}: {exc}") from None
    return value


def _backend(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    scheme = _scheme(value, "redis://localhost:6379/1")
    if scheme in ("cache+memory", "memory"):
        raise _in_process_only(value)
    from celery.app.backends import by_url

    try:
        by_url(value)
    except Exception as exc:  # Celery raises several kinds for an unusable URL
        raise click.BadParameter(
            f"no Celery result backend for {mask_url(value)!r}: {mask_url(str(exc))}"
        ) from None
    return value


def _locks(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    scheme = _scheme(value, "redis://localhost:6379/2 or sqlite:////tmp/locks.db")
    if scheme == "memory":
        raise _in_process_only(value)
    from ..backends import backend_from_url
    from ..exceptions import ConfigurationError

    try:
        backend_from_url(value).close()
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


@click.command(context_settings=CONTEXT)
@click.option("--quick", is_flag=True, help="Shorter runs (0.6 s instead of 1.5 s).")
@click.option(
    "--broker",
    metavar="URL",
    callback=_broker,
    help="Use this broker (redis://..., amqp://...) instead of kombu's filesystem transport "
    "in a temporary folder.",
)
@click.option(
    "--backend",
    metavar="URL",
    callback=_backend,
    help="Use this result backend (redis://...) instead of Celery's file backend in the "
    "temporary folder.",
)
@click.option(
    "--locks",
    metavar="URL",
    callback=_locks,
    help="Keep the locks there (redis://...) instead of in a SQLite file in the temporary "
    "folder. Not implied by --broker: the locks stay in SQLite unless this is given.",
)
@click.option(
    "-c",
    "--concurrency",
    type=click.IntRange(2, 16),
    default=4,
    show_default=True,
    help="Worker processes (prefork pool).",
)
@click.option(
    "--plain",
    is_flag=True,
    help="Print progress lines and each timeline once it is complete, even on a terminal "
    "(the default when the output is not a terminal).",
)
@click.option(
    "--color/--no-color",
    default=None,
    help="Colours (default: on a terminal, unless NO_COLOR is set).",
)
def demo(
    quick: bool,
    broker: str | None,
    backend: str | None,
    locks: str | None,
    concurrency: int,
    plain: bool,
    color: bool | None,
    **kwargs: Any,  # Celery <= 5.6 passes its preload options to plugin commands
) -> None:
    """Watch singletask keep duplicate Celery tasks apart, on a real prefork worker.

    It starts "celery worker -P prefork" (4 processes, -c) in the background and plays eight
    scenes whose tasks collide: a burst of duplicates, one lock per customer, the retry and
    raise policies, a periodic task that outlasts its period, the replace policy, a limit of
    two runs per key and a rate. It draws each on a timeline with one row per worker process
    and ends with a summary table.

    With no options it needs no server: the broker, the results and the locks live in a
    temporary folder (kombu's filesystem transport, Celery's file result backend, singletask's
    SQLite lock store). It stops the worker and deletes the folder when it ends, also on Ctrl-C.

    Exit status: 0 when singletask behaved as documented, 1 when not (for instance more runs
    of a key at once than its limit), 130 when interrupted.
    """
    from ..demo.runner import DemoOptions, run_demo

    options = DemoOptions(
        quick=quick,
        broker=broker,
        backend=backend,
        locks=locks,
        concurrency=concurrency,
        color=color,
        live=False if plain else None,
    )
    sys.exit(run_demo(options))
