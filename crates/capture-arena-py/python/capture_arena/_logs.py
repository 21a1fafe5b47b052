"""The package's loggers, whose records show outside input safely.

Log arguments are often outside input: a sample id from a request, a control endpoint or a
store id from a result, a vLLM request id a client chose, an error naming any of them. Every
logger here renders each string (and exception) argument bounded and escaped: at most
``MAX_ARG_CHARS`` characters (the rest counted, not shown), and control characters, line
separators and lone surrogates written as escapes. So no input can write a log line of
megabytes, forge a line of its own (a newline in a request id), or make a record a handler
cannot encode (a lone surrogate raises in a UTF-8 file handler, and in pytest-xdist's report
of captured logs).
"""

from __future__ import annotations

import logging
import re
from typing import Any

#: The characters of one string argument shown, at most.
MAX_ARG_CHARS = 2000

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def shown(text: str, limit: int = MAX_ARG_CHARS) -> str:
    """``text`` as a log line may show it: bounded and escaped."""
    more = len(text) - limit
    if more > 0:
        text = text[:limit]
    text = _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)
    return f"{text}... ({more} more characters)" if more > 0 else text


class _Shown:
    """An argument other than a number (a string, an exception, a dict from a result), shown
    bounded and escaped by ``%s`` and ``%r`` alike."""

    __slots__ = ("_v",)

    def __init__(self, v: object) -> None:
        self._v = v

    def __str__(self) -> str:
        return shown(str(self._v))

    def __repr__(self) -> str:
        return shown(repr(self._v))


def _safe(arg: Any) -> Any:
    if arg is None or isinstance(arg, (int, float)):  # %d, %g and %x need the number
        return arg
    return _Shown(arg)


class _SafeArgs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if isinstance(record.args, tuple):
                record.args = tuple(_safe(a) for a in record.args)
            elif isinstance(record.args, dict):
                record.args = {k: _safe(v) for k, v in record.args.items()}
        except Exception:  # a record is never lost to its arguments
            pass
        return True


_FILTER = _SafeArgs()


def get(name: str) -> logging.Logger:
    """The logger ``name``, its records' arguments bounded and escaped."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log
