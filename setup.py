"""Maps the top-level folders under the `rljob` namespace (see the note in pyproject.toml)."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

# Layers, bottom up (docs/architecture.md). An image may ship a subset: the operator image has no runtime/.
TOP_LEVEL = tuple(top for top in ("api", "common", "runtime", "operator") if (Path(__file__).parent / top).is_dir())

packages = []
for top in TOP_LEVEL:
    packages.append(f"rljob.{top}")
    packages += [f"rljob.{top}.{sub}" for sub in find_namespace_packages(top, exclude=["*__pycache__*"])]

setup(
    packages=packages,
    package_dir={f"rljob.{top}": top for top in TOP_LEVEL},
    package_data={"": ["*.yaml", "*.json", "*.jsonl"]},
)
