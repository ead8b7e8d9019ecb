"""The operator commands: ``locks``, ``inspect`` and ``release`` (see docs/operations.rst).

They run as ``celery -A proj singletask <command>`` (the lock store URL and key prefix come from
the app's settings) and as ``singletask <command> --url URL`` (no app needed). ``--url`` may also
come from the ``SINGLETASK_BACKEND_URL`` environment variable, which keeps a password out of the
process list.

Exit status: 0 done (a listing that finds no lock is done too); 1 refused or nothing found (lock
not held, not held by that task, confirmation declined); 2 usage error (bad option, no store
configured, a store that cannot list its keys); 3 the lock store failed (unreachable, timed out).
Errors are one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn, Protocol, TypeVar, runtime_checkable

import click

from ..backends import backend_from_url
from ..backends.base import LockBackend
from ..backends.urls import mask_url
from ..exceptions import BackendError, ConfigurationError, UnsupportedOperation
from ..ops.inventory import (
    FIELDS,
    LimitRecord,
    LockRecord,
    find_limits,
    find_locks,
    holders_of,
    release_lock,
)
from .base import CONTEXT, store_settings, url_option

__all__ = ["COMMANDS", "STORE_FAILED"]

#: Exit status when the lock store failed (1 and 2 are "refused / nothing" and "usage").
STORE_FAILED = 3


_F = TypeVar("_F", bound=Callable[..., Any])


def _json_option(command: _F) -> _F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(command)


@runtime_checkable
class _Tabled(Protocol):
    """A store that keeps its locks in a table, which may not exist (the SQL stores)."""

    def missing_table(self) -> str | None: ...


class _Store:
    """The lock store a command works on, and how to name it in messages (password masked)."""

    def __init__(self, ctx: click.Context, url: str | None) -> None:
        app = getattr(ctx.obj, "app", None)  # Celery's CLIContext under `celery -A proj`
        url, self.prefix, options = store_settings(app, url, "...")
        assert url is not None  # required: store_settings refuses a missing URL
        # The release is reported on stdout: no second copy of the log line on stderr.
        logging.getLogger("singletask").addHandler(logging.NullHandler())
        self.where = mask_url(url)
        if url.partition("://")[0].lower() == "memory":
            raise click.UsageError(f"{self.where!r} lives inside one process: nothing to see here")
        try:
            self.backend: LockBackend = backend_from_url(url, **options)
        except ConfigurationError as exc:
            raise click.UsageError(str(exc)) from None

    def warn_if_missing(self) -> None:
        """Say on stderr when the store's lock table does not exist (a mistyped ``table``
        option or path, or a store no lock was ever taken in): the listing then reads as
        empty. Creates nothing."""
        if isinstance(self.backend, _Tabled):
            missing = self.backend.missing_table()
            if missing is not None:
                click.echo(
                    f"Warning: {missing} does not exist in {self.where}: no lock was ever taken "
                    "there (is the table or path mistyped?). Nothing was created.",
                    err=True,
                )

    @contextlib.contextmanager
    def session(self) -> Iterator[LockBackend]:
        """Use the backend; a store failure ends the command with one line and status 3."""
        try:
            yield self.backend
        except UnsupportedOperation as exc:
            raise click.UsageError(f"{self.where}: {exc}") from None
        except BackendError as exc:
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            click.echo(f"Error: the lock store failed: {message}", err=True)
            sys.exit(STORE_FAILED)
        finally:
            with contextlib.suppress(Exception):
                self.backend.close()


class _Table:
    """A table printed as it streams: column widths from the first rows, grown as needed."""

    HEADERS: tuple[str, ...] = ("KEY", "SLOT", "TASK", "SCOPE", "STATE", "HOLDER", "HOST", "PID",
                                "ACQUIRED", "LEASE", "FENCE")  # fmt: skip
    BUFFERED = 200

    def __init__(self) -> None:
        self.widths: list[int] | None = None
        self.pending: list[tuple[str, ...]] = []

    @staticmethod
    def row(record: LockRecord) -> tuple[str, ...]:
        acquired = record.acquired_at.strftime("%Y-%m-%dT%H:%M:%SZ") if record.acquired_at else "-"
        lease = f"{record.lease_left:.1f}s" if record.lease_left is not None else "-"
        values = (record.key, record.slot, record.task, record.scope, record.state,
                  record.holder, record.hostname, record.pid, acquired, lease,
                  record.fence)  # fmt: skip
        return _cells(values)

    def add(self, record: LockRecord) -> None:
        self.append(self.row(record))

    def append(self, row: tuple[str, ...]) -> None:
        self.pending.append(row)
        if len(self.pending) >= self.BUFFERED:
            self.flush()

    def flush(self) -> None:
        if self.widths is None:
            self.widths = [0] * len(self.HEADERS)
            self.pending.insert(0, self.HEADERS)
        self.widths = [
            max(width, *(len(row[i]) for row in self.pending))
            for i, width in enumerate(self.widths)
        ]
        for row in self.pending:
            cells = [cell.ljust(width) for cell, width in zip(row, self.widths, strict=True)]
            click.echo("  ".join(cells).rstrip())
        self.pending = []


class _LimitTable(_Table):
    """The named limits: one row per hold (a rate: per start counted in its window)."""

    HEADERS = ("LIMIT", "KIND", "USED", "SIZE", "UNITS", "TASK_ID", "TASK", "LEFT")

    def add_limit(self, record: LimitRecord) -> None:
        kind = record.kind if record.period is None else f"{record.kind}/{_seconds(record.period)}s"
        limit = (record.name, kind, record.used, record.size)
        for hold in record.holds:
            left = f"{hold.ttl:.1f}s" if hold.ttl is not None else None
            self.append(_cells((*limit, hold.units, hold.task_id, hold.task, left)))
        if record.units_not_shown:  # more holds than the store lists
            self.append(_cells((*limit, record.units_not_shown, "(others)", None, None)))


def _seconds(value: float) -> str:
    """``value`` written in full, without trailing zeros: ``60``, ``0.5``, ``2592000``."""
    return f"{value:f}".rstrip("0").rstrip(".")


def _cells(values: Iterable[object]) -> tuple[str, ...]:
    return tuple("-" if value is None else str(value) for value in values)


def _print_json_array(records: Iterable[LockRecord | LimitRecord]) -> int:
    """Print a JSON array, one object per line, as the records stream; return how many."""
    count = 0
    for record in records:
        click.echo(("[\n  " if count == 0 else ",\n  ") + json.dumps(record.as_json()), nl=False)
        count += 1
    click.echo("[]" if count == 0 else "\n]")
    return count


@click.command(context_settings=CONTEXT)
@click.option(
    "--task",
    metavar="NAME",
    help="Only the locks of this task name (--limits: the limits it holds units of).",
)
@click.option(
    "--limit", type=click.IntRange(min=1), metavar="N", help="Show at most N locks (or limits)."
)
@click.option(
    "--prefix",
    metavar="PREFIX",
    help="Key prefix to list (default: the app's singletask_key_prefix, else 'singletask:').",
)
@click.option(
    "--limits",
    "named_limits",
    is_flag=True,
    help="List the named limits in use (singletask_limits) instead of the locks.",
)
@_json_option
@url_option()
@click.pass_context
def locks(
    ctx: click.Context,
    /,
    task: str | None,
    limit: int | None,
    prefix: str | None,
    named_limits: bool,
    as_json: bool,
    url: str | None,
    **kwargs: Any,
) -> None:
    """List every lock and reservation singletask holds (--limits: the named limits in use).

    One row per holder: lock key, holder slot (0, or 1 and above for the other holders of a
    task with lock_limit above 1), task name, scope (execution, queue or coalesce), state
    (running, or reserved for a message not started yet), holder task id, its worker's hostname
    and pid, when it was acquired (UTC), seconds left on its lease, fence token. --json prints a
    JSON array of objects with the fields key, task, scope, state, holder, hostname, pid,
    acquired_at, lease_left, fence, token and slot (see the Operations page). The store is read
    in pages, so this works on large databases without loading them whole (Redis: SCAN, never
    KEYS).

    --limits lists the named limits instead, one row per hold (a rate: per start still counted
    in its window): the limit's name, kind (concurrency, or rate/<period>), units in use (held,
    or started in the current window) and size, then the hold's units, task id, task name and
    seconds left before it stops counting. --task keeps the limits that task holds units of,
    --limit N stops after N limits. --limits --json prints a JSON array of objects with the
    fields name, kind, size, period, used, ttl, holds (each: task_id, task, units, ttl, token)
    and key.

    A SQL store whose lock table (SQLite: database file) does not exist, a mistyped table
    option or path, lists nothing: a warning on stderr says so, and nothing is created.

    Exit status: 0 when the store was read (also when it lists no lock: the JSON is then
    ``[]``; also with the warning above), 2 usage error, 3 the lock store failed.
    """
    store = _Store(ctx, url)
    if named_limits:
        _list_limits(store, task, limit, prefix or store.prefix, as_json)
    with store.session() as backend:
        store.warn_if_missing()
        found = find_locks(backend, prefix or store.prefix, task=task, limit=limit)
        table = _Table()
        count = _print_records(found, as_json, table.add, table.flush)
    what = f" of task {task!r}" if task else ""
    click.echo(
        f"{count} lock{'' if count == 1 else 's'}{what} held under {prefix or store.prefix!r} "
        f"in {store.where}" + (f" (--limit {limit})" if limit and count >= limit else ""),
        err=True,
    )
    sys.exit(0)


def _print_records(
    records: Iterable[Any], as_json: bool, add: Callable[[Any], None], flush: Callable[[], None]
) -> int:
    """Print ``records`` as a JSON array, or as rows of a table (``add`` each, ``flush`` once
    there is one); return how many there were."""
    if as_json:
        return _print_json_array(records)
    count = 0
    for record in records:
        add(record)
        count += 1
    if count:
        flush()
    return count


def _list_limits(
    store: _Store, task: str | None, limit: int | None, prefix: str, as_json: bool
) -> NoReturn:
    """``locks --limits``: print the named limits in use under ``prefix``, and exit 0."""
    with store.session() as backend:
        store.warn_if_missing()
        found = find_limits(backend, prefix, task=task, limit=limit)
        table = _LimitTable()
        count = _print_records(found, as_json, table.add_limit, table.flush)
    what = f" held by task {task!r}" if task else ""
    click.echo(
        f"{count} named limit{'' if count == 1 else 's'} in use{what} under {prefix!r} "
        f"in {store.where}" + (f" (--limit {limit})" if limit and count >= limit else ""),
        err=True,
    )
    sys.exit(0)


@click.command(context_settings=CONTEXT)
@click.argument("key")
@_json_option
@url_option()
@click.pass_context
def inspect(ctx: click.Context, /, key: str, as_json: bool, url: str | None, **kwargs: Any) -> None:
    """Show who holds the lock KEY, since when and for how long still: every holder of it.

    The fields are those of "locks", one block per holder in slot order (a task with lock_limit
    above 1 has up to that many). --json prints one object for a lock with one holder, an array
    of objects for one with several, and null when the lock is free.

    Exit status: 0 when the lock is held, 1 when it is not, 2 usage error, 3 the lock store
    failed.
    """
    store = _Store(ctx, url)
    with store.session() as backend:
        records = holders_of(backend, key)
    if as_json:
        objects = [record.as_json() for record in records]
        click.echo(json.dumps(objects[0] if len(objects) == 1 else objects or None, indent=2))
    else:
        for number, record in enumerate(records):
            if number:
                click.echo("")  # a blank line between two holders
            _print_fields(record)
    if not records:
        click.echo(f"lock {key!r} is not held (in {store.where})", err=True)
        sys.exit(1)


@click.command(context_settings=CONTEXT)
@click.argument("key")
@click.option("--holder", metavar="TASK_ID", help="Release only the holder with this task id.")
@click.option("--force", is_flag=True, help="Release whoever holds the lock (its only holder).")
@click.option("--yes", "-y", is_flag=True, help="With --force: do not ask for confirmation.")
@_json_option
@url_option()
@click.pass_context
def release(
    ctx: click.Context,
    /,
    key: str,
    holder: str | None,
    force: bool,
    yes: bool,
    as_json: bool,
    url: str | None,
    **kwargs: Any,
) -> None:
    """Release the lock KEY: only if task TASK_ID holds it (--holder), or whoever does (--force).

    The release is safe on a live fleet: the next execution starts at once, with a larger
    fencing token, and the old holder's next renewal (within a
    third of its lease) finds the lock gone and reports the loss: a log line naming its task
    id, the lock_lost signal, and LockLost from self.lock.check().

    A lock with several holders (a task with lock_limit above 1): --holder frees the slot of
    that task id and leaves the other holders as they are; --force refuses (it never releases
    several holders at once).

    --force asks for confirmation when run on a terminal, unless --yes; once confirmed it
    releases only the holder it showed (if the lock changed hands meanwhile, nothing is
    released).

    Exit status: 0 released, 1 refused (not held, held by another task id, several holders
    with --force, not confirmed), 2 usage error, 3 the lock store failed.
    """
    if (holder is None) == (not force):
        raise click.UsageError("give exactly one of --holder TASK_ID and --force")
    store = _Store(ctx, url)
    with store.session() as backend:
        current = holders_of(backend, key)
        if force and len(current) > 1:
            _refuse(f"lock {key!r} has {len(current)} holders: release one with --holder TASK_ID")
        if force and current and not yes and _interactive():
            shown = current[0]
            click.echo(f"lock {key!r} is held by {shown.describe()}, fence {shown.fence}")
            if not click.confirm("Release it by force?", default=False):
                _refuse("not released")
            holder = shown.holder  # only the holder shown (None: a direct call, any holder)
            force = holder is None
        target = next((r for r in current if force or r.holder == holder), None)
        released = None
        if target is not None:
            released = release_lock(
                backend, key, holder=None if force else holder, slot=target.slot
            )
        after = [] if released else holders_of(backend, key)
    if released is None:
        if not after:
            _refuse(f"lock {key!r} is not held: nothing released")
        not_by = "" if holder is None else f", not by {holder}"
        _refuse(f"lock {key!r} is held by {_who(after)}{not_by}: not released")
    if as_json:
        click.echo(json.dumps(released.as_json(), indent=2))
        return
    slot = f" (slot {released.slot})" if released.slot else ""
    click.echo(
        f"released lock {key!r}{slot}{' by force' if force else ''}: it was held by "
        f"{released.describe()}, fence {released.fence}. A new execution can take it now; the "
        "old holder reports the lost lease at its next renewal."
    )


def _print_fields(record: LockRecord) -> None:
    """Print ``record`` one field a line, as ``inspect`` shows a holder."""
    fields = record.as_json()
    width = max(len(name) for name in FIELDS) + 2
    for name in FIELDS:
        value = fields[name]
        if name == "lease_left" and value is not None:
            value = f"{value:.1f}s"
        click.echo(f"{name + ':':<{width}}{'-' if value is None else value}")


def _who(records: list[LockRecord]) -> str:
    """The holders of ``records``, in a few words each: ``A``, ``A and B``, ``A, B and C``."""
    named = [record.describe() for record in records]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"


def _interactive() -> bool:
    """Whether a person can answer a question (standard input is a terminal)."""
    return sys.stdin.isatty()


def _refuse(message: str) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(1)


#: The commands, added to the ``singletask`` group (and so to ``celery singletask``).
COMMANDS = (locks, inspect, release)
