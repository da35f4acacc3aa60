"""The browser tests' Chromium and screenshot folder, shared by both stores they look at (a ``Trainer.dev`` run
against the fake OpenAI server, and the README's main job with TorchGRPO on the tiny model)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
from playwright.sync_api import Browser, sync_playwright

CHROMIUM = os.environ.get("AGL_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("AGL_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"screenshots in {folder}")
    return folder
