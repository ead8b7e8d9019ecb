"""Settings of the example project: a shop whose order sync must never run twice at once.

The servers come from environment variables so that the test suite can point the example at
its own; the defaults are the usual local ports.
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "example-only-not-secret"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["shop"]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DATABASE", str(BASE_DIR / "db.sqlite3")),
    }
}

CACHES = {
    # The page cache may be anything ...
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    # ... the lock cache must be shared by every worker process: memcached or Redis.
    "locks": {
        "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
        "LOCATION": os.environ.get("SHOP_MEMCACHED", "127.0.0.1:11211"),
        "OPTIONS": {"connect_timeout": 2, "timeout": 2},
    },
}

# Celery, through the CELERY_ namespace (see proj/celery.py).
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("SHOP_RESULTS", "redis://127.0.0.1:6379/1")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("SHOP_QUEUE", "shop")
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

# singletask, through the same namespace: locks in the "locks" cache.
CELERY_SINGLETASK_BACKEND_URL = os.environ.get("SHOP_LOCKS", "django://locks")
CELERY_SINGLETASK_LOCK_TTL = 60
