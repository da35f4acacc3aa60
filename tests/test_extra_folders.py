"""A whole-tree pytest run in a venv without verl, Ray or torch leaves their test folders out with one line
each (the README's quick loop), instead of failing at collection."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl.testing import extras
from agl.testing.extras import ExtraFolder, missing_for

TESTS = Path(__file__).resolve().parent


def test_a_folder_whose_packages_are_missing_is_left_out_with_the_session_that_runs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(extras.FOLDERS, "with_ray", ExtraFolder("ray", ("json", "agl_no_such_package")))
    line = missing_for(TESTS, TESTS / "with_ray")
    assert line == (
        "tests/with_ray left out: it needs agl_no_such_package, not installed here (run it with `nox -s ray`)"
    )


def test_folders_with_their_packages_and_other_paths_are_collected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(extras.FOLDERS, "with_ray", ExtraFolder("ray", ("json",)))
    assert missing_for(TESTS, TESTS / "with_ray") is None
    assert missing_for(TESTS, TESTS / "store") is None  # not a folder of an extra
    assert missing_for(TESTS, TESTS / "store" / "with_ray") is None  # only tests/<folder> itself


def test_every_extra_folder_exists_and_its_session_is_in_the_noxfile() -> None:
    noxfile = (TESTS.parent / "noxfile.py").read_text()
    for name, folder in extras.FOLDERS.items():
        assert (TESTS / name).is_dir(), name
        assert f"def {folder.session}(" in noxfile, folder.session
