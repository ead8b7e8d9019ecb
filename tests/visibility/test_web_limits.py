"""The named limits on the lock page, in a real headless Chromium: the page served in this
process (``LockPage`` on wsgiref, as ``singletask web`` serves it) over a store that keeps named
limits (tests/ops/limits.py: ``UNITS_STORES``), the limits taken as an execution takes them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from singletask.backends.base import LockBackend
from singletask.ops.web import LockPage
from singletask.ops.web.server import make_server

from ..ops.limits import UNITS_STORES, concurrency, new_id, rate, take, units_store
from .lockpage import Page, assert_only_own_origin, chromium, rows, seconds, wait_until

pytestmark = pytest.mark.visibility

#: A limit name and a task id that hold markup, quotes and a byte a store showed escaped.
HOSTILE = "<script>window.pwned=1</script>\"'><img src=x onerror=window.pwned=2>\\xff"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


@pytest.fixture(params=UNITS_STORES)
def served(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, key_prefix: str
) -> Iterator[tuple[Page, LockBackend]]:
    """The page of a store that keeps named limits, served on 127.0.0.1, and the store."""
    with units_store(request.param, request, monkeypatch) as (url, backend):
        page = LockPage(url, prefix=key_prefix, refresh=0.5)
        server = make_server(page, "127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            address = f"http://127.0.0.1:{server.server_address[1]}/"
            yield Page(None, address, None), backend  # type: ignore[arg-type]
        finally:
            server.shutdown()
            server.server_close()
            page.close()


def holds(browser: Any, name: str) -> list[dict[str, str]]:
    """The hold lines of limit ``name``'s row: each one's ``data-holder`` (``id``), and its
    parts' text by class name (``units``, ``holder``, ``task``, ``ttl``)."""
    script = """
      const row = Array.from(document.querySelectorAll('#limits tbody tr'))
        .find(tr => tr.dataset.name === arguments[0]);
      return row ? Array.from(row.querySelectorAll('div.hold')).map(div => ({
        id: div.dataset.holder || '',
        ...Object.fromEntries(Array.from(div.children).map(s => [s.className, s.textContent])),
        text: div.textContent,
      })) : [];
    """
    return list(browser.execute_script(script, name))


def limit_row(browser: Any, name: str) -> dict[str, Any] | None:
    return next((r for r in rows(browser, "limits") if r["cells"]["name"] == name), None)


def test_each_named_limit_in_use_shows_its_kind_units_and_holders(
    served: tuple[Page, LockBackend], browser: Any, key_prefix: str
) -> None:
    # Given two executions holding 2 and 1 units of a concurrency limit of 8, the first also
    # having started 1200 units of a rate of 90000 per minute
    page, backend = served
    first, second = new_id(), new_id()
    take(backend, first, "proj.summarize", concurrency(key_prefix, "openai-requests", 8, 2),
         rate(key_prefix, "openai-tokens", 90000, 1200))  # fmt: skip
    take(backend, second, "proj.embed", concurrency(key_prefix, "openai-requests", 8, 1))

    # When the page is open
    browser.get(page.url)

    # Then the limits table has a row per limit: kind, units in use, size, time left
    requests = wait_until(lambda: limit_row(browser, "openai-requests"), "the concurrency limit")
    assert requests["key"] == f"{key_prefix}%limit:openai-requests"
    assert requests["cells"]["kind"] == "concurrency"
    assert (requests["cells"]["used"], requests["cells"]["size"]) == ("3", "8")
    assert 0 < seconds(requests["cells"]["ttl"]) <= 30
    tokens = wait_until(lambda: limit_row(browser, "openai-tokens"), "the rate")
    assert tokens["cells"]["kind"] == "rate per 1 min"
    assert (tokens["cells"]["used"], tokens["cells"]["size"]) == ("1200", "90000")
    assert browser.find_element("id", "limits-count").text == "(2)"

    # And a line per hold: its units, task id, task name and time left, counting down
    lines = holds(browser, "openai-requests")
    assert [(h["holder"], h["units"], h["task"]) for h in lines] == [
        (first, "2 units", "proj.summarize"), (second, "1 unit", "proj.embed"),
    ]  # fmt: skip
    assert [h["id"] for h in lines] == [first, second]
    assert 0 < seconds(lines[0]["ttl"]) <= 30
    [start] = holds(browser, "openai-tokens")
    assert (start["holder"], start["units"]) == (first, "1200 units")
    assert 30 < seconds(start["ttl"]) <= 60

    # When the holds are given back, the limit leaves the page at the next read
    backend.give_units(execution_token_of(backend, key_prefix, second),
                       [concurrency(key_prefix, "openai-requests", 8, 1)])  # fmt: skip
    wait_until(lambda: len(holds(browser, "openai-requests")) == 1, "the hold given back leaves")
    assert_only_own_origin(browser, page)


def execution_token_of(backend: LockBackend, prefix: str, task_id: str) -> str:
    """The owner token of ``task_id``'s hold of ``openai-requests`` (as the store lists it)."""
    [state] = [s for s in backend.iter_state(prefix + "%limit:") if s.kind == "limit"]
    return str(next(h["token"] for h in state.detail["holds"] if h["task_id"] == task_id))


def test_a_hostile_limit_name_and_task_id_render_as_text_and_run_nothing(
    served: tuple[Page, LockBackend], browser: Any, key_prefix: str
) -> None:
    # Given a limit whose name holds markup, held by a task id and task name that do too
    page, backend = served
    take(backend, HOSTILE, HOSTILE, concurrency(key_prefix, HOSTILE, 4, 1))

    # When the page shows it
    browser.get(page.url)
    row = wait_until(lambda: limit_row(browser, HOSTILE), "the page shows the hostile limit")

    # Then it is text: the name, the task id and the task name as they are; nothing ran
    assert row["key"] == f"{key_prefix}%limit:{HOSTILE}"
    [line] = holds(browser, HOSTILE)
    assert (line["id"], line["holder"], line["task"]) == (HOSTILE, HOSTILE, HOSTILE)
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.find_elements("css selector", "main img, main script") == []
    assert len(browser.find_elements("tag name", "script")) == 1  # the page's own
    assert_only_own_origin(browser, page)
