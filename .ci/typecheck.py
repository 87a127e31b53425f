"""mypy over the source tree, with each top-level subpackage folder named as it is installed.

proxy/, engines/ and analysis/ are installed as specproxy.proxy, specproxy.engines and
specproxy.analysis (setup.py's package_dir). mypy names a file by its folders, and it cannot
read that mapping, so `mypy` alone would call proxy/server/app.py `proxy.server.app` and find no
`specproxy.proxy`. This runs mypy's own build with the installed names: the same checks as `mypy`
with pyproject.toml's [tool.mypy] settings, and errors reported at the real paths.

    python .ci/typecheck.py          # what CI's lint stage runs
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["specproxy"]["subpackages"]


def installed_name(path: Path) -> str | None:
    """specproxy.proxy.server.app for proxy/server/app.py; None outside the mapped folders."""
    relative = path.resolve().relative_to(REPO)
    if relative.parts[0] not in SUBPACKAGES:
        return None
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["specproxy", *parts])


def sources_with_installed_names(sources: list[BuildSource]) -> list[BuildSource]:
    renamed = []
    for source in sources:
        name = installed_name(Path(source.path)) if source.path else None
        renamed.append(BuildSource(source.path, name or source.module, source.text, source.base_dir))
    return renamed


def main() -> int:
    # With no arguments, the files are [tool.mypy]'s in pyproject.toml.
    sources, options = process_options(sys.argv[1:])
    try:
        result = build.build(sources_with_installed_names(sources), options)
    except CompileError as exc:
        messages = exc.messages
    else:
        messages = result.errors
    for line in messages:
        print(line)
    if messages:
        return 1
    print(f"typecheck: no issues in {len(sources)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
