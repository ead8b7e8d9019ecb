"""The Django project of the example; importing it loads the Celery app, as Celery's guide says."""

from .celery import app as celery_app

__all__ = ["celery_app"]
