"""Lock store URLs: one masking helper for every message, and strict checks of every part.

A password given in a URL must never show up in an exception message, a traceback (with its
chained causes) or a log line, whichever way the URL is wrong.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Callable, Iterator

import celery
import pytest

from singletask import BackendUnavailable, ConfigurationError, SingletaskError, SingletonTask
from singletask.backends import backend_from_url
from singletask.backends.redis.options import parse_redis_url
from singletask.backends.urls import mask_url
from singletask.conf.settings import Settings

from ..servers import free_port

PASSWORD = "pw-Zq81xT"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://:secret@host:6379/0", "redis://:**@host:6379/0"),
        ("redis://user:secret@host/1", "redis://user:**@host/1"),
        ("redis://secret@host/1", "redis://**@host/1"),
        ("redis://:se@cr/et@host/1", "redis://:**@host/1"),
        ("redis//:secret@host/0", "redis//:**@host/0"),
        ("redis:secret@host", "redis:**@host"),
        ("redis://:secret@host:99999/0", "redis://:**@host:99999/0"),
        ("redis://host/0?password=secret&db=1", "redis://host/0?password=**&db=1"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("memory://", "memory://"),
        # every secret option of the drivers, by its name percent-decoded, in any case
        ("postgresql://u:secret@h/db?sslpassword=secret&sslmode=require",
         "postgresql://u:**@h/db?sslpassword=**&sslmode=require"),
        ("postgresql://h/db?ssl%70assword=secret", "postgresql://h/db?ssl%70assword=**"),
        ("postgresql://h/db?SSLPassword=secret", "postgresql://h/db?SSLPassword=**"),
        ("postgresql://h/db?password=secret", "postgresql://h/db?password=**"),
        ("postgresql://h/db?oauth_client_secret=hunter2&scram_client_key=hunter2",
         "postgresql://h/db?oauth_client_secret=**&scram_client_key=**"),
        # libpq reads ";" and "#" as part of a value: masked up to the next "&"
        ("postgresql://h/db?sslpassword=a;secret#secret&x=1",
         "postgresql://h/db?sslpassword=**&x=1"),
        ("mysql://u:secret@h/db?ssl_key_password=secret", "mysql://u:**@h/db?ssl_key_password=**"),
        ("mysql://h/db?passwd=secret", "mysql://h/db?passwd=**"),
        ("rediss://h/0?ssl_password=secret&a=1;password=secret",
         "rediss://h/0?ssl_password=**&a=1;password=**"),
        ("sentinel://h:26379;sentinel://h2:26379?sentinel_password=secret",
         "sentinel://h:26379;sentinel://h2:26379?sentinel_password=**"),
        ("amqp://guest:secret@h:5672//?x-api-token=secret", "amqp://guest:**@h:5672//?x-api-token=**"),
    ],
)  # fmt: skip
def test_mask_url_hides_every_password(url: str, masked: str) -> None:
    """The helper masks passwords in well-formed and malformed URLs alike, and never raises."""
    assert mask_url(url) == masked
    assert "secret" not in mask_url(url).replace("client_secret=", "")
    assert "hunter2" not in mask_url(url)


def test_mask_url_takes_anything() -> None:
    assert mask_url(None) == "None"
    assert mask_url(["redis://:secret@h"]) == "['redis://:**@h']"


# -- a password through every error path ------------------------------------------------------


@pytest.fixture
def app() -> Iterator[celery.Celery]:
    app = celery.Celery("urls", set_as_current=False)
    yield app
    app.close()


def _unreachable() -> str:
    return f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0?socket_connect_timeout=1"


BAD_URLS = {
    "malformed": (f"redis//:{PASSWORD}@localhost/0", ConfigurationError, "not a URL|'://'"),
    "unknown-scheme": (f"etcd://:{PASSWORD}@localhost:2379", ConfigurationError, "'etcd'"),
    "bad-port": (f"redis://:{PASSWORD}@localhost:99999/0", ConfigurationError, "port"),
    "port-not-a-number": (f"redis://:{PASSWORD}@localhost:x/0", ConfigurationError, "port"),
    "bad-database": (f"redis://:{PASSWORD}@localhost/abc", ConfigurationError, "database"),
    "database-twice": (f"redis://:{PASSWORD}@localhost/1?db=2", ConfigurationError, "database"),
    "unknown-option": (f"redis://:{PASSWORD}@localhost/0?sokcet_timeout=1", ConfigurationError,
                       "unknown query option 'sokcet_timeout'"),
    "bad-option-value": (f"redis://:{PASSWORD}@localhost/0?socket_timeout=soon",
                         ConfigurationError, "socket_timeout"),
    "unix-without-path": (f"unix://:{PASSWORD}@", ConfigurationError, "socket's path"),
    "postgresql-bad-port": (f"postgresql://app:{PASSWORD}@db:99999/app", ConfigurationError,
                            "port"),
    "mysql-bad-port": (f"mysql://app:{PASSWORD}@db:x/app", ConfigurationError, "port"),
    "unreachable": (None, BackendUnavailable, "acquire"),
}  # fmt: skip


def _everything_said(exc: BaseException, logs: str, *more: str) -> str:
    return "\n".join([*traceback.format_exception(exc), logs, *more])


@pytest.mark.parametrize("case", list(BAD_URLS))
def test_a_password_never_leaks_from_any_error_path(
    app: celery.Celery, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Each way a lock store URL can be wrong gives singletask's own error, naming the setting
    and what is wrong with the URL, and the password appears in no message, traceback (causes
    included) or log line."""
    url, error, what = BAD_URLS[case]
    url = url or _unreachable()
    caplog.set_level(logging.DEBUG)

    # Given an app whose lock store URL is wrong in that way, and a singleton task on it
    app.conf.singletask_backend_url = url

    @app.task(base=SingletonTask, shared=False, lazy=False, name="urls.task")
    def task() -> str:
        return "ran"

    # When the task runs (eagerly, through Celery's tracer, which logs the failure)
    result = task.apply()

    # Then it failed with singletask's error, saying what is wrong
    exc = result.result
    assert isinstance(exc, error), repr(exc)
    assert isinstance(exc, SingletaskError)
    message = str(exc)
    assert re.search(what, message), message
    if error is ConfigurationError:
        assert "setting singletask_backend_url" in message
    # And the password is nowhere: message, traceback with its causes, logs, stored traceback
    said = _everything_said(exc, caplog.text, str(result.traceback))
    assert PASSWORD not in said

    # And the same holds when the URL is only checked, or a backend is built from it directly
    assert PASSWORD not in _said_by(lambda: Settings.from_app(app).backend_url)
    assert PASSWORD not in repr(Settings.from_app(app))
    assert PASSWORD not in _said_by(lambda: backend_from_url(url))


