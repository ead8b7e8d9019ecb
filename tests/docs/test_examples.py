"""The programs in examples/ run as their docstrings say, with nothing installed but Python.

Each example starts a prefork worker for its own module on the embedded parts (filesystem broker,
file results, SQLite locks), sends its tasks and prints what came back; ``--redis-url`` puts all
three in a Redis database instead. They all run at once here, to keep the suite short.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from ..servers import unavailable

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["feed_importer", "customer_sync", "periodic_sync", "prometheus_metrics"]
REDIS_DB = 13  # a database no other test module uses

Outputs = dict[str, "subprocess.CompletedProcess[str] | str"]


@pytest.fixture(scope="module")
def outputs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    """Every example on the embedded parts, and customer_sync on Redis, run at the same time."""
    tmp = tmp_path_factory.mktemp("examples")
    commands = {name: [f"examples/{name}.py"] for name in EXAMPLES}
    found: Outputs = {}
    try:
        url = f"{request.getfixturevalue('redis_base_url')}/{REDIS_DB}"
        with redis.Redis.from_url(url) as client:
            client.ping()
    except (pytest.skip.Exception, redis.RedisError) as exc:
        found["redis"] = f"no Redis server for the test session: {exc}"
    else:
        commands["redis"] = ["examples/customer_sync.py", "--redis-url", url]
        found["redis_url"] = url
    processes = {}
    for name, args in commands.items():
        tmpdir = tmp / name
        tmpdir.mkdir()
        processes[name] = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env={**os.environ, "TMPDIR": str(tmpdir), "PYTHONDONTWRITEBYTECODE": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, process in processes.items():
        try:
            stdout, stderr = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        found[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        left = list((tmp / name).iterdir())
        assert left == [], f"{name} left {left} in its temporary folder"
    return found


def ran(outputs: Outputs, name: str) -> str:
    """The example's output, after checking that it exited with status 0."""
    done = outputs[name]
    if isinstance(done, str):
        unavailable(done)
        return ""
    assert done.returncode == 0, f"{name}: status {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_feed_importer_skips_a_second_import_of_the_same_feed(outputs: Outputs) -> None:
    """Two imports of one URL at once: one imports, the other is skipped naming it."""
    # Given / When: news, blog and news again, sent at once
    output = ran(outputs, "feed_importer")

    # Then the blog was imported, and of the two news imports one ran and one was skipped
    assert "imported https://example.org/blog.rss" in output
    news = re.findall(r"import_feed\('https://example.org/news.rss'\) \[(\w+)\]: (.*)", output)
    assert len(news) == 2, output
    (ran_id, _), (_, skipped) = sorted(news, key=lambda n: n[1].startswith("skipped"))
    assert skipped.startswith("skipped, already being imported by task " + ran_id), output
    # And the key it printed is the readable one the task declares
    assert "singletask:feed_importer.import_feed:feed:https://example.org/news.rss" in output


def customer_runs(output: str) -> dict[str, list[tuple[float, float]]]:
    runs: dict[str, list[tuple[float, float]]] = {}
    pattern = r"sync_customer\((\d)\) \[\w+\]: ran from \+([\d.]+)s to \+([\d.]+)s"
    for customer, start, end in re.findall(pattern, output):
        runs.setdefault(customer, []).append((float(start), float(end)))
    return runs


def test_customer_sync_runs_one_customer_at_a_time_and_loses_no_call(outputs: Outputs) -> None:
    """Customer 1 twice and customer 2 once: all three run, customer 1's one after the other."""
    # Given / When
    output = ran(outputs, "customer_sync")

    # Then every call ran (the retry policy drops none)
    runs = customer_runs(output)
    assert sorted((c, len(r)) for c, r in runs.items()) == [("1", 2), ("2", 1)], output
    # And the second run of customer 1 started when the first had ended
    first, second = sorted(runs["1"])
    assert second[0] >= first[1], output


def test_periodic_sync_skips_the_ticks_that_come_while_it_runs(outputs: Outputs) -> None:
    """Beat every second, a run takes 2.5 s: the worker log shows runs and skipped ticks."""
    # Given / When
    output = ran(outputs, "periodic_sync")

    # Then at least one sync ran to its end, and ticks were skipped while one was running
    assert re.search(r"sync_inventory\[\w{8}\] succeeded in [\d.]+s: 'inventory synced'", output)
    assert re.search(r"sync_inventory\[\w{8}\] skipped: lock 'singletask:periodic_sync", output)


def metric(output: str, name: str, **labels: str) -> float | None:
    """The value of one sample the prometheus_metrics example printed (None when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^  {re.escape(name)}\{{{re.escape(wanted)}\}} (\S+)$", output, re.M)
    return float(found.group(1)) if found else None


def test_prometheus_metrics_counts_every_lock_outcome(outputs: Outputs) -> None:
    """The metrics recipe on a prefork worker: the exporter sums what every pool process
    counted: acquisitions, skips, retries, raises, a lost lease and an operator's forced release;
    and each skip, retry and raise is in the worker log at INFO or above, with key and holder."""
    # Given / When: 2 reindexes (retry), 3 reports (skip), 2 exports (raise) at once, then a
    # long job whose lock is released by force
    output = ran(outputs, "prometheus_metrics")
    task = "prometheus_metrics.{}".format

    # Then the exporter counted each outcome
    assert metric(output, "singletask_lock_acquired_total", task=task("report")) == 1, output
    assert metric(output, "singletask_lock_acquired_total", task=task("export")) == 1, output
    assert metric(output, "singletask_lock_acquired_total", task=task("reindex")) == 2, output
    assert metric(output, "singletask_lock_acquired_total", task=task("long_job")) == 1, output
    conflicts = "singletask_lock_conflicts_total"
    assert metric(output, conflicts, action="skip", task=task("report")) == 2, output
    assert metric(output, conflicts, action="raise", task=task("export")) == 1, output
    assert (metric(output, conflicts, action="retry", task=task("reindex")) or 0) >= 1, output
    assert metric(output, "singletask_lock_lost_total", task=task("long_job")) == 1, output
    released = "singletask_lock_released_by_operator_total"
    assert metric(output, released, forced="true", task=task("long_job")) == 1, output
    assert "long_job: stopped: lock lost" in output
    # And the worker logged every skip, raise and retry with the lock key and the holder's id
    for what, name, count in (("skipped", "report", 2), ("raises TaskLocked", "export", 1),
                              ("retries in", "reindex", 1)):  # fmt: skip
        key = f"singletask:{task(name)}"
        pattern = rf"{task(name)}\[\w{{8}}\] {what}.*lock '{key}' is held by \w{{8}}"
        lines = re.findall(pattern, output)
        assert len(lines) >= count, output


def test_an_example_runs_on_redis_and_leaves_no_result_lock_or_queue(outputs: Outputs) -> None:
    """--redis-url: broker, results and locks in that database, and nothing of it left after."""
    # Given / When: customer_sync with --redis-url
    output = ran(outputs, "redis")
    url = str(outputs["redis_url"])

    # Then it used that database and behaved as on the embedded parts
    assert f"broker: {url}" in output, output
    runs = customer_runs(output)
    first, second = sorted(runs["1"])
    assert second[0] >= first[1], output
    # And it left no result, no lock and no queue binding in it
    with redis.Redis.from_url(url) as client:
        left = sorted(key.decode() for key in client.scan_iter())
    assert not [k for k in left if k.startswith(("celery-task-meta-", "singletask:"))], left
    assert not [k for k in left if k.startswith("_kombu.binding.customer_sync")], left
