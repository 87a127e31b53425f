"""The wheel's package list, found in the folders rather than written out, so none can be left out.

The folders that pyproject.toml's [tool.specproxy] subpackages names (proxy/, engines/, analysis/,
lab/) sit at the top of the repository, the architecture a newcomer sees, and are installed as
specproxy.proxy, specproxy.engines, ...; everything else is in pyproject.toml.
"""

import tomllib

from setuptools import find_packages, setup

with open("pyproject.toml", "rb") as pyproject:
    SUBPACKAGES = tomllib.load(pyproject)["tool"]["specproxy"]["subpackages"]

packages = ["specproxy"]
for top in SUBPACKAGES:
    packages += [f"specproxy.{top}", *(f"specproxy.{top}.{name}" for name in find_packages(top))]

setup(
    packages=packages,
    package_dir={"specproxy": "specproxy", **{f"specproxy.{top}": top for top in SUBPACKAGES}},
)
