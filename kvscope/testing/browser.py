"""A real headless browser for the console's tests and benchmark: Debian's ``chromium`` driven through its
``chromium-driver`` (``chromedriver``) by Selenium, both found on PATH (``.ci/run`` installs them), nothing
downloaded (Selenium Manager is never asked: the driver's path is given).
"""

from __future__ import annotations

import shutil
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)


def find_browser() -> tuple[str, str] | None:
    """(the browser's path, its driver's path) on PATH, None when either is missing."""
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = next((p for p in map(shutil.which, DRIVERS) if p), None)
    return (browser, driver) if browser and driver else None


def headless_chromium(width: int = 1500, height: int = 1200) -> Any:
    """A Selenium ``webdriver.Chrome`` on the machine's chromium, headless, ``width`` x ``height`` CSS pixels,
    with the page's console log kept (``driver.get_log("browser")``). Raises FileNotFoundError when chromium
    or chromedriver is not on PATH. The caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_browser()
    if found is None:
        raise FileNotFoundError(
            "chromium and chromedriver must be on PATH (Debian: chromium chromium-driver)"
        )
    browser, driver = found
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in CI containers
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)
