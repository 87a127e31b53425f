"""engines/README.md's walk-through on simulated arms, run as written: `engines up --engine sim`,
`serve` in the background, the streamed curl, `kill %1`, `analyze`, `engines down`. Only the ports
move (deploy/experiment.toml's 8001-8003 and the proxy's 8000 to free ones), since other runs may
hold those on a shared machine."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.support import free_ports, run_cli, start_cli, stop, wait_http

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "engines" / "README.md"
EXPERIMENT = "deploy/experiment.toml"


def _sim_flow() -> list[str]:
    """The walk-through's commands, each whole (continued lines and quotes over lines joined)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### The same flow on simulated arms") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the simulated flow has no commands"
    commands: list[str] = []
    pending = ""
    for line in block.group(1).replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending)
        except ValueError:  # a quote still open: the command goes on
            continue
        if pending.strip():
            commands.append(pending.strip())
        pending = ""
    assert not pending, f"an unfinished command: {pending}"
    return commands


def _curl(argv: list[str], port: int) -> bytes:
    """A `curl -s[N] URL -H ... -d BODY` line sent with urllib, to the proxy's port."""
    url = next(a for a in argv[1:] if a.startswith("localhost:8000/"))
    headers = dict(h.split(": ", 1) for h in (argv[i + 1] for i, a in enumerate(argv) if a == "-H"))
    body = argv[argv.index("-d") + 1].encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{url.removeprefix('localhost:8000')}", body)
    for name, value in headers.items():
        request.add_header(name, value)
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200
        return bytes(resp.read())


@pytest.mark.timeout(300)
def test_the_simulated_walk_through_runs_as_written(tmp_path: Path) -> None:
    proxy_port, *arm_ports = free_ports(4)
    text = (ROOT / EXPERIMENT).read_text(encoding="utf-8")
    for old, new in zip((8001, 8002, 8003), arm_ports, strict=True):
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    (tmp_path / "deploy").mkdir()
    (tmp_path / EXPERIMENT).write_text(text, encoding="utf-8")
    serve: subprocess.Popen[bytes] | None = None
    outputs: dict[str, str] = {}
    try:
        for line in _sim_flow():
            argv = shlex.split(line.replace("--port 8000", f"--port {proxy_port}"))
            if argv[0] == "specproxy" and argv[-1] == "&":
                assert argv[1] == "serve" and serve is None, line
                serve = start_cli(argv[1:-1], cwd=tmp_path)
                wait_http(f"http://127.0.0.1:{proxy_port}/health", proc=serve)
            elif argv[0] == "curl":
                streamed = _curl(argv, proxy_port)
                assert streamed.endswith(b"data: [DONE]\n\n"), streamed[-200:]
            elif argv == ["kill", "%1"]:
                assert serve is not None
                outputs["serve"] = stop(serve)
                assert serve.returncode == 0, outputs["serve"]
            elif argv[0] == "specproxy":
                done = run_cli(*argv[1:], cwd=tmp_path)
                assert done.returncode == 0, (line, done.stdout, done.stderr)
                outputs[argv[1] + (" " + argv[2] if argv[1] == "engines" else "")] = done.stdout
            else:
                raise AssertionError(f"a step this test does not know: {line}")
    finally:
        if serve is not None:
            stop(serve)
        run_cli("engines", "down", EXPERIMENT, cwd=tmp_path)
    assert list(outputs) == ["engines up", "engines status", "serve", "analyze", "engines down"]
    # the streamed call gives each arm a decode speed, and the candidates a speedup beside it
    analyzed = json.loads(run_cli("analyze", "specproxy.duckdb", "--format", "json", cwd=tmp_path).stdout)
    rows = {r["arm"]: r for r in analyzed["runs"][0]["rows"]}
    assert set(rows) == {"baseline", "ngram", "eagle3"}
    assert all(r["p50_decode_tok_s"] for r in rows.values()), rows
    assert all(rows[arm]["decode_speedup"]["point"] for arm in ("ngram", "eagle3")), rows
