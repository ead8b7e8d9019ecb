"""``singletask web``: the live lock page (:mod:`singletask.ops.web`), served on this host.

It runs as ``singletask web --url URL`` and as ``celery -A proj singletask web`` (the lock
store's URL, key prefix, table and transport options from the app's settings), like the other
operator commands (:mod:`singletask.cli.locks`). See docs/web.rst.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import click

from ..backends.urls import mask_url
from ..exceptions import ConfigurationError
from .base import CONTEXT, store_settings, url_option

__all__ = ["TOKEN_ENV", "web"]


#: The environment variable that may hold the release token (else ``--token-file``).
TOKEN_ENV = "SINGLETASK_WEB_TOKEN"


def _read_token(token_file: Path | None) -> str | None:
    """The release token: the first line of ``token_file``, else ``SINGLETASK_WEB_TOKEN``."""
    if token_file is not None:
        try:
            lines = token_file.read_text().splitlines()
        except OSError as exc:
            raise click.BadParameter(f"cannot read {token_file}: {exc.strerror}") from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise click.BadParameter(f"{token_file} is empty", param_hint="--token-file")
        return token
    return os.environ.get(TOKEN_ENV, "").strip() or None


@click.command(context_settings=CONTEXT)
@url_option()
@click.option("--prefix", metavar="PREFIX", help="Key prefix to list (default: as 'locks').")
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. Anything but a loopback address makes the page reachable "
    "from other hosts.",
)
@click.option("--port", type=click.IntRange(0, 65535), default=8471, show_default=True)
@click.option(
    "--refresh",
    type=click.FloatRange(0.2, 3600),
    default=2.0,
    show_default=True,
    metavar="SECONDS",
    help="How often an open page reads the store.",
)
@click.option(
    "--allow-release",
    is_flag=True,
    help="Offer a Release button (owner-checked, as 'release --holder'). Needs a token: "
    f"--token-file, or the environment variable {TOKEN_ENV}.",
)
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A file whose first line is the release token (16 characters or more).",
)
@click.pass_context
def web(
    ctx: click.Context,
    /,
    url: str | None,
    prefix: str | None,
    address: str,
    port: int,
    refresh: float,
    allow_release: bool,
    token_file: Path | None,
    **kwargs: Any,
) -> None:
    """Serve a live page of the locks: what the lock store holds, refreshed every few seconds.

    Locks with their holder (task id, host, pid), slot, fence, age and lease left counting
    down; reservations, pending follow-ups, debounce windows and rate records; a filter by
    task and key, and a page per key. Read-only unless --allow-release is given with a token;
    every release, and every refused attempt, is logged with who asked. Listens on 127.0.0.1
    unless --address says otherwise. Stop it with Ctrl-C.
    """
    from ..ops.web import LockPage
    from ..ops.web.server import LOOPBACK_NAMES, is_loopback, make_server

    app = getattr(ctx.obj, "app", None)  # Celery's CLIContext under `celery -A proj`
    store_url, store_prefix, options = store_settings(app, url, "web")
    assert store_url is not None  # required: store_settings refuses a missing URL
    if store_url.partition("://")[0].lower() == "memory":
        raise click.UsageError(f"{mask_url(store_url)!r} lives inside one process: nothing to see")
    token = _read_token(token_file)
    if allow_release and token is None:
        raise click.UsageError(
            f"--allow-release needs a token: --token-file FILE, or the environment variable "
            f"{TOKEN_ENV} (never on the command line, where other users can read it)"
        )
    if token is not None and not allow_release:
        click.echo("note: a token is set but --allow-release is not: the page is read-only",
                   err=True)  # fmt: skip
    try:
        page = LockPage(
            store_url,
            prefix=prefix or store_prefix,
            backend_options=options,
            allow_release=allow_release,
            token=token,
            refresh=refresh,
            hosts=(*LOOPBACK_NAMES, address) if is_loopback(address) else None,
        )
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    if not is_loopback(address):
        guard = "releases need the token" if allow_release else "there is no token"
        click.echo(f"warning: listening on {address}, not a loopback address: anyone who "
                   f"reaches it can read every lock key ({guard})", err=True)  # fmt: skip
    _log_to_stderr()
    try:
        server = make_server(page, address, port)
    except OSError as exc:
        raise click.UsageError(f"cannot listen on {address}:{port}: {exc.strerror}") from None
    host, bound = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"singletask lock page for {page.where} (prefix {page.prefix!r}) at "
               f"http://{shown}:{bound}/" + (" (release allowed)" if allow_release else ""),
               err=True)  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        page.close()


def _log_to_stderr() -> None:
    """Releases and refused attempts (the singletask and singletask.web loggers) to stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("singletask")
    if not root.handlers:
        root.addHandler(handler)
        root.setLevel(logging.INFO)
