"""What an example program in ``examples/`` needs: :func:`configure` its app, and
:func:`run_example`, the whole of its ``if __name__ == "__main__":`` block.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from celery import signals as celery_signals

from ..backends.urls import mask_url
from .local import DemoError, Setup, configure
from .worker import WorkerProcess, interrupt_on_sigterm, tidy_up_servers

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["configure", "run_example"]


def _redis_url(value: str) -> str:
    if not re.match(r"(redis|rediss|unix)://", value):
        raise argparse.ArgumentTypeError(
            f"expected a redis://, rediss:// or unix:// URL, got {mask_url(value)!r}"
        )
    return value


def run_example(
    file: str,
    app: Celery,
    main: Callable[[], None],
    *,
    argv: Sequence[str] | None = None,
    concurrency: int = 3,
    beat: bool = False,
    show_worker_log: Callable[[str], bool] | None = None,
) -> None:
    """Run an example: a worker for the module ``file`` defines ``app`` in, then ``main()``.

    Command line: ``--redis-url URL`` puts the broker, the results and the locks in that Redis
    database instead of the embedded parts. ``beat`` runs Celery beat inside the worker (``-B``).
    ``show_worker_log`` selects worker log lines to print while ``main()`` runs.
    Exits with status 130 on Ctrl-C, after stopping the worker and deleting its folder.
    """
    path = Path(file).resolve()
    parser = argparse.ArgumentParser(
        prog=path.name, description=(sys.modules["__main__"].__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--redis-url",
        type=_redis_url,
        metavar="URL",
        help="use this Redis database (e.g. redis://localhost:6379/0) for the broker, the "
        "results and the locks, instead of the embedded parts",
    )
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix=f"singletask-{path.stem}-"))
    sent: list[str] = []
    setup = Setup(
        folder,
        broker=args.redis_url,
        backend=args.redis_url,
        locks=args.redis_url,
        queue=f"{path.stem}-{uuid.uuid4().hex[:8]}",
    )
    try:
        with interrupt_on_sigterm():
            setup.prepare()
            configure(app, setup)
            celery_signals.after_task_publish.connect(
                lambda headers=None, **_: sent.append((headers or {}).get("id", "")), weak=False
            )
            for what, where in setup.describe():
                print(f"{what:>8}: {where}")
            extra = ["-B", "-s", str(folder / "beat-schedule")] if beat else []
            worker = WorkerProcess(
                path.stem, setup, concurrency=concurrency, cwd=path.parent, extra_args=extra
            )
            print(f"{'worker':>8}: {' '.join(worker.command[2:8])} ...", flush=True)
            follower = None
            try:
                with worker:
                    print(f"{'':>8}  ready after {worker.startup_seconds:.1f} s\n", flush=True)
                    if show_worker_log is not None:
                        follower = _LogFollower(worker.log, show_worker_log)
                    main()
                    print("\nStopping the worker (warm shutdown) ...", flush=True)
            finally:
                if follower is not None:
                    follower.stop()  # after the worker stopped: its last lines are shown too
            tidy_up_servers(app, setup, [s for s in sent if s])
    except KeyboardInterrupt:
        print("\nInterrupted: the worker is stopped and its folder deleted.", file=sys.stderr)
        raise SystemExit(130) from None
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


#: A task id: log lines show its first 8 characters.
TASK_ID = re.compile(r"\b([0-9a-f]{8})-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


class _LogFollower:
    """Print the worker log lines ``select`` accepts, as they are written (like ``tail -f``)."""

    PREFIX = re.compile(r"^\[[^\]]*?: \w+/(?P<process>[^\]]+)\] ")

    def __init__(self, log: Path, select: Callable[[str], bool]) -> None:
        self.log = log
        self.select = select
        self.offset = log.stat().st_size if log.exists() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        partial = ""
        while True:
            stopping = self._stop.wait(0.1)
            with self.log.open("r", errors="replace") as file:
                file.seek(self.offset)
                chunk = file.read()
                self.offset = file.tell()
            *lines, partial = (partial + chunk).split("\n")
            for line in lines:
                if self.select(line):
                    line = TASK_ID.sub(r"\1", self.PREFIX.sub(r"\g<process>: ", line))
                    print(f"  worker| {line}", flush=True)
            if stopping:
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
