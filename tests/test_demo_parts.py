"""The demo's parts, without a worker: the event log, the setup, the timeline and the displays."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kombu import Connection

from singletask.demo.display import LiveDisplay, PlainDisplay
from singletask.demo.events import Event, EventLog
from singletask.demo.local import Setup
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
