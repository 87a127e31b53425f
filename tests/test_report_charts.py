"""The report's charts: no text leaves its SVG (estimated here, measured in headless Chromium where it
is installed), and no chart plots an UNRELIABLE level."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from specproxy.analysis import write_report
from specproxy.analysis.render.svg import FONT_SIZE, HEIGHT, WIDTH, text_width
from tests.spanfactory import ArmSpec, health_row, make_run, write_db
from tests.support import missing_tool

LEVELS = (1, 16, 256)
# A long arm name (its legend entry must be squeezed to fit) and a level the machine could not measure
# (c=256: the client's start lag over its limit) at which eagle3 reads an absurd 30x.
ARMS = [
    ArmSpec("baseline", "baseline", "none"),
    ArmSpec("eagle3", speedup=1.6, speedup_by_level={256: 30.0}),
    ArmSpec("draft_model_llama_3_2_1b_instruct", spec_method="draft_model", speedup=1.3),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> str:
    health = [
        health_row("run-1", level, "loadgen_start_lag_p99_s", 0.2 if level == 256 else 0.001)
        for level in LEVELS
    ]
    run = make_run(ARMS, levels=LEVELS, n_per_level=60, seed=5, rounds=3, health=health)
    folder = tmp_path_factory.mktemp("report")
    out = write_report([write_db(folder / "spans.duckdb", [run])], folder / "report.html")
    return out.read_text(encoding="utf-8")


def _svgs(html: str) -> list[str]:
    return re.findall(r"<svg .*?</svg>", html, re.S)


def _attrs(tag: str) -> dict[str, str]:
    return dict(re.findall(r'([a-zA-Z-]+)="([^"]*)"', tag))


def test_no_chart_plots_an_unreliable_level(report: str) -> None:
    assert "c=256 UNRELIABLE: " in report  # the level the charts must leave out
    points = [t for svg in _svgs(report) for t in re.findall(r"<circle [^>]*><title>([^<]*)</title>", svg)]
    assert points and all(re.search(r": (1|16) → ", t) for t in points), [
        t for t in points if not re.search(r": (1|16) → ", t)
    ]
    # the per-category panels share one axis, set by the levels measured soundly: not 0-30x
    small = report.split('<div class="charts small">', 1)[1].split("</div>", 1)[0]
    ticks = [float(t) for t in re.findall(r'text-anchor="end" class="tick"[^>]*>([0-9.]+)</text>', small)]
    assert ticks and max(ticks) < 3, ticks


def _extent(tag: str, text: str) -> tuple[float, float]:
    """The horizontal extent the text may take: its textLength if squeezed, else the estimate."""
    a = _attrs(tag)
    cls = a.get("class", "tick").split()[0]
    width = float(a["textLength"]) if "textLength" in a else text_width(text, FONT_SIZE[cls], cls == "title")
    x = float(a["x"])
    anchor = a.get("text-anchor", "start")
    left = x - width / 2 if anchor == "middle" else x - width if anchor == "end" else x
    return left, left + width


def test_no_chart_text_leaves_its_svg_by_estimate(report: str) -> None:
    """Each text's estimated extent (on the wide side for common sans-serif faces) stays inside the
    chart: the titles centred over the whole chart, split in two when long, legends squeezed."""
    checked = 0
    for svg in _svgs(report):
        for tag, text in re.findall(r"(<text [^>]*>)([^<]*)</text>", svg):
            text = text.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&#x27;", "'")
            if "transform" in tag:  # the rotated y label: its length runs along the height
                assert text_width(text, FONT_SIZE["label"]) <= HEIGHT, text
                continue
            left, right = _extent(tag, text)
            assert 0 <= left and right <= WIDTH, (text, left, right)
            checked += 1
    assert checked > 100


# Run in the page: every <text> of every chart against its <svg>, as laid out by the browser.
MEASURE_JS = """
<script>
const out = [];
for (const svg of document.querySelectorAll("svg")) {
  const box = svg.getBoundingClientRect();
  for (const t of svg.querySelectorAll("text")) {
    const r = t.getBoundingClientRect();
    if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 ||
        r.bottom > box.bottom + 0.5) {
      out.push({chart: svg.getAttribute("aria-label"), text: t.textContent,
                left: r.left - box.left, right: box.right - r.right});
    }
  }
}
const pre = document.createElement("pre");
pre.id = "measured";
pre.textContent = JSON.stringify({svgs: document.querySelectorAll("svg").length, out: out});
document.body.appendChild(pre);
</script>
"""


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_no_chart_text_leaves_its_svg_in_chromium(report: str, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        missing_tool(
            "no headless Chromium here (Debian: apt-get install chromium); the estimate test above ran",
            "browser",
        )
    page = tmp_path / "report.html"
    page.write_text(report.replace("</body>", MEASURE_JS + "</body>"), encoding="utf-8")
    argv = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--dump-dom",
        page.as_uri(),
    ]
    # A deadline under pytest's own, so a stuck browser fails the test instead of outliving it.
    dom = subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom.stdout, re.S)
    assert found, dom.stderr[-2000:]
    measured: dict[str, Any] = json.loads(
        found.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    )
    assert measured["svgs"] == len(_svgs(report))
    assert measured["out"] == []
