"""What the commands share (Celery's ``bin/base.py`` shape): their context settings
(:data:`CONTEXT`), and which lock store an operator command works on, the one place the commands
(``locks``, ``inspect``, ``release``, ``web``, ``exporter``) turn ``--url`` and the Celery app's
settings into a store URL, its key prefix and its options, with the same usage errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..conf.settings import DEFAULTS, Settings
from ..exceptions import ConfigurationError

__all__ = ["CONTEXT", "store_settings", "url_option"]

_F = TypeVar("_F", bound=Callable[..., Any])

#: The context settings of the group and of every command (-h, and the width of the help).
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

#: What ``--url`` says when the command needs a store.
URL_HELP = (
    "The lock store (redis://..., sqlite:///...). Default: the app's singletask_backend_url "
    "under 'celery -A proj'; required otherwise. Environment: SINGLETASK_BACKEND_URL."
)


def url_option(help: str = URL_HELP) -> Callable[[_F], _F]:
    """The ``--url URL`` option of a command that works on a lock store (also read from
    ``SINGLETASK_BACKEND_URL``)."""
    return click.option("--url", metavar="URL", envvar="SINGLETASK_BACKEND_URL", help=help)


def store_settings(
    app: Any, url: str | None, command: str, *, required: bool = True
) -> tuple[str | None, str, dict[str, Any]]:
    """The store URL (None only when not ``required`` and neither ``--url`` nor an app names
    one), the key prefix and the store's options.

    ``app`` is the Celery app under ``celery -A proj`` (its settings give the URL, unless ``url``
    is given, the prefix and the options), or None (``url``, the default prefix, no options).

    Raises:
        click.UsageError: The app's settings are invalid, or no store is named and one is
            ``required`` (the message says how to name one, for ``command``).
    """
    if app is not None:
        try:
            settings = Settings.from_app(app, backend_url=url)
        except ConfigurationError as exc:
            raise click.UsageError(f"{exc} (or give --url)") from None
        return settings.backend_url, settings.key_prefix, settings.backend_options()
    if url is None and required:
        raise click.UsageError(
            "no lock store: give --url URL (or set SINGLETASK_BACKEND_URL), or run the "
            f"command as 'celery -A proj singletask {command}'"
        )
    return url, DEFAULTS["singletask_key_prefix"], {}
