"""The console replay and the lab print with: plain lines off a terminal, and on a real pseudo-terminal
a live table that printed lines scroll above, erased and drawn again with nothing left behind. And
replay's summary says a health share as a percentage and seconds in milliseconds."""

from __future__ import annotations

import io
import os
import re
import threading
from datetime import UTC, datetime
from pathlib import Path

from specproxy.proxy.replay.console import Console, LiveBlock
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.replay.recording import ReplayResult
from specproxy.proxy.replay.summary import print_summary
from specproxy.proxy.spans.sink import HealthRow

ERASE = re.compile(r"\x1b\[(\d+)F\x1b\[J")


def test_off_a_terminal_lines_are_plain_and_printed_as_given() -> None:
    said = io.StringIO()
    console = Console(said)
    with ReplayProgress(["base", "[spec]:x"], console) as progress:
        progress.begin_phase("c=4", calls_per_arm=2)
        progress.record("base", completion_tokens=10, ok=True)
        progress.record("[spec]:x", completion_tokens=None, ok=False)
        progress.end_phase()
    console.print("over its limit", warning=True)
    lines = said.getvalue().splitlines()
    assert "\x1b" not in said.getvalue()
    assert lines[0].split() == ["c=4", "base", "done", "1", lines[0].split()[4], "tok/s", "errors", "0"]
    assert lines[1].split()[1:4] == ["[spec]:x", "done", "1"] and lines[1].endswith("errors 1")
    assert lines[2:] == ["over its limit"]


def _screen(raw: str) -> list[str]:
    """The lines left on a terminal after ``raw``: each erase removes the lines it moves up over."""
    lines: list[str] = []
    at = 0
    for erase in ERASE.finditer(raw):
        lines += raw[at : erase.start()].splitlines()
        count = int(erase.group(1))
        assert count <= len(lines), "an erase moved above what was drawn"
        del lines[len(lines) - count :]
        at = erase.end()
    return lines + raw[at:].splitlines()


def test_on_a_terminal_printed_lines_scroll_above_the_live_table() -> None:
    leader, follower = os.openpty()
    terminal = os.fdopen(follower, "w", encoding="utf-8")
    received = bytearray()

    def read_all() -> None:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the follower side closed
                return
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    console = Console(terminal)
    assert console.is_terminal
    drawn = threading.Event()
    count = [0]

    def render() -> list[str]:
        count[0] += 1
        drawn.set()
        return ["replay c=1", f"drawn {count[0]}"]

    with LiveBlock(console, render):
        assert drawn.wait(10), "the live block never drew"
        Console(terminal).print("a line from another console")
        console.print("over its limit", warning=True)
    console.print("after")
    terminal.close()
    reader.join(10)
    raw = received.decode().replace("\r\n", "\n")
    final = count[0]
    assert _screen(raw) == [
        "a line from another console",
        "\x1b[33mover its limit\x1b[0m",
        "replay c=1",
        f"drawn {final}",
        "after",
    ]
    os.close(leader)


def test_replay_says_a_health_share_as_a_percentage() -> None:
    now = datetime.now(UTC)
    health = [
        HealthRow("r", "client 2", 16, 3, "event_loop_lag_share", 0.031, 0.02, now),
        HealthRow("r", None, 16, 3, "loadgen_start_lag_p99_s", 0.0612, 0.05, now),
        HealthRow("r", None, 16, 3, "event_loop_lag_p99_s", 0.2, None, now),  # shown only: no line
    ]
    said = io.StringIO()
    print_summary(ReplayResult("r", Path("s.duckdb"), health=health), None, Console(said))
    health_lines = [line for line in said.getvalue().splitlines() if line.startswith("health:")]
    assert health_lines == [
        "health: c=16 round 3: event_loop_lag_share (client 2) = 3.1%, over its limit of 2.0%: the machine "
        "did not keep up, this round's figures are stretched",
        "health: c=16 round 3: loadgen_start_lag_p99_s = 61.2 ms, over its limit of 50.0 ms: the machine "
        "did not keep up, this round's figures are stretched",
    ]
