"""What the builder and the prebuilt lookup share: the JIT's logger and file digests.

A leaf of the package's import graph (``build`` and ``prebuilt`` import it; it imports neither).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("flashinfer_h3.jit")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (not at import), so
    redirections by the application or the test runner are honoured."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _setup_logger() -> None:
    # A library logger with its own handler: the compile line must reach a user who never
    # configured logging, and a minute of silence looks like a hang. FLASHINFER_H3_LOG_LEVEL
    # (e.g. WARNING) silences it.
    if logger.handlers:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("flashinfer_h3: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("FLASHINFER_H3_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


_setup_logger()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
