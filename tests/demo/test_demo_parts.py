"""The demo's parts, without a worker: the event log, the setup, the timeline and the displays."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kombu import Connection

from singletask.backends.sql.sqlite import SQLiteBackend
from singletask.demo.checks import Limits, closest_starts, most_at_once, problems, spacing_line
from singletask.demo.display import LiveDisplay, PlainDisplay
from singletask.demo.events import Event, EventLog
from singletask.demo.local import Setup
from singletask.demo.scenarios import scenarios
from singletask.demo.timeline import (
    COLUMNS,
    Board,
    Mark,
    Run,
    Style,
    max_overlap,
    render,
    summary_table,
)
from singletask.demo.worker import SQLITE_TABLES, delete_lock_keys
from singletask.protocol.slots import slot_key

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


WRITER = """
import sys
from singletask.demo.events import EventLog
log = EventLog(sys.argv[1])
for n in range(200):
    log.record("start", task_id=f"{sys.argv[2]}-{n}", task="t", key="k" * 50)
"""


def test_event_log_lines_from_concurrent_processes_never_mix(tmp_path: Path) -> None:
    """Four processes appending at once: every line read back is a whole event."""
    # Given four processes writing 200 events each to one log
    path = tmp_path / "events.jsonl"
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w)]) for w in range(4)
    ]
    assert [process.wait(60) for process in writers] == [0, 0, 0, 0]

    # When the log is read
    events = EventLog(path).read_new()

    # Then every event is there, whole
    assert sorted(e.task_id or "" for e in events) == sorted(
        f"{w}-{n}" for w in range(4) for n in range(200)
    )
    assert {e.key for e in events} == {"k" * 50}


def test_event_log_reads_only_new_complete_lines(tmp_path: Path) -> None:
    """A line still being written is read once it is complete, and never twice."""
    # Given a log with one event and half of a second one
    path = tmp_path / "events.jsonl"
    reader = EventLog(path)
    EventLog(path).record("ready")
    with path.open("ab") as file:
        file.write(b'{"kind":"process","t":1.5,')

    # When it is read, then completed and read again
    first = reader.read_new()
    with path.open("ab") as file:
        file.write(b'"pid":42}\n')
    second = reader.read_new()

    # Then each event came once, whole
    assert [e.kind for e in first] == ["ready"]
    assert second == [Event(kind="process", t=1.5, pid=42)]
    assert reader.read_new() == []


def test_a_setup_travels_to_the_worker_through_the_environment(tmp_path: Path) -> None:
    """What the demo exports is what the worker process rebuilds."""
    # Given a setup with servers and one with embedded parts only
    for setup in (
        Setup(tmp_path, "redis://h/0", "redis://h/1", "redis://h/2", "q", "p:"),
        Setup(tmp_path, queue="demo-queue"),
    ):
        # When it goes through environment variables
        again = Setup.from_environ(setup.environ())

        # Then nothing is lost
        assert again == setup
    assert Setup.from_environ({}) is None


def test_the_embedded_setup_keeps_everything_in_its_folder(tmp_path: Path) -> None:
    """No server: broker, results and locks are all in the run's folder."""
    # Given
    setup = Setup(tmp_path)

    # When
    settings = setup.celery_settings()

    # Then
    assert settings["broker_url"] == "filesystem://"
    assert settings["result_backend"] == f"file://{tmp_path}/results"
    assert settings["singletask_backend_url"] == f"sqlite:///{tmp_path}/locks.db"
    options = settings["broker_transport_options"]
    for name in ("data_folder_in", "data_folder_out", "control_folder", "processed_folder"):
        assert Path(options[name]).is_relative_to(tmp_path), name
    assert options["store_processed"] is True  # else consumed messages go to the system's /tmp


@pytest.mark.parametrize(
    ("intervals", "most"),
    [
        ([], 0),
        ([(0.0, 1.0), (1.0, 2.0)], 1),  # one ends as the next starts: not at the same moment
        ([(0.0, 2.0), (1.0, 3.0)], 2),
        ([(0.0, 5.0), (1.0, 2.0), (1.5, 1.6), (3.0, 4.0)], 3),
    ],
)
def test_max_overlap_counts_runs_at_the_same_moment(
    intervals: list[tuple[float, float]], most: int
) -> None:
    assert max_overlap(intervals) == most


def board() -> Board:
    """Two processes: 101 runs key k for 5 s; 102 skips a duplicate at 1 s."""
    board = Board(t0=0.0, rows=[101, 102], labels={"k": "7"}, tasks={"t"})
    board.runs.append(Run("a", 101, "k", 0.0, 5.0))
    board.marks.append(Mark("skip", 102, 1.0, "b", "k", "a"))
    return board


