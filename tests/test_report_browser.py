"""qkit report in a real browser: headless Chromium (Debian's ``chromium``) driven by Selenium.

The page is built from the small JSON fixtures of ``helpers_report`` (no model runs). The browser opens it
from ``file://``, finds every section by id, reads the console log (no error), takes a screenshot that is
not blank, and opens it again with networking disabled (a proxy to a closed port and DevTools' offline
emulation): it must render the same, and load no resource at all either time (the Resource Timing API).
Skips with the reason when selenium, chromium or chromedriver is absent.
"""

from __future__ import annotations

import io
import os
import shutil

import pytest

pytest.importorskip("matplotlib", reason="qkit report needs the report extra (matplotlib)")
webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test drives Chromium with selenium (pip install selenium)")

from helpers_report import write_docs  # noqa: E402  (the fixtures, in the shapes the commands write)

from qkit.report import SECTION_IDS, build_report, write_report  # noqa: E402

CHROMIUM = os.environ.get("QKIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = os.environ.get("QKIT_CHROMEDRIVER") or shutil.which("chromedriver")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)"),
    pytest.mark.skipif(CHROMEDRIVER is None, reason="no chromedriver on PATH (Debian: apt-get install chromium-driver)"),
]

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,3000")


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    d = tmp_path_factory.mktemp("browser")
    r = build_report(list(write_docs(d).values()), run="none")
    out = d / "report.html"
    write_report(r, out)
    r.close()
    return out.resolve().as_uri()


def _driver(profile, offline: bool):
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for f in FLAGS:
        options.add_argument(f)
    options.add_argument(f"--user-data-dir={profile}")  # a new, empty profile
    if offline:
        options.add_argument("--proxy-server=127.0.0.1:9")  # every request would go to a closed port
        options.add_argument("--proxy-bypass-list=<-loopback>")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    if offline:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.emulateNetworkConditions",
                               {"offline": True, "latency": 0, "downloadThroughput": 0, "uploadThroughput": 0})
    return driver


def _check_page(driver, url: str) -> bytes:
    from selenium.webdriver.common.by import By

    driver.get(url)
    assert driver.title.startswith("qkit report: ")
    for sid in SECTION_IDS:
        el = driver.find_element(By.ID, sid)
        assert el.is_displayed() and el.size["height"] > 0, sid
    svgs = driver.find_elements(By.CSS_SELECTOR, "section svg")
    assert len(svgs) == 9 and all(s.size["width"] > 100 and s.size["height"] > 100 for s in svgs)
    # every figure's image (a heatmap's raster is a data: URI inside the SVG) decoded: naturalWidth > 0
    assert driver.execute_script(
        "return Array.from(document.querySelectorAll('svg image')).every(i => i.getBBox().width > 0)")
    assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0  # nothing fetched
    errors = [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")]
    assert errors == []
    return driver.get_screenshot_as_png()


def _not_blank(png: bytes) -> None:
    from PIL import Image  # matplotlib's own dependency

    img = Image.open(io.BytesIO(png)).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 24)
    assert colours is not None and len(colours) > 200, "the screenshot has almost no distinct colours"
    white = max(colours)[0] / (img.width * img.height)
    assert white < 0.97, f"the screenshot is {100 * white:.1f}% one colour"


@pytest.mark.parametrize("offline", [False, True], ids=["online", "offline"])
def test_page_renders_in_chromium(page_url, tmp_path, offline):
    driver = _driver(tmp_path / "profile", offline)
    try:
        png = _check_page(driver, page_url)
    finally:
        driver.quit()
    _not_blank(png)
