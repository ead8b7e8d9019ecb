"""Lock keys: one canonical key per task, or per task and argument values.

* No ``lock_args`` / ``lock_key``: ``<prefix><task name>`` (one lock for the whole task).
* ``lock_args``: the call is bound to the task's signature with defaults applied, the chosen
  arguments are serialised canonically (kombu's JSON, sorted keys, no whitespace) and hashed
  with SHA-256: ``<prefix><task name>:<64 hex digits>``. So ``f(1)``, ``f(a=1)`` and
  ``f(1, b=<default>)`` share a key, as do a tuple and a list, or two dicts in any order.
  Argument values never appear in the key.
* ``lock_key``: a format string over parameter names (``"feed:{url}"``) or a callable called
  with the task's arguments; its text replaces the hash: ``<prefix><task name>:<text>``.

The parts are encoded so that no two (task name, suffix) pairs share a key: in the task name,
``%``, ``:``, ``{`` and ``}`` are percent-escaped (``%25``, ``%3A``, ``%7B``, ``%7D``), so the
first ``:`` after the prefix always ends the name; in the suffix, ``%``, ``{`` and ``}`` are,
so no key part but the prefix can form a Redis Cluster hash tag.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import string
from collections.abc import Callable, Mapping, Sequence
from json import encoder as json_encoder
from typing import Any

from kombu.utils import json as kombu_json

from ..exceptions import ConfigurationError, LockKeyError

__all__ = [
    "KeySpec", "canonical_json", "digest", "escape_name", "escape_suffix", "run_signature",
    "unescape_name",
]  # fmt: skip

#: The value of ``lock_args`` that selects every parameter.
ALL_ARGS = "*"


#: What the task name and the suffix of a key escape (see the module's docstring).
_NAME_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D"})
_UNESCAPED = {"%25": "%", "%3A": ":", "%7B": "{", "%7D": "}"}
_UNESCAPE = re.compile("%25|%3A|%7B|%7D")
_SUFFIX_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})

#: The conversions ``str.format`` knows (``{value!r}``).
_CONVERSIONS = (None, "r", "s", "a")


def escape_name(task_name: str) -> str:
    """The task name as it appears in a key: ``%``, ``:``, ``{`` and ``}`` percent-escaped."""
    return task_name.translate(_NAME_ESCAPES)


def unescape_name(text: str) -> str:
    """The task name :func:`escape_name` wrote as ``text`` (every other ``%`` sequence kept)."""
    return _UNESCAPE.sub(lambda found: _UNESCAPED[found.group()], text)


def escape_suffix(suffix: str) -> str:
    """A key's suffix as it appears in the key: ``%``, ``{`` and ``}`` percent-escaped."""
    if "%" in suffix or "{" in suffix or "}" in suffix:  # else as it is (a digest always is)
        return suffix.translate(_SUFFIX_ESCAPES)
    return suffix