def _said_by(call: Callable[[], object]) -> str:
    """All ``call`` says: its error with traceback and causes, or the repr of the backend it
    returns (a URL it returns is the configured one, password included, as it must be)."""
    try:
        value = call()
    except SingletaskError as exc:
        return _everything_said(exc, "")
    if isinstance(value, str):
        return ""
    said = repr(value)
    getattr(value, "close", lambda: None)()
    return said


def test_a_redis_broker_used_as_the_lock_store_is_checked_naming_broker_url(
    app: celery.Celery,
) -> None:
    """Without singletask_backend_url, a bad Redis broker URL is refused naming broker_url."""
    app.conf.broker_url = f"redis://:{PASSWORD}@localhost:99999/0"

    with pytest.raises(ConfigurationError) as caught:
        Settings.from_app(app).backend_url  # noqa: B018

    assert "setting broker_url" in str(caught.value)
    assert PASSWORD not in _everything_said(caught.value, "")


# -- strict parsing -----------------------------------------------------------------------------


def test_a_database_that_is_not_a_number_is_refused_not_silently_zero() -> None:
    """redis-py reads redis://host/abc as database 0; singletask refuses it."""
    with pytest.raises(ConfigurationError, match="database must be a whole number"):
        parse_redis_url("redis://localhost/abc")


def test_a_port_out_of_range_is_a_configuration_error_not_a_value_error() -> None:
    """redis://host:99999/0 used to escape as a raw ValueError raised while building the
    error message."""
    with pytest.raises(ConfigurationError, match="port"):
        backend_from_url("redis://localhost:99999/0")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://localhost", {"host": "localhost"}),
        ("redis://:pw@h:6380/3", {"host": "h", "port": 6380, "db": 3, "password": "pw"}),
        ("redis://localhost/?db=4", {"host": "localhost", "db": 4}),
        ("redis://h/0?socket_timeout=1.5", {"host": "h", "db": 0, "socket_timeout": 1.5}),
        ("unix:///run/redis.sock?db=2", {"path": "/run/redis.sock", "db": 2}),
        ("rediss://h/0?ssl_cert_reqs=none", {"host": "h", "db": 0, "ssl_cert_reqs": "none"}),
    ],
)  # fmt: skip
def test_valid_redis_urls_parse_as_redis_py_reads_them(
    url: str, expected: dict[str, object]
) -> None:
    assert parse_redis_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "memory://?x=1",
        "memory:///path",
        "sqlite:///locks.db?journal=wal",
        "sqlite:///x.db?timeout=-1",
    ],
)
def test_other_stores_refuse_options_they_do_not_have(url: str) -> None:
    with pytest.raises(ConfigurationError):
        backend_from_url(url)
