"""Helpers of the lock page's browser tests (test_web.py): the page's server as an operator
starts it, a holder on the real worker, and reading the page as a person sees it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..e2e.conftest import ROOT, Cluster
from ..servers import unavailable

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "a-release-token-for-the-browser-tests"
#: Generous bound for what the worker or the page should do "at once" on a loaded machine.
BOUND = 20.0
#: The page reads the store this often (--refresh).
REFRESH = 1.0
SCREENSHOT_ENV = "SINGLETASK_LOCK_PAGE_SCREENSHOT"

T = TypeVar("T")


def wait_until(check: Callable[[], T], what: str, timeout: float = BOUND) -> T:
    """``check()``'s first truthy value within ``timeout`` seconds (fails naming ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.1)


class Page:
    """A ``singletask web`` subprocess: its URL and its log (standard error)."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.process, self.url, self.log = process, url, log

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()


@contextlib.contextmanager
def serve(cluster: Cluster, log: Path, argv: list[str], **env: str) -> Iterator[Page]:
    """Run the page command ``argv`` (``--port 0``) with the worker's settings; stop it after."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*argv, "--port", "0", "--refresh", str(REFRESH)], cwd=ROOT,
            env={**cluster.worker.env, **env}, stdout=subprocess.DEVNULL, stderr=out,
        )  # fmt: skip
    try:
        line = wait_until(
            lambda: (
                next((s for s in log.read_text().splitlines() if " at http://" in s), None)
                or (process.poll() is not None and f"exited: {log.read_text()}")
            ),
            "the page's server prints its URL",
        )
        assert "exited" not in line, line
        yield Page(process, line.rsplit(" at ", 1)[1].split()[0], log)
    finally:
        process.terminate()
        process.wait(30)


def start_holder(cluster: Cluster, label: str, name: str, started: dict[str, Any]) -> Any:
    """Send ``e2e.ops.hold(label, name)`` and wait until its body runs."""
    result = cluster.task("e2e.ops.hold").delay(label, name)
    started[name] = result
    wait_until(
        lambda: [e for e in cluster.probe.starts(label) if e["task_id"] == result.id],
        f"holder {name} starts\n{cluster.worker.tail()}",
    )
    return result


def key_of(cluster: Cluster, label: str, name: str) -> str:
    return str(cluster.task("e2e.ops.hold").lock_key_for((label, name)))


def open_list(browser: Any, page: Page, *, task: str = "", key: str = "") -> None:
    """Open the page's list, filtered (the filter boxes typed in as a person does)."""
    browser.get(page.url)
    wait_until(lambda: browser.execute_script("return !!document.querySelector('#status')"),
               "the page loads")  # fmt: skip
    for box, text in (("filter-task", task), ("filter-key", key)):
        if text:
            browser.find_element("id", box).send_keys(text)


def rows(browser: Any, table: str = "running") -> list[dict[str, Any]]:
    """The rows of a list on the page: each row's ``data-key``, ``data-holder`` and its cells'
    text by class name."""
    script = """
      return Array.from(document.querySelectorAll('#' + arguments[0] + ' tbody tr')).map(tr => ({
        key: tr.dataset.key, holder: tr.dataset.holder,
        cells: Object.fromEntries(Array.from(tr.cells).map(td => [td.className.split(' ')[0],
                                                                   td.textContent])),
      }));
    """
    return list(browser.execute_script(script, table))


def row_of(browser: Any, key: str) -> dict[str, Any] | None:
    return next((row for row in rows(browser) if row["key"] == key), None)


def click(browser: Any, css: str) -> None:
    """Click the first element ``css`` selects, as a person does; the page re-renders its rows
    at each read of the store, so an element found just before may be gone: find it again."""
    from selenium.common.exceptions import StaleElementReferenceException

    def clicked() -> bool:
        try:
            browser.find_element("css selector", css).click()
        except StaleElementReferenceException:
            return False
        return True

    wait_until(clicked, f"click {css}")


def seconds(text: str) -> float:
    assert text.endswith(" s"), text
    return float(text[:-2])


def assert_only_own_origin(browser: Any, page: Page) -> None:
    """Everything the page loaded or called came from its own origin."""
    names = browser.execute_script(
        "return [location.href, ...performance.getEntriesByType('resource').map(e => e.name)]"
    )
    origin = urlsplit(page.url)
    assert len(names) > 3  # the page, its style sheet, its script, its reads of the store
    for name in names:
        assert urlsplit(name)[:2] == origin[:2], name


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium driven by Selenium (Debian's chromium and chromium-driver)."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        unavailable(f"the lock page's browser tests need {' and '.join(missing)} (apt: chromium "
                    "chromium-driver)")  # fmt: skip
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                     "--disable-dev-shm-usage", "--window-size=1200,700"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def worker_hostname(cluster: Cluster) -> str:
    return cluster.worker.nodename.replace("%h", os.uname().nodename)


def post_release(browser: Any, page: Page, key: str, holder: str, token: str) -> int:
    """POST a release from the page's own origin (as its script would), returning the status."""
    script = """
      const done = arguments[arguments.length - 1];
      fetch('api/release', {method: 'POST', headers: {'Content-Type': 'application/json',
            'X-Singletask-Token': arguments[2]},
            body: JSON.stringify({key: arguments[0], holder: arguments[1], slot: 0})})
        .then(r => done(r.status), e => done(String(e)));
    """
    return int(browser.execute_async_script(script, key, holder, token))
