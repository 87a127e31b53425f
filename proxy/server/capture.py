"""Capture: every client request as one replayable JSON line (``serve --capture FILE``).

One line per client request, written when the proxy is done with it, so lines are in completion
order (sort by ``arrival_unix_s`` for arrival order); ``specproxy replay FILE`` reads them::

    {"arrival_unix_s": 1764412345.123456, "request_id": "…", "path": "/v1/chat/completions",
     "category": "code", "body": {…the client's request body, unchanged…},
     "status": "ok", "response_text": "…"}

``category`` is the ``X-Specproxy-Category`` header (null when absent); ``status`` is the outcome of
the call that served the client; ``response_text`` (the text the client received) is present only
with ``--capture-responses``. Headers are not captured, so no Authorization header or API key ever
reaches the file.

Lines are buffered and written by a background thread every ``flush_interval_s`` (the event loop never
waits on the disk); :meth:`CaptureWriter.close` writes what is left.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import orjson


class CaptureWriter:
    def __init__(
        self, path: str | Path, *, with_responses: bool = False, flush_interval_s: float = 0.5
    ) -> None:
        self.path = Path(path)
        self.with_responses = with_responses
        self._flush_interval_s = flush_interval_s
        self._lines: list[bytes] = []
        self._lock = threading.Lock()
        self._file = self.path.open("ab")
        self._task: asyncio.Task[None] | None = None
        self.written = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._flush_periodically())

    def add(
        self,
        *,
        arrival_unix_s: float,
        request_id: str,
        path: str,
        category: str | None,
        body: dict[str, Any],
        status: str,
        response_text: str | None,
    ) -> None:
        line: dict[str, Any] = {
            "arrival_unix_s": arrival_unix_s,
            "request_id": request_id,
            "path": path,
            "category": category,
            "body": body,
            "status": status,
        }
        if self.with_responses and response_text is not None:
            line["response_text"] = response_text
        data = orjson.dumps(line) + b"\n"
        with self._lock:
            self._lines.append(data)

    def _write_out(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        if lines:
            self._file.write(b"".join(lines))
            self._file.flush()
            self.written += len(lines)

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval_s)
            await asyncio.to_thread(self._write_out)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._write_out()
        self._file.close()
