"""The package's loggers, whose records show outside input safely.

Log arguments are often outside input: a sample id from a request, a control endpoint or a
store id from a result, a vLLM request id a client chose, an error naming any of them. Every
logger here renders each argument other than a number (strings, exceptions, containers, any
object) bounded and escaped: at most ``MAX_ARG_CHARS`` characters (the rest counted, not shown),
and control characters, line separators and lone surrogates written as escapes; a record's
traceback ends in its exception's text on one escaped line. So no input can write a log line of
megabytes, forge a line of its own (a newline in a request id), or make a record a handler
cannot encode (a lone surrogate raises in a UTF-8 file handler, and in pytest-xdist's report
of captured logs).
"""

from __future__ import annotations

import itertools
import logging
import numbers
import re
import reprlib
from collections.abc import Callable, Mapping
from typing import Any

#: The characters of one string argument shown, at most.
MAX_ARG_CHARS = 2000

#: The most characters the ``repr`` of a string cut to MAX_ARG_CHARS renders to.
_RENDERED_CUT = 10 * MAX_ARG_CHARS + 2

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def shown(text: str, limit: int = MAX_ARG_CHARS) -> str:
    """``text`` as a log line may show it: bounded and escaped."""
    more = len(text) - limit
    if more > 0:
        text = text[:limit]
    text = _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)
    return f"{text}... ({more} more characters)" if more > 0 else text


def _text(v: object, how: Callable[[object], str]) -> str:
    """``how(v)`` (``str`` or ``repr``) bounded and escaped: a string is cut before it is
    rendered (``repr`` of 100 MB would first make 100 MB more), and an object whose ``str`` or
    ``repr`` raises is named by its type (a log call never raises for its arguments)."""
    try:
        # What is left once cut is shown whole: its repr escapes a character in at most 10
        # (``\U000e0001``), and cutting it again would add a second, wrong count.
        if isinstance(v, str) and len(v) > MAX_ARG_CHARS:
            return f"{shown(how(v[:MAX_ARG_CHARS]), _RENDERED_CUT)}... ({len(v) - MAX_ARG_CHARS} more characters)"
        if isinstance(v, (bytes, bytearray)) and len(v) > MAX_ARG_CHARS:
            return f"{shown(how(bytes(v[:MAX_ARG_CHARS])), _RENDERED_CUT)}... ({len(v) - MAX_ARG_CHARS} more bytes)"
        if isinstance(v, (dict, list, tuple, set, frozenset)):
            return shown(_REPR.repr(v))  # bounded in items and depth before it is rendered
        return shown(how(v))
    except RecursionError:
        return f"<{type(v).__name__} nested too deeply to show>"
    except Exception:  # noqa: BLE001 - any fault of the argument's own
        return f"<{type(v).__name__} that cannot be shown>"


# A container argument: two levels of 32 items, each string or other item 200 characters, at
# most (about 200 KB rendered before the cut). Its bounds are set one by one: Python 3.10 and
# 3.11 take no arguments.
_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = 32
_REPR.maxstring = _REPR.maxother = 200

#: The characters of a record's traceback shown, at most (its end: the exception is there).
MAX_TRACEBACK_CHARS = 20000


class _Shown:
    """An argument other than a number (a string, an exception, a dict from a result), shown
    bounded and escaped by ``%s`` and ``%r`` alike."""

    __slots__ = ("_v",)

    def __init__(self, v: object) -> None:
        self._v = v

    def __str__(self) -> str:
        return _text(self._v, str)

    def __repr__(self) -> str:
        return _text(self._v, repr)


def _safe(arg: Any) -> Any:
    if arg is None or (isinstance(arg, numbers.Number) and not isinstance(arg, complex)):
        return arg  # %d, %g and %x need the number (numpy's and torch's scalars too)
    return _Shown(arg)


class _SafeArgs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if isinstance(record.args, tuple):
                record.args = tuple(_safe(a) for a in record.args)
            elif isinstance(record.args, Mapping):  # log("%(name)s", {...}): its values by name
                named = itertools.islice(record.args.items(), 256)
                record.args = _Named({_text(k, str): _safe(v) for k, v in named}, record.args)
            if record.exc_info and not record.exc_text:
                record.exc_text = _traceback(record.exc_info)
        except Exception:  # a record is never lost to its arguments
            pass
        return True


def _traceback(exc_info: Any) -> str:
    """A record's traceback as handlers show it (``exc_text``), its exception's text held to the
    rule of arguments: after the last frame, one escaped line (a newline in an id cannot forge
    a line), no lone surrogate anywhere, at most MAX_TRACEBACK_CHARS (the end kept)."""
    lines = logging.Formatter().formatException(exc_info).split("\n")
    # The last frame: its "  File ..." line, then its source and marker lines (indented).
    end = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=0) + 1
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    text = "\n".join([*lines[:end], shown("\n".join(lines[end:]), MAX_TRACEBACK_CHARS // 2)])
    if len(text) > MAX_TRACEBACK_CHARS:
        text = f"... ({len(text) - MAX_TRACEBACK_CHARS} characters before)\n{text[-MAX_TRACEBACK_CHARS:]}"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class _Named(dict):  # type: ignore[type-arg]
    """A mapping's values by name, bounded and escaped; ``%s`` of the mapping itself (its only
    use besides names) shows the original bounded."""

    def __init__(self, values: dict[str, Any], original: Mapping[Any, Any]) -> None:
        super().__init__(values)
        self._original = original

    def __str__(self) -> str:
        return _text(self._original, repr)

    __repr__ = __str__


_FILTER = _SafeArgs()


def get(name: str) -> logging.Logger:
    """The logger ``name``, its records' arguments bounded and escaped."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log
