"""The Celery app of the Django project: every CELERY_* Django setting configures it."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
# CELERY_BROKER_URL -> broker_url, CELERY_SINGLETASK_BACKEND_URL -> singletask_backend_url, ...
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
