"""An append-only JSON-lines file: how worker processes tell the demo what happened.

Task bodies, the :data:`~singletask.signals.lock_conflict` signal and the worker's start-up
signals each append one line; the demo reads the new lines as they come. Each line is written
with a single ``write()`` on a file opened with ``O_APPEND``, so lines from concurrent processes
do not interleave, and nothing but the file system is needed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Event", "EventLog"]


@dataclass(frozen=True)
class Event:
    """One line of the log.

    Attributes:
        kind: ``"process"`` (a pool process started), ``"ready"`` (the worker consumes),
            ``"start"`` / ``"end"`` (a task body), or the action a locked-out execution took:
            ``"skip"``, ``"retry"``, ``"raise"``.
        t: When, as ``time.time()`` in the writing process (one clock: one host).
        pid: The writing process.
        task_id: The execution's task id, for task events.
        task: The task name, for task events.
        key: The lock key, for task events.
        holder: For a conflict, the task id of the execution that held the lock.
        fence: For a start, the fencing token of the run's lock (the store's clock at its
            acquire, in microseconds, on the built-in stores), when it has one.
    """

    kind: str
    t: float
    pid: int
    task_id: str | None = None
    task: str | None = None
    key: str | None = None
    holder: str | None = None
    fence: int | None = None

    @classmethod
    def from_json(cls, line: str) -> Event:
        data: dict[str, Any] = json.loads(line)
        return cls(
            kind=str(data["kind"]),
            t=float(data["t"]),
            pid=int(data["pid"]),
            task_id=data.get("task_id"),
            task=data.get("task"),
            key=data.get("key"),
            holder=data.get("holder"),
            fence=int(data["fence"]) if data.get("fence") is not None else None,
        )


class EventLog:
    """Write events from any process of this host; read the new ones from one."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def record(self, kind: str, **fields: str | int | None) -> None:
        """Append one event, stamped with the time and this process's pid."""
        data = {"kind": kind, "t": time.time(), "pid": os.getpid(), **fields}
        line = (json.dumps(data, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def read_new(self) -> list[Event]:
        """The events appended since the last call (complete lines only)."""
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        return [Event.from_json(line.decode()) for line in lines if line.strip()]
