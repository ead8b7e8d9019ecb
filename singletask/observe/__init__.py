"""What is told outside the process: Celery events, OpenTelemetry span attributes, Flower's task
page."""
