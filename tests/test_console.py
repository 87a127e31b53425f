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
from specproxy.proxy.replay.planning import parse_phase_label, phase_label
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.replay.recording import ReplayResult
from specproxy.proxy.replay.summary import print_summary
from specproxy.proxy.spans.sink import HealthRow

ERASE = re.compile(r"\x1b\[(\d+)F\x1b\[J")


def test_off_a_terminal_lines_are_plain_and_printed_as_given() -> None:
    said = io.StringIO()
    console = Console(said)
    with ReplayProgress(["base", "[spec]:x"], console) as progress:
        for label in ("c=4 r1/2", "c=4 r2/2", "c=4 r3 extra", "c=16"):
            progress.begin_phase(label, calls_per_arm=2)
            progress.record("base", completion_tokens=10, ok=True)
            progress.record("[spec]:x", completion_tokens=None, ok=label != "c=4 r2/2")
            progress.end_phase()
    console.print("over its limit", warning=True)
    lines = said.getvalue().splitlines()
    assert "\x1b" not in said.getvalue()
    # one line per level, its rounds folded in: a sweep's history stays one screen
    assert len(lines) == 4, lines
    assert lines[0].split()[:6] == ["c=4", "2", "rounds", "done", "2", "per"], lines[0]
    assert (
        "tok/s: base " in lines[0] and ", [spec]:x 0.0" in lines[0] and lines[0].endswith("errors [spec]:x 1")
    )
    assert lines[1].split()[:4] == ["c=4", "extra", "1", "round"] and lines[1].endswith("errors 0"), lines
    assert lines[2].split()[:3] == ["c=16", "1", "round"], lines[2]
    assert lines[3] == "over its limit"


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


def test_a_phase_label_reads_back_as_its_level_and_round() -> None:
    # the history line folds a level's rounds by these parts, so they must be phase_label's own
    for base in ("c=16", "2.0 req/s"):
        for round_, planned in ((1, 1), (2, 3), (3, 3), (4, 3)):
            want = (base, round_, planned if round_ <= planned else None)
            assert parse_phase_label(phase_label(base, round_, planned)) == want
