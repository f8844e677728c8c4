"""Client strings made safe to log and to check, and gRPC's undecodable-request log made one line.

Anything a client sends (a dataset prefix, an array name, a save id, an abort reason) may be
megabytes long or hold newlines and control characters that forge log lines. `loggable` cuts
such a string to a few hundred characters and escapes it; `check_text` refuses one as a
request field, naming the field. gRPC logs every request it cannot decode with a full
traceback (logger `grpc._common`: "Exception deserializing message!"), so a client sending
garbage fills the log; `quiet_undecodable_requests` makes what gRPC logs of one a single line,
and a request that does not decode reaches its handler as an `Undecodable` (which
`grpc_utils.UndecodableRequests` answers INVALID_ARGUMENT). This module imports no grpc, so core
modules and configs can use it.

    log.warning("save given up: %s", loggable(request.reason))
    check_text(prefix, "spec.prefixes[0]", 4096, DataError)
"""

from __future__ import annotations

import logging
import unicodedata

# Characters of a client string kept in a log line or an error message.
LOG_LIMIT = 200


def loggable(value: object, limit: int = LOG_LIMIT) -> str:
    """`value` quoted and escaped as `repr` does (no newline or control character gets through),
    cut to its first `limit` characters, saying how long it was when cut.

    Args:
        value: a client's string (anything else is turned into one with `str`).
        limit: characters of the value kept.

    Returns:
        The text to put into a log line or an error message.
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def text_problem(value: str, max_chars: int, allow_empty: bool = False) -> str | None:
    """Why `value` cannot be a name or path field of a request, or None when it can: empty,
    longer than `max_chars`, or holding a NUL or another control character (a newline
    included: names are matched whole, and a NUL cuts a path short in the C library)."""
    if not value and not allow_empty:
        return "is empty"
    if len(value) > max_chars:
        return f"is {len(value)} characters long, over the limit of {max_chars}"
    for i, ch in enumerate(value):
        if unicodedata.category(ch) in ("Cc", "Cs"):  # control characters, lone surrogates
            return f"holds the control character {ch!r} at position {i}"
    return None


def check_text(
    value: str, field: str, max_chars: int, error: type[Exception], allow_empty: bool = False
) -> str:
    """Returns `value`, or raises `error` naming `field` and what is wrong with it (see
    `text_problem`), the value quoted through `loggable`.

    Args:
        value: the field's value.
        field: the field's name in the request, for the message.
        max_chars: the longest value accepted.
        error: the exception class raised (the service's error for a bad request).
        allow_empty: accept "".
    """
    problem = text_problem(value, max_chars, allow_empty)
    if problem is not None:
        raise error(f"{field} {loggable(value)} {problem}")
    return value


_UNDECODABLE = "Exception deserializing message!"


class _OneLineUndecodable(logging.Filter):
    """Rewrites gRPC's "Exception deserializing message!" record (with its traceback) into one
    line naming the error; other records pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _UNDECODABLE and record.exc_info:
            exc = record.exc_info[1]
            record.msg = (
                "dropped a request that could not be decoded (its client gets INTERNAL): %s: %s"
            )
            record.args = (type(exc).__name__, loggable(str(exc)))
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_undecodable_requests() -> None:
    """Makes gRPC log each request it cannot decode as one line instead of a traceback
    (idempotent; the filter sits on gRPC's `grpc._common` logger, so it is process-wide)."""
    logger = logging.getLogger("grpc._common")
    if not any(isinstance(f, _OneLineUndecodable) for f in logger.filters):
        logger.addFilter(_OneLineUndecodable())


class Undecodable:
    """What a request that does not decode is handed to the handler as (its decoding error)."""

    def __init__(self, exc: Exception):
        self.exc = exc
