"""Helpers of the lock page's tests: one request through a WSGI or ASGI application, a lock
taken as an execution would take it."""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any
from wsgiref.util import setup_testing_defaults
from wsgiref.validate import validator

from singletask.backends.base import LockBackend
from singletask.ops.web import TOKEN_HEADER

TOKEN = "correct-horse-battery-staple"


class Answer:
    def __init__(self, status: str, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = int(status.split()[0])
        self.headers = {name.lower(): value for name, value in headers}
        self.body = body

    def json(self) -> Any:
        assert self.headers["content-type"] == "application/json"
        return json.loads(self.body)


def call(app: Any, method: str, path: str, body: bytes = b"", **environ: str) -> Answer:
    """One request to the WSGI application ``app``, through wsgiref's conformance checker."""
    path, _, query = path.partition("?")
    env: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "SCRIPT_NAME": "",
        "REMOTE_ADDR": "192.0.2.7",
        "wsgi.input": io.BytesIO(body),
        "CONTENT_LENGTH": str(len(body)),
        **environ,
    }
    setup_testing_defaults(env)
    started: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started[:] = [status, headers]
        return lambda data: None

    result = validator(app)(env, start_response)
    try:
        data = b"".join(result)
    finally:
        result.close()  # type: ignore[attr-defined]
    return Answer(started[0], started[1], data)


def release(page: Any, token: str | None, payload: object, **environ: str) -> Answer:
    headers = {"CONTENT_TYPE": "application/json", **environ}
    if token is not None:
        headers["HTTP_" + TOKEN_HEADER.upper().replace("-", "_")] = token
    return call(page, "POST", "/api/release", json.dumps(payload).encode(), **headers)


def hold(backend: LockBackend, key: str, task_id: str, task: str = "proj.sync") -> int:
    """Take ``key`` as a running execution of ``task_id`` would; returns the fence."""
    meta = {"task_id": task_id, "task": task, "scope": "execution", "hostname": "celery@w1",
            "pid": "4242", "since": f"{time.time():.3f}"}  # fmt: skip
    result = backend.acquire(key, f"{task_id}:0:abcdef012345:4242:00ff00ff", 30, meta=meta)
    assert result.acquired
    assert result.fence is not None
    return result.fence


def run_asgi(
    app: Any, scope: dict[str, Any], body: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request to the ASGI application ``app``, as an ASGI server makes it."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body[:10], "more_body": True},
                {"type": "http.request", "body": body[10:], "more_body": False}]  # fmt: skip

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    base = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
            "query_string": b"", "headers": [], "client": ("198.51.100.4", 5000),
            "server": ("127.0.0.1", 8000), "root_path": ""}  # fmt: skip
    asyncio.run(app({**base, **scope}, receive, send))
    start, content = sent
    headers = {name.decode(): value.decode() for name, value in start["headers"]}
    return start["status"], headers, content["body"]
