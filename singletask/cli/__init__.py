"""The ``singletask`` command line.

``singletask demo`` (:mod:`singletask.cli.demo`; also ``python -m singletask demo``, and
``celery singletask demo`` through Celery's ``celery.commands`` entry point) shows singletask at
work on a real prefork worker.
``singletask locks / inspect / release`` (:mod:`singletask.cli.locks`) let an operator see and
release the locks of a live fleet, as ``celery -A proj singletask ...`` or with ``--url``;
``singletask exporter`` (:mod:`singletask.cli.exporter`) serves Prometheus metrics of them.
"""

from __future__ import annotations

from typing import Any

import click

from .. import __version__
from .base import CONTEXT
from .demo import demo
from .exporter import exporter
from .locks import COMMANDS
from .web import web

__all__ = ["main", "singletask"]


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="singletask")
def singletask(**kwargs: Any) -> None:  # Celery <= 5.6 adds its preload options here
    """singletask: one execution of a Celery task (or of a task per argument values) at a time.

    Run "singletask demo" to see it keep duplicate tasks apart on a real Celery worker, with
    nothing to install or set up. "locks", "inspect" and "release" show and release the locks
    of a live fleet (run them as "celery -A proj singletask ...", or here with --url URL);
    "web" serves a live page of them and "exporter" their Prometheus metrics.
    """


for _command in (demo, *COMMANDS, web, exporter):
    singletask.add_command(_command)


def main(argv: list[str] | None = None, **kwargs: Any) -> None:
    """The ``singletask`` console script."""
    singletask.main(args=argv, prog_name="singletask", **kwargs)
