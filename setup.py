"""Maps the repository layout onto the ``agl`` import package (metadata lives in pyproject.toml)."""

from setuptools import find_packages, setup

core = find_packages("core", include=["agl", "agl.*"])
integrations = ["agl.integrations." + p for p in find_packages("integrations")]
setup(
    packages=core + ["agl.integrations"] + integrations,
    package_dir={"agl": "core/agl", "agl.integrations": "integrations"},
    package_data={"agl": ["py.typed", "data/*", "data/**/*"]},
)
