"""Headless Chromium from Debian (chromium + chromium-driver), driven by Selenium, for the UI checks.

No browser is downloaded: Selenium is pointed at ``/usr/bin/chromium`` and
``/usr/bin/chromedriver`` (``e2e/run.sh`` installs both). Each browser gets a fresh
profile directory under the run directory and no background networking.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service

from .services import REPO

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
IMG_DIR = REPO / "docs" / "img"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
T = TypeVar("T")


@contextmanager
def chromium(run_dir: Path, width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A headless Chromium with a fresh ``--user-data-dir``; quit (and its driver stopped) on exit."""
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=run_dir)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    service = Service(CHROMEDRIVER, log_output=str(Path(run_dir) / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(what: str, probe: Callable[[], T], timeout: float = 60) -> T:
    """Poll ``probe`` until it returns something truthy (page still rendering: retry)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except WebDriverException as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {last}")


def page_text(driver: Any) -> str:
    return str(driver.execute_script("return document.body ? document.body.innerText : ''"))


def screenshot(driver: Any, name: str) -> Path:
    """Save a PNG under docs/img/ (what the docs link to) and return its path."""
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    path = IMG_DIR / name
    assert driver.save_screenshot(str(path)), f"could not save {path}"
    assert path.stat().st_size > 10_000, f"{path} is suspiciously small"
    return path
