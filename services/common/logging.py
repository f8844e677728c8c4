"""Logging setup shared by every command: one format, level from MESHTRAIN_LOG_LEVEL."""

from __future__ import annotations

import logging
import os
import sys


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at each record (test runners swap and close it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; always follow sys.stderr
        pass


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once (idempotent); level defaults to $MESHTRAIN_LOG_LEVEL or
    INFO."""
    level = (level or os.environ.get("MESHTRAIN_LOG_LEVEL", "INFO")).upper()
    root = logging.getLogger()
    if not any(getattr(h, "_meshtrain", False) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
        handler._meshtrain = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