def test_the_timeline_draws_a_run_as_a_bar_and_a_skip_as_a_mark_in_its_process_row() -> None:
    """One row per process; a bar from start to end with the key's character; marks in time."""
    # When
    lines = render(board(), now=10.0, span=10.0, width=80, style=Style())

    # Then the first row holds the bar of key 7, about half the width (5 s of ~10.4 s)
    row = lines[0][lines[0].index("|") + 1 : lines[0].rindex("|")]
    assert lines[0].startswith("    pid 101 |7====")
    assert row.count("=") + 1 == pytest.approx(len(row) * 5 / 10.4, abs=1)
    # And the second row has the skip at about 1 s
    marks = lines[1][lines[1].index("|") + 1 :]
    assert marks.index("s") == pytest.approx(len(row) * 1 / 10.4, abs=1)
    # And the axis is labelled in seconds, aligned under the rows
    assert lines[2].index("+") == lines[0].index("|") + 1
    labels = lines[3].split()
    assert labels[0] == "0s"
    assert all(re.fullmatch(r"\d+(\.\d+)?s", label) for label in labels), labels
    assert [float(label[:-1]) for label in labels] == sorted(float(x[:-1]) for x in labels)
    # And no line is as wide as the terminal (a full line may wrap)
    assert all(len(line) < 80 for line in lines)


def test_a_mark_never_hides_a_run() -> None:
    """A conflict at the same moment as a run in the same process does not cut its bar."""
    # Given a skip drawn over the run of process 101
    drawn = board()
    drawn.marks.append(Mark("skip", 101, 2.0, "c", "k", "a"))

    # When
    row = render(drawn, now=10.0, span=10.0, width=80, style=Style())[0]

    # Then the bar is whole
    assert re.search(r"\|7=+ *\|", row), row


def test_the_live_display_redraws_in_place_and_shows_the_cursor_at_the_end() -> None:
    """On a terminal: the second drawing goes back up over the first; lines never wrap."""
    # Given a live display on a 70-column terminal
    out = io.StringIO()
    display = LiveDisplay(out, Style(unicode=True, color=True), 70)

    # When the timeline is drawn twice, then the display is closed
    display.refresh(board(), 1.0, 10.0, "status")
    first = out.getvalue()
    display._last = 0.0  # the redraw is throttled to 10 per second
    display.refresh(board(), 2.0, 10.0, "status")
    second = out.getvalue()[len(first) :]
    display.close()

    # Then the cursor was hidden, the redraw moved up over the lines drawn first, and shown again
    drawn = first.count("\n")
    assert first.startswith(LiveDisplay.HIDE_CURSOR)
    assert second.startswith(f"\x1b[{drawn}F")
    assert out.getvalue().endswith(LiveDisplay.SHOW_CURSOR)
    for line in ANSI.sub("", out.getvalue()).splitlines():
        assert len(line) < 70, line


def test_the_plain_display_prints_one_line_per_event_without_escape_codes() -> None:
    """In a pipe or a file: progress lines, then the timeline once, all plain text."""
    # Given
    out = io.StringIO()
    display = PlainDisplay(out, Style(), 90)
    drawn = board()

    # When a conflict arrives and the scenario ends
    display.event(drawn, Event("skip", 1.0, 102, task_id="b" * 36, task="demo.t", key="k",
                               holder="a" * 36))  # fmt: skip
    display.end(drawn, 5.0, 10.0, {"7": "t(7)"}, "skip", ["    1 ran, 1 skipped."])

    # Then
    text = out.getvalue()
    assert "pid 102     s t                 bbbbbbbb skipped: lock held by aaaaaaaa" in text
    assert "    pid 101 |7====" in text
    assert "7== t(7)   s skipped" in text
    assert "\x1b" not in text


def test_the_summary_table_leaves_the_task_column_out_when_narrow() -> None:
    rows = [["1 burst", "nightly_report", 8, 1, 7, 0, 0, 1, 1], ["total", "", 8, 1, 7, 0, 0, 1, 1]]
    assert len(rows[0]) == len(COLUMNS)

    wide = summary_table(rows, Style(), 120)
    narrow = summary_table(rows, Style(), 80)

    assert "nightly_report" in "\n".join(wide)
    assert "nightly_report" not in "\n".join(narrow)
    assert all(len(line) < 80 for line in narrow)


