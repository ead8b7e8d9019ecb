"""Fixtures of the operator surfaces' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from singletask.backends.base import LockBackend

from .limits import UNITS_STORES, units_store


@pytest.fixture(params=UNITS_STORES)
def limits_store(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, LockBackend]]:
    """A store that keeps named limits (each of ``UNITS_STORES``): its URL and a backend."""
    with units_store(request.param, request, monkeypatch) as store:
        yield store
