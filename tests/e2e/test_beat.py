"""A real ``celery beat`` ticking a singleton faster than it runs, with the real worker.

Beat sends a tick every second (``--max-interval 1``, schedule file in a temporary directory)
with the recipe's ``options={"expires": 1}``; each run of the job takes longer than several
periods. The ticks that arrive during a run must never run alongside it, must never crash
beat, and must not stop the ticks after the run from running.

Runs on the Redis broker only: beat publishes the same way on every broker, and the other
e2e modules already cover RabbitMQ; this keeps the suite short.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .beat_app import BEAT_ENV
from .conftest import Cluster
from .test_scopes import key_of, label, runs, wait_until, worker_conflicts

__all__ = ["label"]  # the fixture, shared with test_scopes.py

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.parametrize("cluster", ["redis"], indirect=True),
]

PERIOD = 1.0


class Beat:
    """A ``celery beat`` subprocess (its own process group) and its log file."""

    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        self.process = process
        self.log = log

    def alive(self) -> bool:
        return self.process.poll() is None

    def lines(self, *needles: str) -> list[str]:
        text = self.log.read_text(errors="replace")
        return [line for line in text.splitlines() if all(n in line for n in needles)]

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_beat(cluster: Cluster, workdir: Path, task: str, args: list[object]) -> Iterator[Beat]:
    """Run ``celery beat`` ticking ``task(*args)`` every PERIOD seconds; stop it on exit."""
    entry = {"task": task, "args": args, "every": PERIOD}
    env = {**cluster.worker.env, BEAT_ENV: json.dumps(entry)}
    command = [
        sys.executable, "-m", "celery", "-A", "tests.e2e.beat_app", "beat",
        "-s", str(workdir / "beat-schedule"), "--max-interval", "1", "-l", "INFO",
    ]  # fmt: skip
    log = workdir / "beat.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    beat = Beat(process, log)
    try:
        yield beat
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def finish_runs(cluster: Cluster, label: str) -> list[tuple[str, str]]:
    """Wait until every run that started has ended; return the runs (see ``runs``)."""

    def settled() -> list[tuple[str, str]] | None:
        events = runs(cluster, label)
        starts = sum(1 for event, _ in events if event == "start")
        return events if starts == len(events) - starts else None

    return wait_until(settled, "the last run to end", timeout=15)


def test_ticks_during_a_long_run_are_skipped_and_never_crash_beat(
    cluster: Cluster, label: str, tmp_path: Path
) -> None:
    # Given a job that runs for 3.5 s (execution scope, skip), ticked by beat every second
    key = key_of(cluster, "beat_skip", label, 3.5)
    with running_beat(cluster, tmp_path, "e2e.scopes.beat_skip", [label, 3.5]) as beat:
        # When beat has ticked for about 9 s since the first run started
        first = cluster.probe.wait_for(label, "start", timeout=20)[0]
        while time.time() < first["t"] + 9:
            assert beat.alive(), f"beat exited:\n{beat.tail()}"
            time.sleep(0.2)

        # Then beat is still running
        assert beat.alive(), f"beat exited:\n{beat.tail()}"
        assert beat.lines("Scheduler: Sending due task")
    events = finish_runs(cluster, label)

    # And no two runs ever overlapped: each started after the previous one ended
    assert cluster.probe.max_overlap(label) == 1
    run_ids = [task_id for event, task_id in events if event == "start"]
    assert events == [(event, task_id) for task_id in run_ids for event in ("start", "end")]
    # And the ticks during a run were skipped by the worker, naming the run in progress
    skipped = [e for e in worker_conflicts(cluster, label) if e["action"] == "skip"]
    assert len(skipped) >= 2, f"skips: {skipped}"
    assert {event["holder"] for event in skipped} <= set(run_ids)
    assert set(run_ids).isdisjoint(event["task_id"] for event in skipped)
    # And the ticks resumed after each run: at least two runs, the next starting within a few
    # periods of the previous end
    assert len(run_ids) >= 2, events
    probe_events = cluster.probe.events(label)
    ends = [e["t"] for e in probe_events if e["event"] == "end"]
    starts = [e["t"] for e in probe_events if e["event"] == "start"]
    for previous_end, next_start in zip(ends, starts[1:], strict=False):
        assert 0 <= next_start - previous_end < 4 * PERIOD
    cluster.wait_free(key)


def test_a_queue_scope_tick_that_meets_task_locked_in_beat_is_logged_and_beat_keeps_ticking(
    cluster: Cluster, label: str, tmp_path: Path
) -> None:
    # Given a job that runs for 2.5 s with lock_scope "queue" and policy "raise", ticked by beat
    key = key_of(cluster, "beat_queue_raise", label, 2.5)
    with running_beat(cluster, tmp_path, "e2e.scopes.beat_queue_raise", [label, 2.5]) as beat:
        # When a tick meets the running job in beat's own apply_async
        cluster.probe.wait_for(label, "start", timeout=20)
        locked = wait_until(
            lambda: beat.lines("Couldn't apply scheduled task", "is held by task"),
            "beat to log a tick that met TaskLocked",
        )
        started = len(cluster.probe.starts(label))

        # Then beat logs the TaskLocked (and singletask its WARNING) for the key
        assert all(key in line for line in locked), locked
        assert beat.lines("WARNING", "not sent", key, "raising TaskLocked")
        # And beat keeps ticking: a later tick runs, and beat is still alive
        cluster.probe.wait_for(label, "start", count=started + 1, timeout=10)
        assert beat.alive(), f"beat exited:\n{beat.tail()}"
    events = finish_runs(cluster, label)

    # And runs never overlapped, and no duplicate reached the worker: beat stopped them all
    assert cluster.probe.max_overlap(label) == 1
    assert worker_conflicts(cluster, label) == []
    assert len([event for event, _ in events if event == "start"]) >= 2
    cluster.wait_free(key)


def test_debounced_ticks_collapse_into_runs_at_most_debounce_max_apart(
    cluster: Cluster, label: str, tmp_path: Path
) -> None:
    """Beat ticks every second a job debounced by 1.5 s, at most 3 s (so never quiet long
    enough by itself): the ticks collapse, yet it runs about every 3 s, and each tick's expires
    (one period, the recipe's) moves with its wait instead of dropping every tick."""
    with running_beat(cluster, tmp_path, "e2e.limits.rebuild_slow", [label, 0]) as beat:
        first = cluster.probe.wait_for(label, "start", timeout=20)[0]
        while time.time() < first["t"] + 7:
            assert beat.alive(), f"beat exited:\n{beat.tail()}"
            time.sleep(0.2)
        ticks = len(beat.lines("Scheduler: Sending due task"))
    finish_runs(cluster, label)

    runs_started = cluster.probe.starts(label)
    assert 2 <= len(runs_started) < ticks / 2, (len(runs_started), ticks)
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(runs_started)]
    assert all(gap < 3.0 + 2 * PERIOD for gap in gaps), gaps
    assert cluster.probe.max_overlap(label) == 1