def test_the_demo_transport_never_shows_a_message_still_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message appears in the queue folder whole: it is written under a name consumers skip,
    then renamed into place (kombu's own transport writes into the final file, so a consumer
    can read it empty: celery/kombu#1551)."""
    # Given the demo's filesystem transport, watched at the moment a message file is renamed
    folder = tmp_path / "queue"
    folder.mkdir()
    seen: list[tuple[list[str], bytes]] = []
    replace = os.replace

    def watch(source: str, target: str) -> None:
        seen.append((sorted(os.listdir(folder)), Path(source).read_bytes()))
        replace(source, target)

    monkeypatch.setattr(os, "replace", watch)
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder),
               "control_folder": str(tmp_path / "control")}  # fmt: skip
    with Connection(
        "filesystem://", transport="singletask.demo.transport:Transport", transport_options=options
    ) as connection:
        queue = connection.SimpleQueue("demo")

        # When a message is published and the queue read
        queue.put({"n": 1})
        message = queue.get(timeout=5)
        message.ack()
        queue.close()

    # Then, until the complete message was renamed into place, no consumer could see any file
    # of it: the only file in the folder had a name that kombu's consumer skips
    assert len(seen) == 1
    names, content = seen[0]
    assert len(names) == 1
    assert names[0].startswith(".")
    assert not names[0].endswith(".demo.msg")
    assert json.loads(content)["body"]
    # And the consumer got the message, and nothing is left in the folder
    assert message.payload == {"n": 1}
    assert list(folder.iterdir()) == []


KEY = "singletask:demo.export_report:1"


def runs(*spans: tuple[float, float], key: str = KEY) -> list[Run]:
    """Runs of one lock key, each in a holder slot of its own (as lock_limit stores them)."""
    return [Run(f"t{n}", 100 + n, slot_key(key, n), a, b) for n, (a, b) in enumerate(spans)]


def test_runs_of_one_key_within_its_limit_pass_and_one_more_at_once_fails() -> None:
    """Holder slots count as their key: 2 at once is the limit of 2; a third at once is not."""
    # Given two runs of a key at once, then a third that overlaps both, and another key's run
    two = runs((0.0, 1.0), (0.5, 1.5))
    three = runs((0.0, 1.0), (0.5, 1.5), (0.9, 2.0))
    other = runs((0.0, 2.0), key="singletask:demo.export_report:2")

    # When checked against a limit of 2
    # Then two at once pass, also beside another key's run; three at once are reported
    assert most_at_once(two + other) == 2
    assert problems("limit", two + other, Limits(limit=2)) == []
    assert most_at_once(three) == 3
    found = problems("limit", three, Limits(limit=2))
    assert found == [f"limit: 3 runs of lock key {KEY!r} overlapped (at most 2 allowed)"]
    # And a singleton's check is the same one, with a limit of 1
    assert problems("retry", two, Limits()) != []
    assert problems("retry", runs((0.0, 1.0), (1.0, 2.0)), Limits()) == []


def test_a_run_still_going_counts_as_overlapping_everything_after_it() -> None:
    still_running = [Run("a", 1, KEY, 0.0, None), Run("b", 2, KEY, 5.0, 6.0)]
    assert problems("burst", still_running, Limits()) != []


def test_a_replaced_run_may_overlap_the_newer_one_only_until_it_stops() -> None:
    """``lock_policy = "replace"`` (a third of a 0.9 s lease: 0.3 s): a replaced run that ends
    0.2 s after the newer one started passes; one that ends 1 s after is reported, and so are
    three runs of the key at once."""
    within = Limits(replace_within=0.3)
    # Given a run replaced at 1.0, ending at 1.2, then one ending 1 s after its successor began
    quick = [Run("a", 1, KEY, 0.0, 1.2), Run("b", 2, KEY, 1.0, 3.0)]
    slow = [Run("a", 1, KEY, 0.0, 2.0), Run("b", 2, KEY, 1.0, 3.0)]
    three = [Run("a", 1, KEY, 0.0, 2.0), Run("b", 2, KEY, 0.5, 3.0), Run("c", 3, KEY, 0.6, 3.0)]

    # Then the quick stop passes, the slow one and three at once are reported
    assert problems("replace", quick, within) == []
    assert problems("replace", quick, Limits()) != []  # without replace: an overlap
    found = problems("replace", slow, within)
    assert len(found) == 1
    assert "kept running 1.00s after a newer run took its lock over" in found[0]
    assert any("3 runs of lock key" in p for p in problems("replace", three, within))


def test_the_replace_scenario_sends_three_versions_of_one_index_a_third_of_a_run_apart() -> None:
    by_name = {s.name: s for s in scenarios(0.6)}
    replace = by_name["replace"]
    assert [c.args[:2] for c in replace.calls] == [("products", n) for n in (1, 2, 3)]
    assert [c.at for c in replace.calls] == pytest.approx([0.0, 0.2, 0.4])


