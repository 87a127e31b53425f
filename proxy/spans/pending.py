"""The bounded hand-off between the span sink's emitters (any thread, the event loop) and its writer
thread: producers never block; what does not fit is dropped and counted."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from specproxy.proxy.spans.rows import BackendMetricRow
from specproxy.proxy.spans.table import Row
from specproxy.proxy.spans.trace import TraceParent


class PendingWrites:
    """The bounded hand-off between emitters and the writer thread; producers never block."""

    def __init__(self, capacity: int, batch_size: int) -> None:
        self._lock = threading.Lock()
        self.wake = threading.Event()
        self._capacity = capacity
        self._batch_size = batch_size
        self._rows: list[Row] = []
        self._parents: list[TraceParent | None] = []
        self._metric_rows: list[BackendMetricRow] = []
        self._closed = False
        self.dropped = 0
        self.dropped_metric_rows = 0

    def offer(self, row: Row, parent: TraceParent | None) -> bool:
        with self._lock:
            if self._closed or len(self._rows) >= self._capacity:
                self.dropped += 1
                return False
            self._rows.append(row)
            self._parents.append(parent)
            full_batch = len(self._rows) == self._batch_size
        if full_batch:
            self.wake.set()
        return True

    def count_dropped(self, n: int = 1) -> None:
        with self._lock:
            self.dropped += n

    def offer_metrics(self, rows: Sequence[BackendMetricRow]) -> bool:
        with self._lock:
            if self._closed or len(self._metric_rows) + len(rows) > self._capacity:
                self.dropped_metric_rows += len(rows)
                return False
            self._metric_rows.extend(rows)
        self.wake.set()
        return True

    def take(self, max_rows: int) -> tuple[list[Row], list[TraceParent | None], list[BackendMetricRow]]:
        with self._lock:
            rows, parents = self._rows[:max_rows], self._parents[:max_rows]
            del self._rows[:max_rows], self._parents[:max_rows]
            metric_rows, self._metric_rows = self._metric_rows, []
        return rows, parents, metric_rows

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.wake.set()

    @property
    def depth(self) -> int:
        return len(self._rows)

    @property
    def settled(self) -> bool:
        """Nothing queued."""
        with self._lock:
            return not self._rows and not self._metric_rows
