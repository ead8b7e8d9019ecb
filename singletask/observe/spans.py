"""OpenTelemetry, when it is installed: singletask's attributes on the execution's span.

With ``opentelemetry-instrumentation-celery`` active, the body of a task runs inside its
``run/<task name>`` span, which is the current span in the executing thread.
:func:`current` takes it (None when OpenTelemetry is not in use or nothing records), so that
:mod:`singletask.observe.report` can set attributes on it and, from the renewer thread, add the
event of a lease loss. singletask never imports ``opentelemetry`` itself: it uses the API's
``trace`` module once something else (the instrumentation, the SDK) has imported it. It is no
dependency of singletask (the ``otel`` extra installs its API).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["add_event", "annotate", "current", "instrumented"]

logger = logging.getLogger("singletask")

#: The prefix of singletask's span attributes and span events.
PREFIX = "singletask."


def current() -> Any | None:
    """The span recording in this thread (the execution's ``run/...`` span), or None.

    OpenTelemetry is not imported here: a process where nothing has imported its ``trace``
    module (an instrumentation, an SDK) has no span recording, and pays nothing.
    """
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    try:
        span = trace.get_current_span()
        return span if span.is_recording() else None
    except Exception:
        logger.debug("singletask: could not read the current span", exc_info=True)
        return None


def instrumented() -> bool:
    """Whether OpenTelemetry's Celery instrumentation is active in this process (imported and
    instrumented); nothing is imported here."""
    module = sys.modules.get("opentelemetry.instrumentation.celery")
    instrumentor = getattr(module, "CeleryInstrumentor", None)
    try:
        return bool(instrumentor is not None and instrumentor().is_instrumented_by_opentelemetry)
    except Exception:
        return False


def annotate(span: Any | None, attributes: Mapping[str, object]) -> None:
    """Set ``attributes`` (those that are not None) on ``span``, prefixed; never raises."""
    if span is None:
        return
    try:
        for name, value in attributes.items():
            if value is not None:
                span.set_attribute(PREFIX + name, value)
    except Exception:
        logger.debug("singletask: could not set span attributes", exc_info=True)


def add_event(span: Any | None, name: str, attributes: Mapping[str, object]) -> None:
    """Add the event ``singletask.<name>`` to ``span`` (from any thread); never raises."""
    if span is None:
        return
    try:
        shown = {PREFIX + k: v for k, v in attributes.items() if v is not None}
        span.add_event(PREFIX + name, shown)
    except Exception:
        logger.debug("singletask: could not add a span event", exc_info=True)
