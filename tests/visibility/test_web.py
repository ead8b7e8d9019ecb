"""The lock page (``singletask web``) in a real headless Chromium, on locks a real worker holds.

A prefork worker on the session's own redis-server runs ``e2e.ops.hold`` (tests/e2e/tasks_ops.py),
which holds ``singletask:e2e.ops.hold:<label>:<name>`` with a 3 s lease renewed every second
until the test sets its stop flag. Two pages serve that store, as an operator starts them: a
read-only one (``python -m singletask web --url URL``) and one that allows releases
(``celery -A tests.e2e.app singletask web --allow-release``, the token in
``SINGLETASK_WEB_TOKEN``). Selenium drives Debian's ``chromium`` through ``chromedriver``; each
test filters the page on its own label, so the other tests' locks stay out of its rows.

``SINGLETASK_LOCK_PAGE_SCREENSHOT=docs/_static/lock-page.png`` makes
:func:`test_a_screenshot_of_the_page` write the documentation's screenshot there.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from singletask.backends.redis import RedisBackend

from ..e2e.conftest import CLIENT_GARBAGE, Cluster, start_cluster
from ..e2e.tasks_ops import LEASE, stop_flag
from ..e2e.tasks_scopes import gate_key
from .lockpage import (
    BOUND,
    REFRESH,
    SCREENSHOT_ENV,
    TOKEN,
    Page,
    assert_only_own_origin,
    chromium,
    click,
    key_of,
    open_list,
    post_release,
    row_of,
    rows,
    seconds,
    serve,
    start_holder,
    wait_until,
    worker_hostname,
)

pytestmark = [pytest.mark.visibility, *(pytest.mark.filterwarnings(s) for s in CLIENT_GARBAGE)]


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest,
    redis_base_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    with start_cluster("redis", redis_base_url, tmp_path_factory, request) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def read_only(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    """The page as ``python -m singletask web --url URL``: read-only, on 127.0.0.1."""
    log = tmp_path_factory.mktemp("web") / "read-only.log"
    url = cluster.worker.env["SINGLETASK_E2E_LOCKS"]
    with serve(cluster, log, [sys.executable, "-m", "singletask", "web", "--url", url]) as page:
        yield page


@pytest.fixture(scope="module")
def releasing(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    """The page as ``celery -A tests.e2e.app singletask web --allow-release`` (the store from
    the app's settings), with its token in the environment."""
    log = tmp_path_factory.mktemp("web") / "releasing.log"
    argv = [sys.executable, "-m", "celery", "-A", "tests.e2e.app", "singletask", "web",
            "--allow-release"]  # fmt: skip
    with serve(cluster, log, argv, SINGLETASK_WEB_TOKEN=TOKEN) as page:
        yield page


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium driven by Selenium (Debian's chromium and chromium-driver)."""
    with chromium() as driver:
        yield driver


@pytest.fixture
def holders(cluster: Cluster) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh label, and the AsyncResults of the holders a test starts, stopped at the end."""
    label = cluster.label()
    started: dict[str, Any] = {}
    yield label, started
    cluster.probe.client.set(stop_flag(label), 1, ex=300)
    for result in started.values():
        result.get(timeout=BOUND)


def test_a_lock_held_by_a_real_worker_shows_counts_down_and_leaves_when_its_body_ends(
    cluster: Cluster, read_only: Page, browser: Any, holders: tuple[str, dict[str, Any]]
) -> None:
    # Given a worker running a body that holds its lock
    label, started = holders
    result = start_holder(cluster, label, "first", started)
    key = key_of(cluster, label, "first")

    # When the page is open
    open_list(browser, read_only, key=label)

    # Then the lock is there with its task, holder, worker host, pool pid and fence
    row = wait_until(lambda: row_of(browser, key), f"the page shows {key}")
    assert row["holder"] == result.id
    cells = row["cells"]
    assert cells["key"] == key
    assert cells["task"] == "e2e.ops.hold"
    assert cells["holder"] == result.id
    assert cells["host"] == worker_hostname(cluster)
    assert int(cells["pid"]) in cluster.worker.children()
    stored = RedisBackend(client=cluster.locks).holder(key)
    assert stored is not None
    assert int(cells["fence"]) == stored.fence
    assert cells["slot"] == "0"

    # And its lease counts down between two reads of the store (renewals put it back up)
    samples = []
    for _ in range(12):
        current = row_of(browser, key)
        assert current is not None
        samples.append(seconds(current["cells"]["lease"]))
        time.sleep(0.15)
    assert all(0 <= value <= LEASE + 0.5 for value in samples), samples
    assert any(b < a for a, b in itertools.pairwise(samples)), samples

    # When the body ends
    cluster.probe.client.set(stop_flag(label), 1, ex=300)
    result.get(timeout=BOUND)

    # Then the lock leaves the page at the next read
    wait_until(lambda: row_of(browser, key) is None, f"{key} leaves the page")
    assert_only_own_origin(browser, read_only)


def test_the_filters_keep_the_rows_of_a_task_and_a_key(
    cluster: Cluster, read_only: Page, browser: Any, holders: tuple[str, dict[str, Any]]
) -> None:
    # Given two holders of two keys of one task
    label, started = holders
    start_holder(cluster, label, "alpha", started)
    start_holder(cluster, label, "beta", started)
    alpha, beta = key_of(cluster, label, "alpha"), key_of(cluster, label, "beta")

    # When the key filter names the label, both show; naming one key keeps it alone
    open_list(browser, read_only, key=label)
    wait_until(lambda: {alpha, beta} <= {r["key"] for r in rows(browser)}, "both keys show")
    browser.find_element("id", "filter-key").send_keys(":ALPHA")
    wait_until(lambda: [r["key"] for r in rows(browser)] == [alpha], "only alpha shows")

    # And the task filter keeps the rows whose task name contains it
    open_list(browser, read_only, task="ops.hold", key=label)
    wait_until(lambda: {r["key"] for r in rows(browser)} == {alpha, beta}, "the task's rows show")
    open_list(browser, read_only, task="e2e.ops.other", key=label)
    time.sleep(2 * REFRESH)
    wait_until(lambda: rows(browser) == [], "no row of another task")


def test_a_key_s_page_shows_every_holder_with_its_fields(
    cluster: Cluster, read_only: Page, browser: Any, holders: tuple[str, dict[str, Any]]
) -> None:
    label, started = holders
    result = start_holder(cluster, label, "detail", started)
    key = key_of(cluster, label, "detail")

    # When the key is clicked in the list
    open_list(browser, read_only, key=label)
    wait_until(lambda: row_of(browser, key), f"the page shows {key}")
    click(browser, "#running tbody tr td.key a")

    # Then its page names the key and its holder, field by field, and offers no release
    wait_until(lambda: browser.find_element("id", "detail-key").text == key, "the key's page")
    # (found and read in one script: the page re-renders the block at each read of the store,
    # so an element found by one call may be gone by the next)
    fields = wait_until(lambda: browser.execute_script(
        "const block = document.querySelector('#holders dl.holder');"
        "return block && Object.fromEntries(Array.from(block.querySelectorAll('dt'))"
        ".map(dt => [dt.textContent, dt.nextElementSibling.textContent]))"
    ), "the holder's fields")  # fmt: skip
    assert fields["State"] == "running"
    assert fields["Holder task id"] == result.id
    assert fields["Host"] == worker_hostname(cluster)
    assert fields["Task"] == "e2e.ops.hold"
    assert fields["Scope"] == "execution"
    assert seconds(fields["Lease left"]) <= LEASE
    assert browser.find_elements("css selector", "button.release") == []
    assert not browser.find_element("id", "release-form").is_displayed()


def test_a_read_only_page_cannot_release(
    cluster: Cluster, read_only: Page, browser: Any, holders: tuple[str, dict[str, Any]]
) -> None:
    """Without --allow-release there is no button, and the endpoint is not there (404)."""
    label, started = holders
    result = start_holder(cluster, label, "kept", started)
    key = key_of(cluster, label, "kept")
    open_list(browser, read_only, key=label)
    wait_until(lambda: row_of(browser, key), f"the page shows {key}")
    assert post_release(browser, read_only, key, result.id, TOKEN) == 404
    assert cluster.held_by(key) == result.id


def test_a_release_needs_the_token_and_is_owner_checked(
    cluster: Cluster, releasing: Page, browser: Any, holders: tuple[str, dict[str, Any]]
) -> None:
    # Given a lock held by a running body, on its key's page of a page that allows releases
    label, started = holders
    result = start_holder(cluster, label, "released", started)
    key = key_of(cluster, label, "released")
    open_list(browser, releasing, key=label)
    wait_until(lambda: row_of(browser, key), f"the page shows {key}")
    click(browser, "#running tbody tr td.key a")
    wait_until(lambda: browser.find_elements("css selector", "button.release"), "a Release button")

    # When Release is confirmed with a wrong token
    browser.find_element("id", "token").send_keys("not-the-token-at-all")
    click(browser, "button.release")
    click(browser, "button.release")  # "Confirm release of task ..."

    # Then it is refused, the lock still held, and the attempt logged
    outcome = browser.find_element("id", "release-result")
    wait_until(lambda: outcome.text.startswith("Not released"), "the refusal shows")
    assert "wrong or no token" in outcome.text
    assert cluster.held_by(key) == result.id
    assert any("release refused to anonymous at 127.0.0.1: wrong token" in line
               for line in releasing.lines())  # fmt: skip

    # When it is confirmed with the token
    token = browser.find_element("id", "token")
    token.clear()
    token.send_keys(TOKEN)
    click(browser, "button.release")
    click(browser, "button.release")

    # Then the lock is released, the body learns it at its next renewal, and it is logged
    wait_until(lambda: outcome.text.startswith("Released"), "the release shows")
    assert result.id in outcome.text
    assert result.get(timeout=BOUND) == {"lost": True, "raised": "LockLost"}
    wait_until(lambda: browser.find_element("id", "detail-empty").is_displayed(),
               "the key's page says it is not held")  # fmt: skip
    assert any(f"held by task {result.id} released, asked by anonymous at 127.0.0.1" in line
               for line in releasing.lines())  # fmt: skip

    # And a release naming another holder is refused (owner check), however it is sent
    other = start_holder(cluster, label, "other", started)
    other_key = key_of(cluster, label, "other")
    assert post_release(browser, releasing, other_key, "someone-else", TOKEN) == 409
    assert cluster.held_by(other_key) == other.id
    assert_only_own_origin(browser, releasing)


def test_follow_ups_debounce_windows_and_rate_records_show(
    cluster: Cluster, read_only: Page, browser: Any
) -> None:
    """The store's other records of a key, from real sends: a coalescing task's pending
    follow-up, a debounced send's window, a rate-limited task's rate record."""
    label = cluster.label()
    coalesced = cluster.task("e2e.scopes.coalesced")
    running = coalesced.delay(label, tag="first", hold=True)
    try:
        # Given a coalescing run holding its key, and a second call: its pending follow-up
        wait_until(lambda: cluster.probe.starts(label), "the coalescing run starts")
        follow_up = coalesced.delay(label, tag="second")
        follow_key = str(coalesced.lock_key_for((label,)))
        # And a debounced send (its window) and a run of a task with lock_rate "1/m"
        debounced = cluster.task("e2e.limits.rebuild_slow").delay(label, 1)
        window_key = str(cluster.task("e2e.limits.rebuild_slow").lock_key_for((label, 1)))
        cluster.task("e2e.limits.call_partner_skip").delay(label).get(timeout=BOUND)
        rate_key = str(cluster.task("e2e.limits.call_partner_skip").lock_key_for((label,)))

        # When the page is open on them (their keys end with one hash of the label)
        digest = follow_key.rpartition(":")[2]
        assert rate_key.endswith(digest)
        assert window_key.endswith(digest)
        open_list(browser, read_only, key=digest)

        # Then each list shows its record, with the task id it names
        def shown(kind: str, key: str) -> dict[str, Any] | None:
            return next((r for r in rows(browser, kind) if r["key"] == key), None)

        pending = wait_until(lambda: shown("follow_up", follow_key), "the pending follow-up")
        assert pending["cells"]["task"] == "e2e.scopes.coalesced"
        assert pending["cells"]["holder"] == follow_up.id
        assert 0 < seconds(pending["cells"]["ttl"]) <= 30
        window = wait_until(lambda: shown("window", window_key), "the debounce window")
        assert window["cells"]["holder"] == debounced.id
        assert window["cells"]["detail"].startswith(("open", "closed"))
        rate = wait_until(lambda: shown("rate", rate_key), "the rate record")
        assert rate["cells"]["task"] == "e2e.limits.call_partner_skip"
        assert rate["cells"]["detail"].startswith("next start allowed")
        assert debounced.get(timeout=BOUND) == 1
    finally:
        cluster.probe.client.rpush(gate_key(label), 1)
        running.get(timeout=BOUND)

    # And the follow-up leaves the list when it has run
    assert follow_up.get(timeout=BOUND) == "second"
    wait_until(lambda: shown("follow_up", follow_key) is None, "the follow-up leaves")
    assert_only_own_origin(browser, read_only)


HOSTILE = "<script>window.pwned=1</script>\"'><img src=x onerror=window.pwned=2>"


def test_a_hostile_key_renders_as_text_and_runs_nothing(
    cluster: Cluster, read_only: Page, browser: Any, holders: tuple[str, dict[str, Any]]
) -> None:
    # Given a lock whose key holds markup (argument values end up in keys)
    label, started = holders
    start_holder(cluster, label, HOSTILE, started)
    key = key_of(cluster, label, HOSTILE)
    assert "<script>" in key

    # When the list and the key's page show it
    open_list(browser, read_only, key=label)
    row = wait_until(lambda: row_of(browser, key), "the page shows the hostile key")
    assert row["cells"]["key"] == key
    click(browser, "#running tbody tr td.key a")
    wait_until(lambda: browser.find_element("id", "detail-key").text == key, "the key's page")

    # Then it is text: no element came from it, and nothing ran
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.find_elements("css selector", "main img, main script") == []
    assert len(browser.find_elements("tag name", "script")) == 1  # the page's own
    assert_only_own_origin(browser, read_only)


def test_a_screenshot_of_the_page(
    cluster: Cluster,
    read_only: Page,
    browser: Any,
    holders: tuple[str, dict[str, Any]],
    tmp_path: Path,
) -> None:
    """The page as the docs show it (written to $SINGLETASK_LOCK_PAGE_SCREENSHOT when set):
    a rate record, two running locks, and a coalescing task's reservation and follow-up (both
    pool processes are busy, so they wait)."""
    label, started = holders
    cluster.task("e2e.limits.call_partner_skip").delay(label).get(timeout=BOUND)
    for name in ("customer-42", "customer-7"):
        start_holder(cluster, label, name, started)
    coalesced = cluster.task("e2e.scopes.coalesced")
    waiting = [coalesced.delay(label, tag=tag) for tag in ("first", "second")]
    browser.set_window_size(1200, 1000)
    try:
        open_list(browser, read_only)
        wait_until(lambda: len([r for r in rows(browser) if label in r["key"]]) == 2,
                   "two locks show")  # fmt: skip
        wait_until(lambda: rows(browser, "rate") and rows(browser, "reserved"),
                   "the rate record and the reservation show")  # fmt: skip
        time.sleep(0.5)
        shot = tmp_path / "lock-page.png"
        assert browser.save_screenshot(str(shot))
    finally:
        browser.set_window_size(1200, 700)
        cluster.probe.client.set(stop_flag(label), 1, ex=300)
        for result in [*started.values(), *waiting]:
            result.get(timeout=BOUND)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    target = os.environ.get(SCREENSHOT_ENV)
    if target:
        shutil.copyfile(shot, target)
