"""Maps the top-level folders under the `rljob` namespace (see the note in pyproject.toml)."""

from setuptools import find_namespace_packages, setup

TOP_LEVEL = ("runtime", "operator")

packages = []
for top in TOP_LEVEL:
    packages.append(f"rljob.{top}")
    packages += [f"rljob.{top}.{sub}" for sub in find_namespace_packages(top, exclude=["*__pycache__*"])]

setup(
    packages=packages,
    package_dir={f"rljob.{top}": top for top in TOP_LEVEL},
    package_data={"": ["*.yaml", "*.json", "*.jsonl"]},
)
