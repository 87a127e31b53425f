"""setuptools' build backend, with one note silenced for editable installs of this layout.

An editable install of a package whose subpackages live in other folders (proxy/ is installed as
specproxy.proxy; see setup.py) goes through setuptools' import finder, which always ends with the
note "be careful with folders in your working directory with the same name as your package as they
may take precedence during imports". Here the one such folder is specproxy/ itself, the very
folder the finder maps the package to, so the note cannot apply; every other warning still shows.
"""

from __future__ import annotations

import warnings
from typing import Any

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403  (the rest of the PEP 517/660 hooks, unchanged)

SAME_NAME_NOTE = r"(?s).*folders in your working directory with the same\s+name as your package"


def build_editable(
    wheel_directory: str, config_settings: dict[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SAME_NAME_NOTE)
        name: str = build_meta.build_editable(wheel_directory, config_settings, metadata_directory)
        return name
