"""The examples in the package's docstrings run, and print what they say they print."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import tomllib
from pathlib import Path

import pytest

import specproxy

SUBPACKAGES = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["tool"][
    "specproxy"
]["subpackages"]


def _modules_with_examples() -> list[str]:
    """Every module of the package and of its subpackages (each installed from its own folder, so
    walked from its own path) whose docstrings hold an example."""
    infos = list(pkgutil.walk_packages(specproxy.__path__, "specproxy."))
    for sub in SUBPACKAGES:
        package = importlib.import_module(f"specproxy.{sub}")
        infos += pkgutil.walk_packages(package.__path__, f"specproxy.{sub}.")
    names = []
    for info in infos:
        if info.name.endswith("__main__"):
            continue  # runs a command on import
        module = importlib.import_module(info.name)
        if any(t.examples for t in doctest.DocTestFinder().find(module)):
            names.append(info.name)
    return sorted(set(names))


MODULES = _modules_with_examples()


def test_examples_are_found() -> None:
    assert len(MODULES) >= 20, MODULES  # a walk that silently found nothing would pass every case below


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
    )
