"""``singletask demo``: start a real prefork worker, play the scenarios, show and check them.

The demo runs in a temporary folder of its own: the embedded broker, results and locks (unless
servers are given), the event log and the worker's log. Whatever happens, it stops its worker
and deletes that folder before it exits; on Ctrl-C (or SIGTERM) too, with exit status 130.
Its exit status is 0 when singletask behaved as documented, 1 when not (for instance when two
runs of one lock key overlapped), with the reasons printed.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .. import __version__
from ..conf.runtime import lock_options
from ..exceptions import SingletaskError, TaskLocked
from ..protocol.slots import base_key
from ..result import Skipped
from .checks import Limits, problems
from .display import LiveDisplay, PlainDisplay, clock, short
from .events import EventLog
from .local import DemoError, Setup, configure
from .report import Played, Sent, report_lines, summary
from .scenarios import Call, Scenario, scenarios
from .timeline import Board, Style
from .worker import WorkerProcess, interrupt_on_sigterm, tidy_up_servers

__all__ = ["DemoOptions", "run_demo"]

#: Seconds a run works, in the normal and the quick variant.
WORK, QUICK_WORK = 1.5, 0.6
#: Seconds a scenario may take beyond its plan before the missing outcomes count as failures.
PATIENCE = 60.0
TERMINAL = frozenset({"end", "skip", "raise"})


@dataclass(frozen=True)
class DemoOptions:
    """What ``singletask demo`` was asked for (see ``singletask demo --help``)."""

    quick: bool = False
    broker: str | None = None
    backend: str | None = None
    locks: str | None = None
    concurrency: int = 4
    #: None: colours on a terminal unless ``NO_COLOR`` is set.
    color: bool | None = None
    #: None: the live view on a terminal, plain lines elsewhere.
    live: bool | None = None


def _style_and_display(options: DemoOptions, out: TextIO) -> PlainDisplay:
    tty = out.isatty()
    columns = shutil.get_terminal_size((100, 24)).columns
    # On a terminal narrower than the timeline, redrawing in place would not work: lines wrap.
    live = (tty and columns >= 60) if options.live is None else options.live
    color = (tty and not os.environ.get("NO_COLOR")) if options.color is None else options.color
    unicode = live and (getattr(out, "encoding", "") or "").lower().replace("-", "") == "utf8"
    width = max(60, min(120, columns))
    style = Style(unicode=unicode, color=color)
    return LiveDisplay(out, style, width) if live else PlainDisplay(out, style, width)


def run_demo(options: DemoOptions, out: TextIO | None = None) -> int:
    """Run the demo; return the exit status (0 as documented, 1 not, 130 interrupted)."""
    out = out if out is not None else sys.stdout
    display = _style_and_display(options, out)
    folder = Path(tempfile.mkdtemp(prefix="singletask-demo-"))
    try:
        with interrupt_on_sigterm():
            return _run(options, folder, display)
    except KeyboardInterrupt:
        return 130
    except DemoError as exc:
        display.close()
        display.text(f"error: {exc}")
        return 1
    finally:
        display.close()
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            display.text(f"Cleaned up: no worker left running, {folder} deleted.")
        if display.closed_pipe:
            # Nobody reads any more: let Python's final flush of stdout go nowhere, quietly.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())


def _run(options: DemoOptions, folder: Path, display: PlainDisplay) -> int:
    run_id = uuid.uuid4().hex[:8]
    setup = Setup(
        folder,
        broker=options.broker,
        backend=options.backend,
        locks=options.locks,
        queue=f"singletask-demo-{run_id}",
        # A lock store of yours: keys of this run's own.
        key_prefix=f"singletask-demo-{run_id}:" if options.locks else None,
    )
    setup.prepare()
    from .app import app

    configure(app, setup)
    importlib.import_module("singletask.demo.tasks")  # registers the demo's tasks with the app
    sent_ids: list[str] = []
    title = f"singletask {__version__} demo: duplicate Celery tasks on a real prefork worker"
    display.text(display.style.paint(title, "1"))
    for what, where in setup.describe():
        display.text(f"  {what:<8} {where}")
    if setup.key_prefix is not None:
        display.text(f"  {'':<8} (lock keys of this run: {setup.key_prefix}*)")
    display.text(f"  {'folder':<8} {folder} (deleted at exit)")
    _check_servers(app, setup)

    with contextlib.ExitStack() as stack:
        stack.callback(app.close)
        stack.callback(tidy_up_servers, app, setup, sent_ids)
        worker = WorkerProcess(
            "singletask.demo.app", setup, concurrency=options.concurrency, cwd=folder
        )
        display.text(f"  {'worker':<8} {' '.join(worker.command[2:10])} ...")
        stack.enter_context(worker)
        stack.callback(display.text, "Stopping the worker (warm shutdown) ...")
        pool = ", ".join(map(str, worker.pool))
        display.text(
            f"  {'':<8} ready in {worker.startup_seconds:.1f}s: pid {worker.pid}, "
            f"pool processes {pool}"
        )
        display.text()
        display.para(
            "Each timeline has one row per worker process; time runs left to right. A bar is a "
            "run holding its lock, drawn with the character of its lock key."
        )
        display.text()
        events = EventLog(setup.events)
        events.read_new()  # the worker's start-up
        work = QUICK_WORK if options.quick else WORK
        playable = [s for s in scenarios(work) if s.task in app.tasks]
        for scenario in [s for s in scenarios(work) if s not in playable]:
            display.para(f"Left out: {scenario.title.lower()}: this lock store does not keep "
                         f"what the options of {scenario.task} need.")  # fmt: skip
        try:
            played = [
                _play(number, scenario, app, worker, events, display, sent_ids)
                for number, scenario in enumerate(playable, 1)
            ]
        except KeyboardInterrupt:
            display.close()
            display.text()
            display.text("Interrupted. (Ctrl-C again stops the worker at once, with SIGKILL.)")
            raise
        return summary(played, display)


def _check_servers(app: Any, setup: Setup) -> None:
    """Fail early, with a clear message, when a server that was given does not answer."""
    if setup.broker is not None:
        try:
            with app.connection_for_write() as connection:
                connection.ensure_connection(max_retries=1, timeout=5)
        except Exception as exc:
            raise DemoError(f"cannot reach the broker at {setup.describe()[0][1]}: {exc}") from exc
    if setup.backend is not None:
        try:
            _ = app.AsyncResult("singletask-demo-check").state  # one read
        except Exception as exc:
            raise DemoError(
                f"cannot reach the result backend at {setup.describe()[1][1]}: {exc}"
            ) from exc
    if setup.locks is not None:
        from ..backends import backend_from_url

        try:
            with backend_from_url(setup.lock_url) as backend:
                backend.holder(f"{setup.key_prefix or 'singletask:'}demo-check")
        except SingletaskError as exc:
            raise DemoError(f"cannot use the lock store: {exc}") from exc


def _play(
    number: int,
    scenario: Scenario,
    app: Any,
    worker: WorkerProcess,
    events: EventLog,
    display: PlainDisplay,
    sent_ids: list[str],
) -> Played:
    keys = [app.tasks[call.task].lock_key_for(call.args) for call in scenario.calls]
    board = Board(
        t0=0.0,
        rows=list(worker.pool),
        labels={key: call.label for key, call in zip(keys, scenario.calls, strict=True)},
        tasks={scenario.task},
    )
    labels = {call.label: call.text for call in scenario.calls}
    options = lock_options(app.tasks[scenario.task])
    within = options.ttl / 3 if options.policy == "replace" else None
    played = Played(scenario, board, [], Limits(options.limit, options.rate_interval, within))
    display.begin(number, scenario)
    pending = sorted(zip(scenario.calls, keys, strict=True), key=lambda pair: pair[0].at)
    finished: set[str] = set()
    board.t0 = time.time()
    while True:
        now = time.time() - board.t0
        batch: list[Call] = []
        while pending and pending[0][0].at <= now:
            call, key = pending.pop(0)
            result = app.tasks[call.task].apply_async(call.args)
            sent_ids.append(result.id)
            played.sent.append(Sent(call, result.id, key, result))
            batch.append(call)
        if batch:
            display.sent(board, now, batch)
        for event in sorted(events.read_new(), key=lambda e: e.t):
            if board.add(event):
                display.event(board, event)
                if event.kind in TERMINAL and event.task_id:
                    finished.add(event.task_id)
        if not pending and all(s.task_id in finished for s in played.sent):
            break
        if not worker.alive():
            raise DemoError(f"the worker stopped:\n{worker.tail()}")
        if now > scenario.span + PATIENCE:
            played.problems.append(f"{scenario.name}: some calls had not ended after {now:.0f}s")
            break
        running = sum(1 for run in board.runs if run.end is None)
        status = (
            f"   {clock(now)}   sent {len(played.sent)}/{len(scenario.calls)}   "
            f"running {running}   ended {len(finished)}/{len(scenario.calls)}"
        )
        display.refresh(board, now, scenario.span, status)
        time.sleep(0.02)
    now = time.time() - board.t0
    _collect(played)
    display.end(board, now, scenario.span, labels, scenario.policy, report_lines(played))
    return played


def _collect(played: Played) -> None:
    """Fetch what each caller got, classify it, and check it against the timeline."""
    ran_ids = {(r.task_id, base_key(r.key)) for r in played.board.runs if r.end is not None}
    for sent in played.sent:
        try:
            sent.value = sent.result.get(timeout=15, interval=0.05, propagate=False)
        except Exception as exc:
            sent.value = exc
        value = sent.value
        if isinstance(value, dict) and "pid" in value:
            sent.outcome = "ran"
            if (sent.task_id, sent.key) not in ran_ids:
                played.problems.append(f"{short(sent.task_id)} returned, but never ran")
            if value.get("retries"):
                played.problems.append(f"{short(sent.task_id)}: lock retries spent its retries")
        elif isinstance(value, Skipped | TaskLocked):
            sent.outcome = "skipped" if isinstance(value, Skipped) else "raised"
            rated = isinstance(value, Skipped) and value.reason == "rate"  # no holder to name
            if not rated and (value.holder, sent.key) not in ran_ids:
                played.problems.append(
                    f"{short(sent.task_id)} names {short(value.holder)} as the holder of its "
                    "lock, but that run was not seen holding it"
                )
        else:
            played.problems.append(
                f"{sent.call.text} [{short(sent.task_id)}] ended with {value!r} "
                f"(state {sent.result.state})"
            )
    played.problems += problems(played.scenario.name, played.board.runs, played.limits)
    ended = sum(1 for run in played.board.runs if run.end is not None)
    # A run that a newer one replaced ran too, and returned a Skipped naming the newer one.
    ran = played.count("ran") + played.replaced
    if ended != ran:
        played.problems.append(
            f"{played.scenario.name}: {ended} runs in the event log, {ran} results from runs"
        )
