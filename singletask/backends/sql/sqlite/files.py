"""The SQLite lock store's file: its URL, the filesystems it refuses, and the tables in it.

Private to :mod:`singletask.backends.sql.sqlite`.
"""

from __future__ import annotations

from pathlib import Path

from ....exceptions import ConfigurationError
from ...urls import mask_url, query_options
from .. import replaced
from . import units, windows

__all__ = [
    "LIMITS", "NETWORK_FILESYSTEMS", "SCHEMA", "filesystem_type", "path_from_url",
    "timeout_from_url",
]  # fmt: skip

#: Filesystem types on which SQLite's file locking cannot be trusted.
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smbfs", "smb3", "fuse.sshfs", "9p", "afs", "ceph", "glusterfs"}
)

#: The tables, created by the first write to a file (a read creates nothing).
SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS singletask_locks (
        key TEXT PRIMARY KEY,
        token TEXT NOT NULL,
        expires_at REAL NOT NULL,
        meta TEXT NOT NULL,
        fence INTEGER NOT NULL
    )
    """,
    # Per key: the last fencing token, the completion marker and the pending follow-up, kept
    # core.FENCE_RETENTION seconds after the last use.
    """
    CREATE TABLE IF NOT EXISTS singletask_fences (
        key TEXT PRIMARY KEY,
        fence INTEGER NOT NULL,
        done TEXT,
        next TEXT,
        next_until REAL,
        touched REAL NOT NULL
    )
    """,
    *windows.SCHEMA,
    *replaced.SQLITE_SCHEMA,
    *units.SCHEMA,
)

LIMITS = (
    "the sqlite:// lock backend serves the worker processes of one host, from a database file "
    "on a local filesystem"
)


def path_from_url(url: str) -> Path:
    shown = mask_url(url)
    if url.split("?", 1)[0] in ("sqlite:", "sqlite://"):
        url = "sqlite:///:memory:"  # SQLAlchemy's spelling of an in-memory database
    if not url.startswith("sqlite:///"):
        raise ConfigurationError(
            f"{shown!r}: a SQLite lock URL looks like sqlite:///relative/locks.db or "
            f"sqlite:////absolute/locks.db ({LIMITS})"
        )
    raw = url[len("sqlite:///") :].split("?", 1)[0]
    if raw in ("", ":memory:"):
        raise ConfigurationError(
            f"{shown!r}: an in-memory SQLite database is private to one process; {LIMITS}. "
            "For in-process locks use memory://"
        )
    return Path(raw).expanduser()


def timeout_from_url(url: str) -> dict[str, float]:
    """The ``timeout`` query option of a SQLite URL, checked, as keyword arguments."""
    options = query_options(url, {"timeout"})
    if "timeout" not in options:
        return {}
    try:
        timeout = float(options["timeout"])
    except ValueError:
        timeout = -1.0
    if not 0 < timeout <= 3600:
        raise ConfigurationError(
            f"{mask_url(url)!r}: timeout must be a number of seconds above 0 and at most 3600"
        )
    return {"timeout": timeout}


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` (Linux only; None when unknown)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best, kind = "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mountpoint = parts[1].replace("\\040", " ")
        inside = target == mountpoint or target.startswith(mountpoint.rstrip("/") + "/")
        if inside and len(mountpoint) >= len(best):
            best, kind = mountpoint, parts[2]
    return kind
