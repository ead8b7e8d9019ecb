"""No secret of a lock store's URL in any message, traceback, log line or repr, on every store.

The probe: for every URL scheme a backend is registered for, a URL whose password holds an
awkward character (a bare ``%``, ``@``, ``:``, ``/``, ``#``, written raw, as users do, or
percent-encoded, as they should) and points at a closed port (or a missing socket or file), run
through every path that can talk about it: the settings' check, building the backend (its repr),
an acquire (the connect error) and a task executed by Celery's tracer, which logs the failure.
Whatever each path does (refuse the URL, fail to connect, or work), no piece of the password may
show up in the exception's message, its chained causes and traceback, the logs or a repr.

``test_the_probe_covers_every_registered_scheme`` keeps the probe honest: a scheme added without
a URL template here fails it.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import celery
import pytest

from singletask import SingletaskError, SingletonTask
from singletask.backends import backend_from_url, known_schemes
from singletask.conf.settings import Settings

from ..servers import free_port

#: The password is LEFT + one awkward character + RIGHT: neither half may appear anywhere (a
#: parser that splits the URL at the awkward character would show one of them).
LEFT, RIGHT = "Lq7wPx", "Rz9kVy"
AWKWARD = {"percent": "%", "at": "@", "colon": ":", "slash": "/", "hash": "#"}

#: Per scheme: the URL for a password as written in the URL, a port nothing listens on and a
#: directory that exists; and the transport options the scheme needs.
TEMPLATES: dict[str, tuple[str, Mapping[str, Any]]] = {
    "redis": ("redis://:{pw}@127.0.0.1:{port}/0", {}),
    "rediss": ("rediss://:{pw}@127.0.0.1:{port}/0", {}),
    "unix": ("unix://:{pw}@{tmp}/no-redis.sock?db=0", {}),
    "sentinel": ("sentinel://:{pw}@127.0.0.1:{port}", {"master_name": "mymaster"}),
    "redis+cluster": ("redis+cluster://:{pw}@127.0.0.1:{port}", {}),
    "rediss+cluster": ("rediss+cluster://:{pw}@127.0.0.1:{port}", {}),
    "memory": ("memory://:{pw}@", {}),
    "sqlite": ("sqlite://:{pw}@/{tmp}/locks.db", {}),
    "postgresql": ("postgresql://app:{pw}@127.0.0.1:{port}/test?connect_timeout=2", {}),
    "postgres": ("postgres://app:{pw}@127.0.0.1:{port}/test?connect_timeout=2", {}),
    "postgresql+psycopg": (
        "postgresql+psycopg://app:{pw}@127.0.0.1:{port}/test?connect_timeout=2",
        {},
    ),
    "mysql": ("mysql://app:{pw}@127.0.0.1:{port}/test", {}),
    "mariadb": ("mariadb://app:{pw}@127.0.0.1:{port}/test", {}),
    "mysql+pymysql": ("mysql+pymysql://app:{pw}@127.0.0.1:{port}/test", {}),
    "memcached": ("memcached://app:{pw}@127.0.0.1:{port}", {}),
    # django:// names a cache of Django's CACHES; its secrets live there (see the test below),
    # and anything put in the URL's user info must not show either.
    "django": ("django://:{pw}@secret-probe", {}),
}

PASSWORDS = {
    **{f"raw-{name}": f"{LEFT}{char}{RIGHT}" for name, char in AWKWARD.items()},
    **{f"encoded-{name}": quote(f"{LEFT}{char}{RIGHT}", safe="") for name, char in AWKWARD.items()},
}


def test_the_probe_covers_every_registered_scheme() -> None:
    assert sorted(TEMPLATES) == known_schemes()


def _everything_said(exc: BaseException) -> str:
    """The message, chained causes and contexts, with their tracebacks and their args."""
    said = traceback.format_exception(exc)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        said.append(repr(current.args))
        current = current.__cause__ or current.__context__
    return "\n".join(said)


def _said_by(call: Callable[[], object]) -> str:
    """All ``call`` says: the error it raised, or the repr and str of what it returned."""
    try:
        value = call()
    except Exception as exc:  # any error, singletask's or not, is looked at
        return _everything_said(exc)
    return "" if isinstance(value, str) else f"{value!r}\n{value}"


def _leaks(text: str) -> list[str]:
    return [half for half in (LEFT, RIGHT) if half in text]


@pytest.fixture
def app() -> Iterator[celery.Celery]:
    app = celery.Celery("secrets", set_as_current=False)
    app.conf.update(task_always_eager=True, singletask_lock_backend_retry_max=0)
    yield app
    app.close()


def probe(
    app: celery.Celery, url: str, transport: Mapping[str, Any], caplog: pytest.LogCaptureFixture
) -> dict[str, str]:
    """What every path says about ``url``, by path."""
    app.conf.singletask_backend_url = url
    app.conf.singletask_backend_transport_options = dict(transport)
    said: dict[str, str] = {}

    @app.task(base=SingletonTask, shared=False, lazy=False, name="secrets.task")
    def task() -> str:
        return "ran"

    said["settings"] = _said_by(lambda: Settings.from_app(app).backend_url)
    said["settings repr"] = _said_by(lambda: Settings.from_app(app))

    def build_and_acquire() -> str:
        backend = backend_from_url(url, transport_options=transport or None)
        shown = f"{backend!r}\n{backend}\n"
        try:
            return shown + _said_by(lambda: backend.acquire("secrets:probe", "t", 5.0))
        finally:
            backend.close()

    said["backend"] = _said_by(build_and_acquire)
    result = task.apply()
    outcome = result.result
    said["task"] = _everything_said(outcome) if isinstance(outcome, BaseException) else ""
    said["task traceback"] = str(result.traceback)
    said["logs"] = caplog.text
    return said


@pytest.mark.parametrize("password", list(PASSWORDS))
@pytest.mark.parametrize("scheme", sorted(TEMPLATES))
def test_no_piece_of_a_password_shows_on_any_path_for_any_store(
    app: celery.Celery,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    scheme: str,
    password: str,
    request: pytest.FixtureRequest,
) -> None:
    if scheme == "django":
        request.getfixturevalue("django_caches")  # Django configured, as in a worker
    template, transport = TEMPLATES[scheme]
    url = template.format(pw=PASSWORDS[password], port=free_port(), tmp=tmp_path)
    caplog.set_level(logging.DEBUG)

    # When every path that can talk about the URL runs
    said = probe(app, url, transport, caplog)

    # Then no piece of the password shows on any of them
    leaked = {path: _leaks(text) for path, text in said.items() if _leaks(text)}
    assert not leaked, "\n\n".join(f"--- {path}:\n{said[path]}" for path in leaked)


@pytest.fixture
def secret_caches(django_caches: dict[str, dict[str, object]]) -> Iterator[dict[str, str]]:
    """Aliases of Django caches whose LOCATION holds each password, on a closed port."""
    from django.conf import settings

    aliases = {}
    for name, password in PASSWORDS.items():
        alias = f"secret-{name}"
        aliases[name] = alias
        settings.CACHES[alias] = {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": f"redis://:{password}@127.0.0.1:{free_port()}/0",
        }
    yield aliases
    for alias in aliases.values():
        settings.CACHES.pop(alias, None)


@pytest.mark.parametrize("password", list(PASSWORDS))
def test_no_piece_of_a_django_cache_password_shows_on_any_path(
    app: celery.Celery,
    caplog: pytest.LogCaptureFixture,
    secret_caches: dict[str, str],
    password: str,
) -> None:
    """django:// names a cache; the password is in the cache's LOCATION."""
    caplog.set_level(logging.DEBUG)

    said = probe(app, f"django://{secret_caches[password]}", {}, caplog)

    leaked = {path: _leaks(text) for path, text in said.items() if _leaks(text)}
    assert not leaked, "\n\n".join(f"--- {path}:\n{said[path]}" for path in leaked)


def test_a_connect_error_is_singletasks_error_on_every_network_store(
    app: celery.Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """The probe's connect cases do reach the connect error (not only a refusal of the URL)."""
    for scheme in ("redis", "postgresql", "mysql", "memcached"):
        template, transport = TEMPLATES[scheme]
        url = template.format(pw=PASSWORDS["encoded-at"], port=free_port(), tmp="/tmp")
        backend = backend_from_url(url, transport_options=transport or None)
        try:
            with pytest.raises(SingletaskError):
                backend.acquire("secrets:probe", "t", 5.0)
        finally:
            backend.close()
