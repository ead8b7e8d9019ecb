"""The lock page mounted in other sites, as docs/web.rst shows it: under a path of a WSGI
site (``mount``), through the ASGI adapter, in front of a Django project (wsgi.py and asgi.py),
with Werkzeug's dispatcher (Flask) and in a Starlette app (FastAPI's ``mount``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from singletask.backends.base import LockBackend
from singletask.exceptions import ConfigurationError
from singletask.ops.web import TOKEN_HEADER, LockPage, asgi, mount

from .helpers import TOKEN, call, hold, run_asgi

ROOT = Path(__file__).resolve().parents[3]


def test_mounted_under_a_path_of_another_wsgi_site(
    page: LockPage, store: tuple[str, LockBackend]
) -> None:
    """``mount`` sends /locks/... to the page (links stay under /locks/), the rest to the
    site; /locks without the slash is redirected to /locks/."""

    def site(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"the site"]

    app = mount(site, "/locks", page)
    hold(store[1], "singletask:proj.sync:1", "id-1")
    assert call(app, "GET", "/").body == b"the site"
    assert call(app, "GET", "/locksmith").body == b"the site"
    moved = call(app, "GET", "/locks", SCRIPT_NAME="/app")
    assert moved.status == 301
    assert moved.headers["location"] == "/app/locks/"
    assert b"static/app.js" in call(app, "GET", "/locks/").body
    assert len(call(app, "GET", "/locks/api/locks").json()["locks"]) == 1
    with pytest.raises(ConfigurationError, match="'/locks/'"):
        mount(site, "/locks/", page)


@pytest.mark.parametrize("path_has_root", [True, False])
def test_the_asgi_adapter_serves_the_page_under_its_root_path(
    releasing: LockPage, store: tuple[str, LockBackend], path_has_root: bool
) -> None:
    """Mounted at /locks (``root_path``), whether the server leaves the mount in ``path``
    (Starlette today) or takes it out."""
    app = asgi(releasing)
    hold(store[1], "singletask:proj.sync:1", "id-1")
    prefix = "/locks" if path_has_root else ""
    scope = {"method": "GET", "root_path": "/locks", "path": f"{prefix}/api/locks",
             "query_string": b"task=sync"}  # fmt: skip
    status, headers, body = run_asgi(app, scope)
    assert status == 200
    assert "connect-src 'self'" in headers["content-security-policy"]
    assert [r["holder"] for r in json.loads(body)["locks"]] == ["id-1"]

    payload = json.dumps({"key": "singletask:proj.sync:1", "holder": "id-1"}).encode()
    scope = {"method": "POST", "root_path": "/locks", "path": f"{prefix}/api/release",
             "headers": [(b"content-type", b"application/json"),
                         (TOKEN_HEADER.lower().encode(), TOKEN.encode())]}  # fmt: skip
    status, _, body = run_asgi(app, scope, payload)
    assert status == 200, body
    assert json.loads(body)["released"]["holder"] == "id-1"


def test_the_asgi_adapter_logs_the_scope_s_authenticated_user(
    releasing: LockPage, store: tuple[str, LockBackend], caplog: pytest.LogCaptureFixture
) -> None:
    """A release through an ASGI site with authentication names its user in the log."""

    class User:  # what Starlette's AuthenticationMiddleware puts in the scope
        is_authenticated = True
        display_name = "alice"

    hold(store[1], "singletask:proj.sync:1", "id-1")
    caplog.set_level(logging.INFO, "singletask")
    payload = json.dumps({"key": "singletask:proj.sync:1", "holder": "id-1"}).encode()
    scope = {"method": "POST", "path": "/api/release", "user": User(),
             "headers": [(b"content-type", b"application/json"),
                         (TOKEN_HEADER.lower().encode(), TOKEN.encode())]}  # fmt: skip
    status, _, _ = run_asgi(asgi(releasing), scope, payload)
    assert status == 200
    [line] = [r.getMessage() for r in caplog.records if r.name == "singletask.web"]
    assert "asked by alice at 198.51.100.4" in line


def test_the_asgi_adapter_answers_the_lifespan_protocol(page: LockPage) -> None:
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asgi(page)({"type": "lifespan"}, receive, send))
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


#: A Django project's wsgi.py and asgi.py as docs/web.rst writes them (the page built from a
#: Celery app's settings), in a process of its own (Django's settings are per process); it prints
#: what three requests answered through each.
DJANGO_WSGI = """
import io, json, sys
import django
from django.conf import settings

settings.configure(ROOT_URLCONF=__name__, ALLOWED_HOSTS=["*"], SECRET_KEY="s" * 50)
from django.http import HttpResponse
from django.urls import path

urlpatterns = [path("", lambda request: HttpResponse(b"the django site"))]
django.setup()

from celery import Celery
from django.core.wsgi import get_wsgi_application
from singletask.ops.web import LockPage, mount

