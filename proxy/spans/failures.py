"""What the span writer says when the store fails: few lines, and loud ones where it matters.

A full disk fails every batch, some a second: one ERROR per batch buries the log (48 lines in 3 s).
:class:`WriteFailures` logs the first failed batch in full, then at most one summary line every
:data:`SUMMARY_EVERY_S` with what failed since (and one more at close). :func:`close_store` runs the
store's final checkpoint itself, so that its failure (the spans since the last checkpoint are then only
in the write-ahead log next to the file) is said loudly instead of vanishing in ``close()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("specproxy.proxy.spans.sink")  # (the writer's own logger: one place to look)

SUMMARY_EVERY_S = 30.0


class WriteFailures:
    """Failed span batches, logged as one line for the first and then a summary per period."""

    def __init__(self, db_path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.db_path = db_path
        self._clock = clock
        self._last_line: float | None = None  # when the last line was written
        self._batches = 0  # failed batches since that line
        self._spans = 0
        self._last_error: Exception | None = None

    def failed(self, n_failed: int, n_rows: int, error: Exception) -> None:
        """``n_failed`` of a batch of ``n_rows`` spans could not be written (dropped)."""
        now = self._clock()
        if self._last_line is None:
            self._last_line = now
            log.error(
                "%d of %d spans could not be written to %s (dropped): %s (further failures are summed "
                "up every %.0f s)",
                n_failed,
                n_rows,
                self.db_path,
                error,
                SUMMARY_EVERY_S,
            )
            return
        self._batches += 1
        self._spans += n_failed
        self._last_error = error
        if now - self._last_line >= SUMMARY_EVERY_S:
            self.summary()

    def summary(self) -> None:
        """The failures not yet reported, in one line (none: nothing is written)."""
        if self._batches and self._last_line is not None:
            now = self._clock()
            log.error(
                "%d more batches (%d spans) could not be written to %s in the last %.0f s (dropped); "
                "the last error: %s",
                self._batches,
                self._spans,
                self.db_path,
                now - self._last_line,
                self._last_error,
            )
            self._last_line = now
        self._batches = self._spans = 0


def close_store(conn: Any, failures: WriteFailures) -> None:
    """The failures' last summary, the final checkpoint (said loudly when it fails), the close."""
    db_path = failures.db_path
    failures.summary()
    try:
        conn.execute("CHECKPOINT")
    except Exception as exc:  # (a full disk: duckdb.IOException)
        log.error(
            "THE FINAL CHECKPOINT OF %s FAILED: %s. The spans written since the last checkpoint are "
            "only in its write-ahead log (%s.wal): keep that file beside it (DuckDB replays it when the "
            "store is opened next) and free space before opening it",
            db_path,
            exc,
            db_path,
        )
    try:
        conn.close()
    except Exception as exc:
        log.error("closing the span store %s failed: %s", db_path, exc)
