"""The install matches the code: every core dependency is imported by the package, every third-party
module the package imports is declared (core or an extra), and an extra's module is imported only
inside the function that needs it, so a light install runs everything else. Imports are read with
:mod:`ast`, nothing is imported. And the light install stays light: the distributions its requirements
pull in, specproxy counted, are within INSTALL_BUDGET (CI's wheel stage counts a real install too)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FOLDERS = ("specproxy", *PROJECT["tool"]["specproxy"]["subpackages"])
# What `pip install specproxy` may pull into a fresh environment, specproxy counted; .ci/run's wheel
# stage holds a real install to the same number.
INSTALL_BUDGET = 20
# A distribution's import name where it differs from its name.
IMPORT_NAMES = {"pyyaml": "yaml", "prometheus-client": "prometheus_client", "llama-cpp-python": "llama_cpp"}
# Imported lazily on the machines that have them, declared by none of specproxy's own requirements:
# the GPU calibration's torch and flash-attn (engines/calibrate) come with the vllm extra's engine.
UNDECLARED = {"torch", "flash_attn", "vllm"}


def _module(requirement: str) -> str:
    name = re.split(r"[<>=~!;\[ ]", requirement, maxsplit=1)[0].strip().lower()
    return IMPORT_NAMES.get(name, name.replace("-", "_"))


# Modules that exist to wrap an extra, imported at their top: the package imports each only inside
# the function that needs it (the span sink imports the OTLP export's module when spans are exported).
WRAPPERS = {"proxy/spans/otel.py"}


def _imports() -> tuple[set[str], set[str]]:
    """The top-level modules the package imports: (at module level outside WRAPPERS, anywhere)."""
    top: set[str] = set()
    anywhere: set[str] = set()
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            at_top = set() if str(path.relative_to(ROOT)) in WRAPPERS else top
            for nodes, found in ((tree.body, at_top), (list(ast.walk(tree)), anywhere)):
                for node in nodes:
                    if isinstance(node, ast.Import):
                        found.update(alias.name.split(".")[0] for alias in node.names)
                    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                        found.add(node.module.split(".")[0])
    ours = {"specproxy", *FOLDERS}
    third = set(sys.stdlib_module_names) | ours | {"__future__"}
    return top - third, anywhere - third


def test_a_wrapper_of_an_extra_is_imported_only_where_it_is_needed() -> None:
    for wrapper in WRAPPERS:
        name = "specproxy." + wrapper.removesuffix(".py").replace("/", ".")
        for folder in FOLDERS:
            for path in (ROOT / folder).rglob("*.py"):
                tree = ast.parse(path.read_text(encoding="utf-8"))
                top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
                top |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
                assert name not in top, f"{path.relative_to(ROOT)} imports {name} at module level"


def test_every_core_dependency_is_imported_and_every_import_declared() -> None:
    core = {_module(r) for r in PROJECT["project"]["dependencies"]}
    extras = {_module(r) for rs in PROJECT["project"]["optional-dependencies"].values() for r in rs}
    # opentelemetry's distributions (sdk, exporter) are all imported as `opentelemetry`
    extras = {"opentelemetry" if m.startswith("opentelemetry") else m for m in extras}
    top, anywhere = _imports()
    assert core - anywhere == set(), "declared but never imported"
    assert anywhere - core - extras - UNDECLARED == set(), "imported but not declared"
    # an extra's module (tokenizers, the OTLP exporter, llama-cpp-python) waits for the code needing it
    assert top & (extras - core) == set(), "an extra imported at module level"


def _pulled_in(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` bring, transitively, as installed here; markers and extras
    are evaluated for this interpreter and no extra is asked for."""
    pulled: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in pulled or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        pulled.add(name)
        todo += [Requirement(r) for r in importlib.metadata.requires(name) or ()]
    return pulled


def test_the_light_install_pulls_no_more_than_its_budget() -> None:
    pulled = {"specproxy"} | _pulled_in(PROJECT["project"]["dependencies"])
    assert len(pulled) <= INSTALL_BUDGET, f"{len(pulled)} distributions: {sorted(pulled)}"
    # the count is of something real: aiohttp's own dependencies are in it
    assert {"aiohttp", "yarl", "multidict"} <= pulled