celery_app = Celery("proj", set_as_current=False)
celery_app.conf.singletask_backend_url = sys.argv[1]
application = mount(get_wsgi_application(), "/locks", LockPage.from_celery(celery_app))

answers = {}
for target in ("/", "/locks", "/locks/api/locks"):
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": target, "SCRIPT_NAME": "",
               "QUERY_STRING": "", "SERVER_NAME": "testserver", "SERVER_PORT": "80",
               "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.input": io.BytesIO(), "wsgi.errors": sys.stderr,
               "wsgi.url_scheme": "http", "wsgi.version": (1, 0), "wsgi.multithread": False,
               "wsgi.multiprocess": False, "wsgi.run_once": False}
    status = []
    body = b"".join(application(environ, lambda s, h, e=None: status.append(s)))
    answers[target] = [status[0], body.decode()]

# proj/asgi.py, as docs/web.rst writes it
import asyncio
from django.core.asgi import get_asgi_application
from singletask.ops.web import asgi

django_app = get_asgi_application()
lock_page = asgi(LockPage.from_celery(celery_app))


async def asgi_application(scope, receive, send):
    if scope["type"] == "http" and (scope["path"] + "/").startswith("/locks/"):
        await lock_page({**scope, "root_path": "/locks"}, receive, send)
    else:
        await django_app(scope, receive, send)


async def asgi_get(target):
    sent, requests = [], [{"type": "http.request", "body": b"", "more_body": False}]
    async def receive():
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays connected
    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": target, "raw_path": target.encode(),
             "root_path": "", "query_string": b"", "headers": [(b"host", b"testserver")],
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    await asgi_application(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return [sent[0]["status"], body.decode()]

for target in ("/", "/locks", "/locks/api/locks"):
    answers["asgi " + target] = asyncio.run(asgi_get(target))
print(json.dumps(answers))
"""


def test_mounted_in_front_of_a_django_project_wsgi_and_asgi_as_the_docs_show(
    store: tuple[str, LockBackend],
) -> None:
    hold(store[1], "singletask:proj.sync:1", "id-1")
    done = subprocess.run(
        [sys.executable, "-c", DJANGO_WSGI, store[0]], cwd=ROOT, capture_output=True, text=True,
        timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)
    assert answers["/"] == ["200 OK", "the django site"]
    assert answers["/locks"][0] == "301 Moved Permanently"
    status, body = answers["/locks/api/locks"]
    assert status == "200 OK"
    assert [r["holder"] for r in json.loads(body)["locks"]] == ["id-1"]
    assert answers["asgi /"] == [200, "the django site"]
    assert answers["asgi /locks"][0] == 301
    status, body = answers["asgi /locks/api/locks"]
    assert status == 200
    assert [r["holder"] for r in json.loads(body)["locks"]] == ["id-1"]


def test_mounted_with_werkzeug_s_dispatcher_as_the_flask_example_does(
    page: LockPage, store: tuple[str, LockBackend]
) -> None:
    """Flask's ``app.wsgi_app`` wrapped in Werkzeug's DispatcherMiddleware (docs/web.rst)."""
    from werkzeug.middleware.dispatcher import DispatcherMiddleware
    from werkzeug.test import Client

    def site(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"the flask site"]

    hold(store[1], "singletask:proj.sync:1", "id-1")
    client = Client(DispatcherMiddleware(site, {"/locks": page}))
    assert client.get("/").get_data() == b"the flask site"
    moved = client.get("/locks")
    assert moved.status_code == 301
    assert moved.headers["Location"].endswith("/locks/")
    assert b"static/app.js" in client.get("/locks/").get_data()
    assert len(client.get("/locks/api/locks").get_json()["locks"]) == 1


def test_mounted_in_a_starlette_app_as_the_fastapi_example_does(
    page: LockPage, store: tuple[str, LockBackend]
) -> None:
    """FastAPI's ``app.mount`` is Starlette's Mount: its routing, not a hand-made scope."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    async def home(request: Any) -> PlainTextResponse:
        return PlainTextResponse("the fastapi site")

    app = Starlette(routes=[Route("/", home), Mount("/locks", app=asgi(page))])
    hold(store[1], "singletask:proj.sync:1", "id-1")

    def get(path: str) -> tuple[int, dict[str, str], bytes]:
        scope = {"method": "GET", "path": path, "raw_path": path.encode()}
        return run_asgi(app, scope)

    assert get("/")[2] == b"the fastapi site"
    status, headers, body = get("/locks/")
    assert status == 200
    assert b"static/app.js" in body
    assert "script-src 'self'" in headers["content-security-policy"]
    status, _, body = get("/locks/api/locks")
    assert status == 200
    assert [r["holder"] for r in json.loads(body)["locks"]] == ["id-1"]
