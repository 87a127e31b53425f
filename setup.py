"""The wheel's package list, found in the folders rather than written out, so none can be left out.

proxy/, engines/ and analysis/ sit at the top of the repository (the architecture a newcomer sees)
and are installed as specproxy.proxy, specproxy.engines and specproxy.analysis; everything else is
in pyproject.toml.
"""

from setuptools import find_packages, setup

SUBPACKAGES = ("proxy", "engines", "analysis", "lab")

packages = ["specproxy"]
for top in SUBPACKAGES:
    packages += [f"specproxy.{top}", *(f"specproxy.{top}.{name}" for name in find_packages(top))]

setup(
    packages=packages,
    package_dir={"specproxy": "specproxy", **{f"specproxy.{top}": top for top in SUBPACKAGES}},
)
