"""Package metadata: the declared licence has its full text beside it, and the classifiers agree
with what the package ships."""

from __future__ import annotations

import sys

from tests.support.paths import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_the_declared_licence_has_its_full_text():
    assert project()["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    for mark in (
        "Version 2.0, January 2004",
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
        "END OF TERMS AND CONDITIONS",
        "APPENDIX: How to apply the Apache License to your work.",
    ):
        assert mark in text


def test_classifiers_match_the_package():
    classifiers = project()["classifiers"]
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: the license expression says it
    assert ("Typing :: Typed" in classifiers) == (REPO / "src" / "pdstate" / "py.typed").exists()
    floor = project()["requires-python"].removeprefix(">=")
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Programming Language :: Python :: 3.")]
    assert versions and versions[0] == floor
