"""engines/README.md's `specproxy sim` examples, run as written (ports swapped for free ones)."""

from __future__ import annotations

import json
import re
import shlex
import urllib.request
from pathlib import Path

from tests.support import free_port, start_cli, stop, wait_http

README = Path(__file__).resolve().parents[1] / "engines" / "README.md"


def _commands() -> list[list[str]]:
    text = README.read_text()
    section = text.split("<!-- section: sim -->", 1)[1].split("<!-- /section: sim -->", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_readme_examples_run() -> None:
    commands = _commands()
    sims = [c for c in commands if c[:2] == ["specproxy", "sim"]]
    curls = [c for c in commands if c and c[0] == "curl"]
    assert len(sims) == 3 and curls
    procs = {}
    try:
        for argv in sims:
            port = argv[argv.index("--port") + 1]
            argv = [*argv[2:]]
            new_port = free_port()
            argv[argv.index("--port") + 1] = str(new_port)
            procs[port] = (new_port, start_cli(["sim", *argv, "--time-scale", "20"]))
        for new_port, proc in procs.values():
            wait_http(f"http://127.0.0.1:{new_port}/health", proc=proc)
        post, get = curls[0], curls[1]
        url = post[post.index("-s") + 1]
        port = re.search(r":(\d+)/", url).group(1)  # type: ignore[union-attr]
        target = "http://" + url.replace(f"localhost:{port}", f"127.0.0.1:{procs[port][0]}")
        headers = dict(h.split(": ", 1) for h in (post[i + 1] for i, a in enumerate(post) if a == "-H"))
        data = post[post.index("-d") + 1].encode()
        request = urllib.request.Request(target, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=10) as r:
            body = json.loads(r.read())
        assert body["id"] == "chatcmpl-r1" and body["metrics"]["speculative_decoding"]["num_spec_tokens"] == 3
        truth_url = "http://" + get[get.index("-s") + 1].replace(
            f"localhost:{port}", f"127.0.0.1:{procs[port][0]}"
        )
        with urllib.request.urlopen(truth_url, timeout=10) as r:
            truth = json.loads(r.read())
        assert truth["category"] == "summarization" and truth["draft_tokens"] == 3 * truth["num_drafts"]
    finally:
        for _, proc in procs.values():
            stop(proc)
            if proc.stdout is not None:
                proc.stdout.close()
