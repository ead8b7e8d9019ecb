"""celery-once's File backend (``celery_once.backends.File``), for one host: setting
``location`` (default ``<tmp>/celery_once``); a lock is a file whose age is its time held."""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from ..tasks import AlreadyQueued

__all__ = ["File", "key_to_lock_name"]

#: Longest file name of a lock: part of the key, then its md5.
MAX_LENGTH = 50


def key_to_lock_name(key: str) -> str:
    """The file name of ``key``'s lock: its start, ``_``, its md5 (50 characters at most)."""
    digest = hashlib.md5(key.encode()).hexdigest()
    return key[: MAX_LENGTH - len(digest) - 1] + "_" + digest


class File:
    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.location = settings.get("location") or os.path.join(
            tempfile.gettempdir(), "celery_once"
        )
        try:
            os.makedirs(self.location)
        except OSError as error:
            if error.errno != errno.EEXIST:
                raise

    def _get_lock_path(self, key: str) -> str:
        return os.path.join(self.location, key_to_lock_name(key))

    def raise_or_lock(self, key: str, timeout: float, owner: str | None = None) -> None:
        """Create the key's file, or raise :class:`AlreadyQueued` while it is younger than
        ``timeout``; an older file is taken over (its time restarts)."""
        path = self._get_lock_path(key)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | (os.O_WRONLY if owner else 0))
        except OSError as error:
            if error.errno != errno.EEXIST:
                raise
            left = os.path.getmtime(path) + timeout - time.time()
            if left > 0:
                raise AlreadyQueued(left) from None
            os.utime(path, None)
            if owner is not None:
                with open(path, "w") as handle:
                    handle.write(owner)
            return
        if owner is not None:
            os.write(fd, owner.encode())
        os.close(fd)

    def renew(self, key: str, timeout: float, owner: str | None = None) -> None:
        """Restart the age of ``key``'s file, if it is still there (with ``owner``: naming
        ``owner``). singletask's addition: the lock of a running task is a lease."""
        path = self._get_lock_path(key)
        try:
            if owner is not None:
                with open(path) as handle:
                    if handle.read() != owner:
                        return
            os.utime(path, None)
        except FileNotFoundError:
            return

    def clear_lock(self, key: str, owner: str | None = None) -> None:
        """Remove the key's file (with ``owner``: only while it names ``owner``)."""
        path = self._get_lock_path(key)
        if owner is not None:
            try:
                with open(path) as handle:
                    if handle.read() != owner:
                        return
            except FileNotFoundError:
                return
        os.remove(path)