#: kombu's JSON encoder as ``kombu.utils.json.dumps(value, sort_keys=True, separators=(",", ":"),
#: ensure_ascii=False)`` builds it for each call; it keeps no state between calls, and types
#: registered with kombu later are still seen (``default`` looks them up on each call).
_ENCODER = kombu_json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _one_shot() -> Callable[[Any, int], Sequence[str]] | None:
    """The C encoder that ``_ENCODER.encode`` builds anew for each value, built once (the
    same arguments, but no circular-reference check: see :func:`canonical_json`); None where
    the ``json`` module has no C accelerator, or where it does not encode as ``_ENCODER``."""
    make = getattr(json_encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        encode: Callable[[Any, int], Sequence[str]] = make(
            None, _ENCODER.default, json_encoder.encode_basestring, _ENCODER.indent,
            _ENCODER.key_separator, _ENCODER.item_separator, _ENCODER.sort_keys,
            _ENCODER.skipkeys, _ENCODER.allow_nan,
        )  # fmt: skip
        sample = {"b": [1, 2.5, None, True, '\u00e9"\n'], "a": {"y": -3, "x": ""}}
        if "".join(encode(sample, 0)) != _ENCODER.encode(sample):
            return None
    except Exception:
        return None
    return encode


_C_ENCODE = _one_shot()


def canonical_json(value: Any) -> str:
    """Serialise ``value`` with kombu's JSON encoder, keys sorted, no whitespace.

    Raises:
        TypeError: A value cannot be serialised.
        ValueError: A value refers to itself, or is a float JSON cannot write.
    """
    if _C_ENCODE is not None:
        try:
            return "".join(_C_ENCODE(value, 0))
        except Exception:
            pass  # a value it cannot write (or one that refers to itself): said below
    text: str = _ENCODER.encode(value)
    return text


def digest(arguments: Mapping[str, Any], *, where: str) -> str:
    """Return the SHA-256 hex digest of the canonical JSON of ``arguments``.

    Raises:
        LockKeyError: An argument cannot be serialised; the message names it.
    """
    try:
        text = canonical_json(arguments if type(arguments) is dict else dict(arguments))
    except (TypeError, ValueError) as exc:
        for name, value in arguments.items():
            try:
                canonical_json(value)
            except (TypeError, ValueError) as inner:
                raise LockKeyError(
                    f"{where}: argument {name!r} cannot be part of a lock key: {inner}"
                ) from inner
        raise LockKeyError(f"{where}: arguments cannot be part of a lock key: {exc}") from exc
    # "surrogatepass": a lone surrogate in a str argument hashes (to its own key) instead of
    # failing; the text is only hashed, never stored.
    hexdigest: str = _sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return hexdigest


def _builtin_sha256() -> Callable[[bytes], Any]:
    """Python's own SHA-256 (the same digest as OpenSSL's, made with fewer instructions for a
    key's few bytes), or ``hashlib``'s where the interpreter was built without it."""
    for module in ("_sha2", "_sha256"):  # its name since Python 3.12, and before
        try:
            sha256: Callable[[bytes], Any] = importlib.import_module(module).sha256
        except (ImportError, AttributeError):
            continue
        return sha256
    return hashlib.sha256


_sha256 = _builtin_sha256()


def run_signature(task_cls: type) -> inspect.Signature | None:
    """The signature a task is called with (``self`` dropped), or None if ``run`` is not defined.

    ``@app.task`` stores plain functions as a ``staticmethod`` and ``bind=True`` functions and
    class-based ``run`` methods as functions whose first parameter is the task.
    """
    from celery import Task

    run = inspect.getattr_static(task_cls, "run", None)
    if run is None or run is inspect.getattr_static(Task, "run"):
        return None
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    if isinstance(run, classmethod):
        return inspect.signature(run.__func__).replace(
            parameters=list(inspect.signature(run.__func__).parameters.values())[1:]
        )
    signature = inspect.signature(run)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


class KeySpec:
    """How one task class turns a call into a lock key; validated when built.

    Args:
        task_name: The task's name as known when the class is created, for error messages
            (the key uses the registered name, passed to :meth:`key`).
        signature: The task's call signature, or None when unknown (then only a global key,
            a ``lock_key`` callable or ``lock_args="*"`` can be used).
        lock_args: None, a sequence of parameter names, or ``"*"``.
        lock_key: None, a format string over parameter names, or a callable.

    Raises:
        ConfigurationError: The attributes are invalid or conflict; the message names the task
            and the attribute.
    """

    def __init__(
        self,
        task_name: str,
        signature: inspect.Signature | None,
        lock_args: Sequence[str] | str | None,
        lock_key: str | Callable[..., str] | None,
    ) -> None:
        self.task_name = task_name
        self.signature = signature
        #: The last key head built, ``(prefix, task name, head)``: the same for every call of
        #: a task (its prefix and registered name), so it is escaped once, not per call.
        self._head: tuple[str, str, str] = ("", "", "")
        self.lock_args: tuple[str, ...] | str | None = None
        self.lock_key = lock_key
        self._where = where = f"task {task_name!r}"
        self._simple = _simple_parameters(signature)
        try:
            task_name.encode()
        except UnicodeEncodeError as exc:
            raise ConfigurationError(
                f"{where}: the task name cannot be part of a lock key: {exc.reason}"
            ) from exc
        if lock_args is not None and lock_key is not None:
            raise ConfigurationError(
                f"{where}: set lock_key or lock_args, not both "
                "(lock_key replaces the key derived from lock_args)"
            )
        params = set(signature.parameters) if signature is not None else None
        if lock_args is not None:
            self.lock_args = self._check_args(lock_args, params, where)
        if isinstance(lock_key, str):
            self._check_format(lock_key, params, where)
        elif lock_key is not None and not callable(lock_key):
            raise ConfigurationError(
                f"{where}: lock_key must be a format string or a callable, got {lock_key!r}"
            )

    @staticmethod
    def _check_args(
        lock_args: object, params: set[str] | None, where: str
    ) -> tuple[str, ...] | str:
        if lock_args == ALL_ARGS:
            return ALL_ARGS
        if isinstance(lock_args, str):
            raise ConfigurationError(
                f"{where}: lock_args must be a sequence of parameter names or '*', "
                f"got the string {lock_args!r} (did you mean ({lock_args!r},)?)"
            )
        if not isinstance(lock_args, Sequence) or not all(isinstance(n, str) for n in lock_args):
            raise ConfigurationError(
                f"{where}: lock_args must be a sequence of parameter names or '*', "
                f"got {lock_args!r}"
            )
        if not lock_args:
            raise ConfigurationError(
                f"{where}: lock_args is empty; use None for one lock per task name"
            )
        if params is None:
            raise ConfigurationError(
                f"{where}: lock_args needs a task with a run() signature to check names against"
            )
        unknown = [name for name in lock_args if name not in params]
        if unknown:
            raise ConfigurationError(
                f"{where}: lock_args names {', '.join(map(repr, unknown))}, which "
                f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} "
                f"of the task (parameters: {', '.join(sorted(params)) or 'none'})"
            )
        return tuple(lock_args)

    @staticmethod
    def _check_format(template: str, params: set[str] | None, where: str) -> None:
        """Check what can be checked of a ``lock_key`` template without a call: its syntax,
        conversions, and that every field (also in a nested format spec) names a parameter.
        What depends on the values (attributes, indexes, format specs) is checked per call."""
        shown = f"{where}: lock_key {template!r}"
        try:
            template.encode()
        except UnicodeEncodeError as exc:
            raise ConfigurationError(f"{shown} is not valid text: {exc.reason}") from exc
        pending, fields = [template], []
        while pending:
            try:
                parsed = list(string.Formatter().parse(pending.pop()))
            except ValueError as exc:
                raise ConfigurationError(f"{shown} is not valid: {exc}") from exc
            for _, field, spec, conversion in parsed:
                if field is None:
                    continue
                if conversion not in _CONVERSIONS:
                    raise ConfigurationError(
                        f"{shown}: field {{{field}!{conversion}}} has an unknown conversion "
                        f"{conversion!r}; use !r, !s or !a, or none"
                    )
                fields.append(field)
                if spec and "{" in spec:
                    pending.append(spec)
        for field in fields:
            base = field.split(".", 1)[0].split("[", 1)[0]
            if not base or base.isdigit():
                raise ConfigurationError(
                    f"{shown} uses a positional field; "
                    "name parameters instead, e.g. '{customer_id}'"
                )
            if params is not None and base not in params:
                raise ConfigurationError(
                    f"{shown} uses field {base!r}, which is not a "
                    f"parameter of the task (parameters: {', '.join(sorted(params)) or 'none'})"
                )

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults applied (order is irrelevant)."""
        if self._simple is not None:
            positional, names, defaults = self._simple
            if not kwargs and len(args) == len(names) == len(positional):
                return dict(zip(positional, args, strict=True))  # every parameter, in order
            if len(args) <= len(positional):
                arguments = dict(zip(positional, args, strict=False))
                for name, value in kwargs.items():
                    if name in arguments or name not in names:
                        break  # an error: let inspect word it
                    arguments[name] = value
                else:
                    for name, default in defaults:
                        arguments.setdefault(name, default)
                    if len(arguments) == len(names):
                        return arguments
        assert self.signature is not None
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise LockKeyError(
                f"task {self.task_name!r}: cannot build the lock key, the arguments do not "
                f"match the task's signature: {exc}"
            ) from exc
        bound.apply_defaults()
        return dict(bound.arguments)

    def suffix(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """The part of the key after the task name for one call, or None for a global lock.

        Raises:
            LockKeyError: The key cannot be built from these arguments.
        """
        where = self._where
        if self.lock_key is not None:
            if callable(self.lock_key):
                try:
                    text = self.lock_key(*args, **kwargs)
                except LockKeyError:
                    raise
                except Exception as exc:
                    raise LockKeyError(
                        f"{where}: lock_key callable {_name_of(self.lock_key)} raised "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                if not isinstance(text, str) or not text:
                    raise LockKeyError(
                        f"{where}: lock_key callable must return a non-empty str, got {text!r}"
                    )
                return _checked_text(text, f"{where}: the text lock_key callable returned")
            if self.signature is None:
                return self._format(args, kwargs)
            return self._format((), self._bind(args, kwargs))
        if self.lock_args is None:
            return None
        if self.lock_args == ALL_ARGS:
            if self.signature is None:
                return digest({"args": list(args), "kwargs": dict(kwargs)}, where=where)
            return digest(self._bind(args, kwargs), where=where)
        arguments = self._bind(args, kwargs)
        return digest({name: arguments[name] for name in self.lock_args}, where=where)

    def _format(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The ``lock_key`` template formatted with a call's arguments.

        Raises:
            LockKeyError: A value does not fit the template (a missing attribute or item, a
                format spec its type rejects, text that is not valid UTF-8); the message names
                the task, the template and the argument, and the error is chained.
        """
        template = self.lock_key
        assert isinstance(template, str)
        try:
            return _checked_text(template.format(*args, **kwargs), "")
        except Exception as exc:
            culprit = _culprit(template, args, kwargs)
            cause = exc.__cause__ if isinstance(exc, LockKeyError) else exc
            raise LockKeyError(
                f"{self._where}: lock_key {template!r} cannot be formatted with "
                f"{culprit}: {type(cause).__name__}: {cause}. Make the template fit every value "
                "the argument can take, or use a lock_key callable"
            ) from cause

    def key(
        self, prefix: str, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> str:
        """The full lock key for one call: ``<prefix><task name>[:<suffix>]``, with the task
        name and the suffix escaped (see :func:`escape_name` and :func:`escape_suffix`).

        Raises:
            LockKeyError: The key cannot be built from these arguments.
        """
        suffix = self.suffix(args, kwargs)
        head = self._head
        if head[0] != prefix or head[1] != task_name or not head[2]:
            head = self._head = (prefix, task_name, f"{prefix}{escape_name(task_name)}")
        base = head[2]
        return base if suffix is None else f"{base}:{escape_suffix(suffix)}"


def _checked_text(text: str, what: str) -> str:
    """``text`` if it is valid UTF-8 text (no lone surrogates), else LockKeyError."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise LockKeyError(
            f"{what}: {exc.reason} at position {exc.start}; a lock key must be valid text"
        ) from exc
    return text


def _name_of(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


def _culprit(template: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """Which argument of a call breaks ``template`` (each field formatted on its own)."""
    for _, field, spec, conversion in string.Formatter().parse(template):
        if field is None:
            continue
        one = "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
        try:
            one.format(*args, **kwargs).encode()
        except Exception:
            base = field.split(".", 1)[0].split("[", 1)[0]
            value = kwargs.get(base) if base in kwargs else None
            kind = f" (type {type(value).__name__})" if base in kwargs else ""
            return f"argument {base!r}{kind} in field {{{field}}}"
    return "these arguments"


def _simple_parameters(
    signature: inspect.Signature | None,
) -> tuple[tuple[str, ...], frozenset[str], tuple[tuple[str, Any], ...]] | None:
    """For a signature without ``*args``, ``**kwargs`` or positional-only parameters: its
    positional parameter names, all its names and its defaults, to bind calls without
    :meth:`inspect.Signature.bind` (which gives the same arguments, more slowly). Else None.
    """
    if signature is None:
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = list(signature.parameters.values())
    if any(p.kind not in kinds for p in parameters):
        return None
    return (
        tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD),
        frozenset(p.name for p in parameters),
        tuple((p.name, p.default) for p in parameters if p.default is not p.empty),
    )
