"""Lines for a person on stderr, and one live block (replay's progress table) redrawn below them.

What replay and the lab print is plain text, one line per call of :meth:`Console.print`, never wrapped
or reinterpreted (a bracket or a colon in an arm's name is printed as it is). On a terminal a warning is
yellow; elsewhere (a pipe, a CI log, a test's buffer) no escape code is written.

:class:`LiveBlock` keeps a few lines at the bottom of a terminal up to date from a thread a few times a
second: before a line is printed the block is erased, after it the block is drawn again, so printed
lines scroll above it as they would without it. Only ANSI cursor movement is used (``ESC [ n F``:
up n lines; ``ESC [ J``: clear below), which every terminal emulator in use understands.

Example::

    console = Console()
    with LiveBlock(console, lambda: [f"done {n}"]):
        console.print("c=16 done")
    console.print("over its limit", warning=True)
"""

from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

YELLOW = "\x1b[33m"
RED = "\x1b[31m"
RESET = "\x1b[0m"


class Console:
    """Plain lines to ``file`` (sys.stderr at the time of each print when none is given)."""

    def __init__(self, file: TextIO | None = None) -> None:
        self._file = file

    @property
    def file(self) -> TextIO:
        return self._file if self._file is not None else sys.stderr

    @property
    def is_terminal(self) -> bool:
        isatty = getattr(self.file, "isatty", None)
        return bool(isatty and isatty())

    def colour(self, text: str, code: str) -> str:
        """``text`` in the colour of ``code`` on a terminal, unchanged elsewhere."""
        return f"{code}{text}{RESET}" if self.is_terminal else text

    def print(self, text: str = "", *, warning: bool = False) -> None:
        line = self.colour(text, YELLOW) if warning else text
        live = _shown
        if live is not None and live.console.file is self.file:
            live.print_above(line)
            return
        self.file.write(line + "\n")
        self.file.flush()


# The live block on screen, if any: every Console writing to its file prints above it.
_shown: LiveBlock | None = None


class LiveBlock:
    """``render()``'s lines kept at the bottom of the console's terminal while the block is entered.

    Off a terminal it does nothing. On leaving, the last lines drawn stay on screen."""

    def __init__(self, console: Console, render: Callable[[], list[str]], per_second: float = 4) -> None:
        self.console = console
        self.render = render
        self.period_s = 1 / per_second
        self._lock = threading.Lock()
        self._drawn = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LiveBlock:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        global _shown
        if self.console.is_terminal and _shown is None:
            _shown = self
            self._thread = threading.Thread(target=self._refresh_until_stopped, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        global _shown
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._redraw()
        self._drawn = 0
        _shown = None

    def print_above(self, line: str) -> None:
        with self._lock:
            self._erase()
            self.console.file.write(line + "\n")
            self._draw()

    def _refresh_until_stopped(self) -> None:
        while not self._stop.wait(self.period_s):
            self._redraw()

    def _redraw(self) -> None:
        with self._lock:
            self._erase()
            self._draw()

    def _erase(self) -> None:
        if self._drawn:
            self.console.file.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def _draw(self) -> None:
        # A line wider than the terminal would take two rows and the erase would miss one: cut it.
        width = shutil.get_terminal_size().columns
        lines = self.render()
        for line in lines:
            self.console.file.write(_cut(line, width) + "\n")
        self._drawn = len(lines)
        self.console.file.flush()


def _cut(line: str, width: int) -> str:
    """``line`` cut to ``width`` visible characters (a colour code is not visible; it is kept whole)."""
    if len(line) <= width:
        return line
    shown = 0
    out: list[str] = []
    i = 0
    while i < len(line) and shown < width:
        if line.startswith("\x1b[", i):
            end = line.index("m", i) + 1
            out.append(line[i:end])
            i = end
            continue
        out.append(line[i])
        shown += 1
        i += 1
    return "".join(out) + RESET
