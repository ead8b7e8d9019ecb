"""The lock page's HTTP behaviour (singletask.ops.web), against real lock stores, without a browser.

The page itself, in a headless Chromium with a real worker holding the locks, is tested in
tests/visibility/test_web.py (``-m visibility``); its mounts in other sites in test_mounts.py
and the ``singletask web`` command in test_cli.py. Here: what each route answers, the
headers every response carries, the release endpoint (absent unless allowed; token, owner check,
log), and the options.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.exceptions import ConfigurationError
from singletask.ops.inventory import LIMIT_FIELDS
from singletask.ops.web import LockPage

from ...servers import free_port
from ..limits import PERIOD, concurrency, new_id, rate, take
from .helpers import TOKEN, call, hold, release


def test_every_response_allows_only_its_own_origin(page: LockPage) -> None:
    """The page, its assets, the API and a 404 all carry a Content-Security-Policy that lets
    the page load and call nothing but its own origin, and may not be framed."""
    for path in ("/", "/static/app.js", "/static/style.css", "/api/locks", "/nowhere"):
        answer = call(page, "GET", path)
        policy = answer.headers["content-security-policy"]
        directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
        assert directives["default-src"] == "'none'"
        for kind in ("script-src", "style-src", "img-src", "connect-src"):
            assert directives[kind] == "'self'", (path, kind)
        assert directives["frame-ancestors"] == "'none'"
        assert answer.headers["x-content-type-options"] == "nosniff"


def test_the_page_and_its_assets_are_served_by_the_app(page: LockPage) -> None:
    """The HTML refers only to relative URLs the app serves itself (package data)."""
    html = call(page, "GET", "/")
    assert html.status == 200
    assert html.headers["content-type"].startswith("text/html")
    assert b'src="static/app.js"' in html.body
    assert b"http" not in html.body.replace(b"http-equiv", b"")
    script = call(page, "GET", "/static/app.js")
    assert script.status == 200
    assert script.headers["content-type"].startswith("text/javascript")
    assert b"innerHTML" not in script.body
    head = call(page, "HEAD", "/static/app.js")
    assert head.status == 200
    assert head.body == b""
    assert head.headers["content-length"] == str(len(script.body))
    assert call(page, "POST", "/").status == 405
    assert call(page, "GET", "/static/../app.py").status == 404
    assert call(page, "GET", "/static/missing.js").status == 404


def test_the_list_holds_every_field_of_a_lock(
    page: LockPage, store: tuple[str, LockBackend]
) -> None:
    """``api/locks`` returns the documented lock records (``locks --json``)."""
    fence = hold(store[1], "singletask:proj.sync:1", "id-1")
    body = call(page, "GET", "/api/locks").json()
    assert body["release"] is False
    assert body["prefix"] == "singletask:"
    [record] = body["locks"]
    assert record["key"] == "singletask:proj.sync:1"
    assert record["holder"] == "id-1"
    assert record["hostname"] == "celery@w1"
    assert record["pid"] == 4242
    assert record["fence"] == fence
    assert 25 < record["lease_left"] <= 30
    assert body["locks_note"] is None


def test_the_list_filters_by_task_and_key(page: LockPage, store: tuple[str, LockBackend]) -> None:
    """``task`` and ``key`` keep the records whose task name and key contain them, whatever
    the case."""
    hold(store[1], "singletask:proj.sync:1", "id-1")
    hold(store[1], "singletask:proj.sync:2", "id-2")
    hold(store[1], "singletask:proj.feed", "id-3", task="proj.feed")

    def keys(query: str) -> list[str]:
        return sorted(r["key"] for r in call(page, "GET", f"/api/locks?{query}").json()["locks"])

    assert keys("task=SYNC") == ["singletask:proj.sync:1", "singletask:proj.sync:2"]
    assert keys("key=sync%3A2") == ["singletask:proj.sync:2"]
    assert keys("task=feed&key=sync") == []
    assert len(keys("task=&key=")) == 3


def test_the_list_says_when_it_stops_at_the_limit(store: tuple[str, LockBackend]) -> None:
    for number in range(3):
        hold(store[1], f"singletask:proj.sync:{number}", f"id-{number}")
    page = LockPage(store[0], limit=2)
    try:
        body = call(page, "GET", "/api/locks").json()
    finally:
        page.close()
    assert len(body["locks"]) == 2
    assert body["locks_note"] == "the first 2 shown"


def test_a_key_s_page_names_its_holders(page: LockPage, store: tuple[str, LockBackend]) -> None:
    hold(store[1], "singletask:<b>key</b>", "id-1")
    body = call(page, "GET", "/api/lock?key=singletask%3A%3Cb%3Ekey%3C%2Fb%3E").json()
    assert body["key"] == "singletask:<b>key</b>"
    assert [r["holder"] for r in body["holders"]] == ["id-1"]
    assert call(page, "GET", "/api/lock?key=singletask%3Afree").json()["holders"] == []
    assert call(page, "GET", "/api/lock").status == 400


def test_a_store_that_cannot_list_says_so(memcached_url: str) -> None:
    """memcached keeps no list of its keys: the lists say so, a key's page still answers."""
    page = LockPage(memcached_url)
    try:
        body = call(page, "GET", "/api/locks").json()
        assert body["locks"] is None
        assert "look a key up" in body["locks_note"]
        assert body["state"] is None
        assert "cannot list" in body["state_note"]
        assert body["limits"] is None
        key = call(page, "GET", "/api/lock?key=singletask%3Ax").json()
        assert key["holders"] == []
        assert key["state"] is None
    finally:
        page.close()


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_follow_ups_debounce_windows_and_rate_records_are_listed(
    request: pytest.FixtureRequest, kind: str, key_prefix: str, tmp_path: Path
) -> None:
    """Beside the locks, the store's other records of each key (``find_state``), filtered as
    the locks are; a key's page has its own."""
    if kind == "redis":
        request.getfixturevalue("redis_client")  # fails / skips when the server is missing
        url = request.getfixturevalue("redis_url")
    else:
        url = f"sqlite:///{tmp_path}/locks.db"
    backend = backend_from_url(url)
    follow, window, rated = (f"{key_prefix}proj.sync:1", f"{key_prefix}proj.index:a",
                             f"{key_prefix}proj.feed")  # fmt: skip
    assert backend.claim_next(follow, "next-id", 30) == "next-id"
    backend.debounce(window, "send-1", 30)
    backend.debounce(window, "send-2", 30)
    token = "id-r:0:abcdef012345:4242:00ff00ff"
    assert backend.acquire_slot(rated, 2, token, 30, interval=60).acquired
    page = LockPage(url, prefix=key_prefix)
    try:
        body = call(page, "GET", "/api/locks").json()
        found = {(r["kind"], r["key"], r["task"], r["task_id"]) for r in body["state"]}
        assert found == {
            ("follow_up", follow, "proj.sync", "next-id"),
            ("window", window, "proj.index", "send-2"),
            ("rate", rated, "proj.feed", None),
        }
        assert body["state_note"] is None
        windows = [r for r in body["state"] if r["kind"] == "window"]
        assert windows[0]["detail"]["open"] is True
        assert 0 < windows[0]["ttl"] <= 30
        filtered = call(page, "GET", "/api/locks?task=INDEX").json()["state"]
        assert [r["key"] for r in filtered] == [window]
        detail = call(page, "GET", "/api/lock?key=" + follow.replace(":", "%3A")).json()
        assert [(r["kind"], r["task"]) for r in detail["state"]] == [("follow_up", "proj.sync")]
    finally:
        page.close()
        backend.close()