def test_starts_closer_than_the_rate_interval_fail_beyond_the_slack() -> None:
    """A rate of 4/s: starts 0.25 s apart pass, a little less passes within the slack (20 ms),
    more than the slack less is reported."""
    # Given starts spaced evenly, starts a few ms early, and two starts 0.2 s apart
    even = runs((0.0, 0.1), (0.25, 0.35), (0.5, 0.6))
    early = runs((0.0, 0.1), (0.24, 0.34))
    close = runs((0.0, 0.1), (0.25, 0.35), (0.45, 0.55))
    rate = Limits(limit=3, interval=0.25)

    # Then
    assert problems("rate", even, rate) == []
    assert problems("rate", early, rate) == []
    found = problems("rate", close, rate)
    assert len(found) == 1
    assert "started 0.200s apart" in found[0]
    assert "interval of 0.250s" in found[0]
    assert closest_starts(close) == pytest.approx(0.2)
    assert spacing_line(close, rate).endswith("[TOO CLOSE].")
    assert spacing_line(even, rate).endswith("[ok].")
    # And starts of different keys are not compared
    other = runs((0.1, 0.2), key="singletask:demo.call_partner:other")
    assert problems("rate", even + other, rate) == []
    # And without a rate, starts are not checked at all
    assert problems("rate", close, Limits(limit=3)) == []
    assert spacing_line(close, Limits(limit=3)) == ""


def test_the_timeline_labels_a_holder_slot_with_its_keys_character() -> None:
    drawn = Board(t0=0.0, rows=[101], labels={KEY: "1"}, tasks={"t"})
    assert drawn.label(slot_key(KEY, 1)) == "1"
    assert drawn.label(KEY) == "1"
    assert drawn.label("singletask:other") == "?"


def test_the_limit_and_rate_scenarios_send_a_burst_for_one_key() -> None:
    """The new scenarios: many calls of one key at once (and one of another for the limit)."""
    by_name = {s.name: s for s in scenarios(0.6)}
    assert list(by_name)[-2:] == ["limit", "rate"]
    limit, rate = by_name["limit"], by_name["rate"]
    assert [c.args[0] for c in limit.calls].count(1) == 5
    assert {c.at for c in limit.calls + rate.calls} == {0.0}
    assert len({c.args for c in rate.calls}) == 1


def test_the_sqlite_cleanup_deletes_the_runs_rows_of_every_table_and_only_those(
    tmp_path: Path,
) -> None:
    """Locks, fences, rates and debounce windows with the run's prefix go; others stay."""
    # Given a SQLite store with a row of the run's and a row of someone else's in every table
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    backend = SQLiteBackend.from_url(url)
    backend.release("mine:x", "token")  # a write: it creates the tables (a read creates nothing)
    backend.close()
    import sqlite3

    conn = sqlite3.connect(tmp_path / "locks.db")
    with conn:
        for table in SQLITE_TABLES:
            columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
            for key in ("singletask-demo-1234:k", "theirs:k"):
                values = [key if c == "key" else "1" for c in columns]
                marks = ", ".join("?" * len(columns))
                conn.execute(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})",
                             values)  # fmt: skip

    # When the run's keys are deleted
    deleted = delete_lock_keys(url, "singletask-demo-1234:")

    # Then one row of each table went, and the other rows stayed
    assert deleted == len(SQLITE_TABLES) == 4
    for table in SQLITE_TABLES:
        keys = [row[0] for row in conn.execute(f"SELECT key FROM {table}")]
        assert keys == ["theirs:k"], table
    conn.close()


def test_starts_are_judged_by_the_store_clock_when_the_runs_carry_fences() -> None:
    """The rate promises spacing by the lock store's clock: runs whose fences (its clock at the
    acquire, in microseconds) are far enough apart pass, however late a body wrote its start
    on a loaded host; fences closer than the interval fail, to the millisecond."""
    base = 1_795_000_000_000_000
    late = [
        dataclasses.replace(run, fence=base + i * 250_000)
        for i, run in enumerate(runs((0.0, 0.1), (0.28, 0.38), (0.51, 0.61)))
    ]  # the timeline says 0.23 s apart
    close = [
        dataclasses.replace(run, fence=base + i * 240_000)
        for i, run in enumerate(runs((0.0, 0.1), (0.25, 0.35)))
    ]
    rate = Limits(limit=3, interval=0.25)

    assert problems("rate", late, rate) == []
    assert spacing_line(late, rate).endswith("[ok].")
    found = problems("rate", close, rate)
    assert len(found) == 1
    assert "0.240s apart (by the store's clock)" in found[0]
