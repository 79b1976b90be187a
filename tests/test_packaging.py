"""What a wheel of the package carries: every file the package reads besides its modules is declared package data.

An editable install reads files from the checkout, so a file left out of ``[tool.setuptools.package-data]`` works in
every test here and is missing after ``pip install mhla_diffusers`` (the data-free retrofit's default prompts, say).
"""

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_data_file_of_the_package_is_declared_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["mhla_diffusers"]
    package = ROOT / "mhla_diffusers"
    data = [p.relative_to(package).as_posix() for p in package.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data, "the package has no data file: this test would check nothing"
    undeclared = [f for f in data if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert not undeclared, f"add these to [tool.setuptools.package-data] in pyproject.toml: {undeclared}"