def test_the_named_limits_in_use_are_listed_beside_the_locks(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """``api/locks`` lists each named limit in use (``locks --limits --json``): its name, kind,
    size, units in use and holds; a limit is not one of the keys' other records."""
    # Given two executions holding units of a concurrency limit, one also starting a rate's
    url, backend = limits_store
    first, second = new_id(), new_id()
    take(backend, first, "proj.summarize", concurrency(key_prefix, "openai-requests", 8, 2),
         rate(key_prefix, "openai-tokens", 90000, 1200))  # fmt: skip
    take(backend, second, "proj.embed", concurrency(key_prefix, "openai-requests", 8, 1))
    page = LockPage(url, prefix=key_prefix)
    try:
        # When the page reads the store
        body = call(page, "GET", "/api/locks").json()
    finally:
        page.close()

    # Then each limit is listed, with its holds, and none is a lock or a key's other record
    limits = {record["name"]: record for record in body["limits"]}
    assert set(limits) == {"openai-requests", "openai-tokens"}
    requests, tokens = limits["openai-requests"], limits["openai-tokens"]
    assert tuple(requests) == LIMIT_FIELDS
    assert (requests["kind"], requests["size"], requests["period"], requests["used"]) == (
        "concurrency", 8, None, 3,
    )  # fmt: skip
    assert [(h["task_id"], h["task"], h["units"]) for h in requests["holds"]] == [
        (first, "proj.summarize", 2), (second, "proj.embed", 1),
    ]  # fmt: skip
    assert 0 < requests["holds"][0]["ttl"] <= 30
    assert (tokens["kind"], tokens["period"], tokens["used"], tokens["size"]) == (
        "rate", PERIOD, 1200, 90000,
    )  # fmt: skip
    assert body["limits_note"] is None
    assert body["locks"] == []
    assert body["state"] == []


def test_the_limits_are_filtered_by_the_task_of_a_hold_and_by_key(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """``task`` keeps the limits a task whose name contains it holds units of; ``key`` the
    limits whose store key contains it (their name is in it); a key's page has no limits."""
    url, backend = limits_store
    take(backend, new_id(), "proj.summarize", concurrency(key_prefix, "openai-requests", 8, 2),
         rate(key_prefix, "openai-tokens", 90000, 1200))  # fmt: skip
    take(backend, new_id(), "proj.embed", concurrency(key_prefix, "openai-requests", 8, 1))
    page = LockPage(url, prefix=key_prefix)

    def names(query: str) -> list[str]:
        return sorted(r["name"] for r in call(page, "GET", f"/api/locks?{query}").json()["limits"])

    try:
        assert names("task=EMBED") == ["openai-requests"]
        assert names("task=summarize") == ["openai-requests", "openai-tokens"]
        assert names("key=TOKENS") == ["openai-tokens"]
        assert names("key=%25rate") == ["openai-tokens"]
        assert names("task=embed&key=tokens") == []
        lookup = "/api/lock?key=" + quote(f"{key_prefix}%limit:openai-requests", safe="")
        assert "limits" not in call(page, "GET", lookup).json()
    finally:
        page.close()


def test_the_limits_list_says_when_it_stops_at_the_limit(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    url, backend = limits_store
    for name in ("a", "b", "c"):
        take(backend, new_id(), "proj.summarize", concurrency(key_prefix, name, 8, 1))
    hold(backend, f"{key_prefix}proj.sync:1", "id-1")
    page = LockPage(url, prefix=key_prefix, limit=2)
    try:
        body = call(page, "GET", "/api/locks").json()
    finally:
        page.close()
    assert len(body["limits"]) == 2
    assert body["limits_note"] == "the first 2 shown"
    assert body["state_note"] is None


def test_the_page_has_a_table_of_the_named_limits(page: LockPage) -> None:
    html = call(page, "GET", "/").body.decode()
    assert '<table id="limits" class="state">' in html
    assert 'id="limits-count"' in html
    assert 'id="limits-note"' in html


def test_an_unreachable_store_answers_503_with_the_reason() -> None:
    page = LockPage(f"redis://127.0.0.1:{free_port()}/0?socket_connect_timeout=1")
    try:
        answer = call(page, "GET", "/api/locks")
    finally:
        page.close()
    assert answer.status == 503
    assert answer.json()["error"]


def test_without_allow_release_there_is_no_release_endpoint(
    page: LockPage, store: tuple[str, LockBackend]
) -> None:
    """A read-only page (the default) has no release route at all, token or not."""
    hold(store[1], "singletask:proj.sync:1", "id-1")
    answer = release(page, TOKEN, {"key": "singletask:proj.sync:1", "holder": "id-1"})
    assert answer.status == 404
    assert call(page, "GET", "/api/release").status == 404
    assert store[1].holder("singletask:proj.sync:1") is not None


@pytest.mark.parametrize("token", [None, "", "wrong-token-of-some-length"])
def test_a_release_without_the_token_is_refused_and_logged(
    releasing: LockPage,
    store: tuple[str, LockBackend],
    token: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hold(store[1], "singletask:proj.sync:1", "id-1")
    caplog.set_level(logging.INFO, "singletask")
    answer = release(releasing, token, {"key": "singletask:proj.sync:1", "holder": "id-1"},
                     REMOTE_USER="mallory")  # fmt: skip
    assert answer.status == 403
    assert store[1].holder("singletask:proj.sync:1") is not None
    [line] = [r.getMessage() for r in caplog.records if r.name == "singletask.web"]
    assert "refused" in line
    assert "mallory at 192.0.2.7" in line


def test_a_release_is_owner_checked_and_logged_with_who_asked(
    releasing: LockPage, store: tuple[str, LockBackend], caplog: pytest.LogCaptureFixture
) -> None:
    """The holder's task id must match (as ``release --holder``); who asked is logged."""
    hold(store[1], "singletask:proj.sync:1", "id-1")
    caplog.set_level(logging.INFO, "singletask")
    key = "singletask:proj.sync:1"

    other = release(releasing, TOKEN, {"key": key, "holder": "id-9"}, REMOTE_USER="alice")
    assert other.status == 409
    assert "held by task id-1" in other.json()["error"]
    assert store[1].holder(key) is not None

    done = release(releasing, TOKEN, {"key": key, "holder": "id-1", "slot": 0},
                   REMOTE_USER="alice")  # fmt: skip
    assert done.status == 200
    assert done.json()["released"]["holder"] == "id-1"
    holder = store[1].holder(key)
    assert holder is None or not holder.token

    again = release(releasing, TOKEN, {"key": key, "holder": "id-1"})
    assert again.status == 409
    assert "not held" in again.json()["error"]
    lines = [r.getMessage() for r in caplog.records if r.name == "singletask.web"]
    assert len(lines) == 3
    assert all("at 192.0.2.7" in line for line in lines)
    assert "released, asked by alice at 192.0.2.7" in lines[1]
    assert "anonymous at 192.0.2.7" in lines[2]


@pytest.mark.parametrize(
    ("payload", "content_type", "status"),
    [
        ({"key": "k"}, "application/json", 400),
        ({"key": "k", "holder": "id-1", "slot": -1}, "application/json", 400),
        (["k", "id-1"], "application/json", 400),
        ({"key": "k", "holder": "id-1"}, "text/plain", 415),
        ({"key": "k", "holder": "x" * 5000}, "application/json", 413),
    ],
)
def test_a_malformed_release_is_refused_with_what_is_wrong(
    releasing: LockPage, payload: object, content_type: str, status: int
) -> None:
    answer = release(releasing, TOKEN, payload, CONTENT_TYPE=content_type)
    assert answer.status == status
    assert answer.json()["error"]


def test_release_is_post_only(releasing: LockPage) -> None:
    answer = call(releasing, "GET", "/api/release")
    assert answer.status == 405
    assert answer.headers["allow"] == "POST"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"allow_release": True}, "needs a token"),
        ({"allow_release": True, "token": "short"}, "at least 16"),
        ({"refresh": 0}, "refresh"),
        ({"limit": 0}, "limit"),
        ({"prefix": ""}, "prefix"),
        ({"hosts": "localhost"}, "hosts"),
    ],
)
def test_bad_options_fail_early_naming_the_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        LockPage("sqlite:////tmp/never.db", **options)


@pytest.mark.parametrize(
    ("url", "message"),
    [("localhost:6379", "not a lock store URL"), ("nosuch://host", "unknown scheme 'nosuch'"),
     ("redis://localhost:6379/x", "LockPage: ")],
)  # fmt: skip
def test_a_bad_store_url_fails_when_the_page_is_built(url: str, message: str) -> None:
    """Not at the first request: a site that mounts the page fails as it starts."""
    with pytest.raises(ConfigurationError, match=message):
        LockPage(url)


@pytest.mark.parametrize(
    ("host", "status"),
    [("127.0.0.1:8471", 200), ("LOCALHOST", 200), ("[::1]:8471", 200),
     ("attacker.example", 400), ("127.0.0.1.attacker.example:8471", 400)],
)  # fmt: skip
def test_a_page_with_hosts_answers_to_those_names_only(
    store: tuple[str, LockBackend], host: str, status: int
) -> None:
    """Against DNS rebinding: another site's name that resolves to 127.0.0.1 gets nothing."""
    page = LockPage(store[0], hosts=("127.0.0.1", "localhost", "::1"))
    try:
        answer = call(page, "GET", "/api/locks", HTTP_HOST=host)
    finally:
        page.close()
    assert answer.status == status
