"""The app of the ``celery -A tests.e2e.beat_app beat`` subprocesses of test_beat.py.

It is the e2e app (:mod:`tests.e2e.app`, built from the same environment variables as the
worker's) with one schedule entry, read from ``SINGLETASK_E2E_BEAT`` as JSON:
``{"task": name, "args": [...], "every": seconds}``. The entry follows the recipe of the docs:
``options={"expires": every}``, so that a tick nobody picks up within its period is dropped.
"""

from __future__ import annotations

import json
import os

from .app import app

BEAT_ENV = "SINGLETASK_E2E_BEAT"

if app is not None and os.environ.get(BEAT_ENV):
    _entry = json.loads(os.environ[BEAT_ENV])
    app.conf.beat_schedule = {
        "singleton-tick": {
            "task": _entry["task"],
            "schedule": float(_entry["every"]),
            "args": tuple(_entry.get("args", ())),
            "options": {"expires": float(_entry["every"])},
        }
    }

__all__ = ["BEAT_ENV", "app"]
