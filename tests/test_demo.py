"""The web demo in a real headless Chromium: a CSD run compared with AR, then bad input."""

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("SPECULAAS_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="Debian's chromium is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def page(demo_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"])
        pg = browser.new_page(viewport={"width": 1150, "height": 1200})
        pg.goto(demo_url)
        pg.wait_for_selector("#method option[value=csd]", state="attached")
        yield pg
        browser.close()


def _submit(page):
    page.click("#run")
    page.wait_for_function("document.getElementById('run').disabled === false "
                           "&& document.getElementById('status').textContent !== 'generating...'",
                           timeout=120_000)


def test_csd_compared_with_ar_shows_images_maps_and_numbers(page):
    page.fill("#caption", "a big red circle on the left over grass")
    page.select_option("#method", "csd")
    page.check("#compare")
    _submit(page)
    assert page.inner_text("#error") == ""
    runs = page.query_selector_all(".run")
    assert [r.get_attribute("data-method") for r in runs] == ["csd", "ar"]
    for r in runs:
        for cls in ("image", "acceptance", "entropy"):
            src = r.query_selector(f"img.{cls}").get_attribute("src")
            assert src.startswith("data:image/png;base64,") and len(src) > 200
        assert int(r.query_selector(".fp").inner_text()) > 0
    assert runs[1].query_selector(".fp").inner_text() == "256"  # AR: one forward per token
    assert int(runs[0].query_selector(".fp").inner_text()) < 256
    for r in runs:  # colour scales beside the maps; no order map in raster order
        assert len(r.query_selector_all(".scale .bar")) == 2 and r.query_selector("img.order") is None
    speed = page.inner_text("#speed")
    assert "fewer forward passes than AR" in speed and ("faster" in speed or "slower" in speed)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)


@pytest.mark.parametrize("field,value,message", [
    ("#delta", "2", "delta must be between 0.0 and 1.0"),
    ("#window", "0", "window must be between 1 and 64"),
    ("#caption", "", "please enter a caption"),
    ("#caption", "x" * 10_000, "the limit is 300"),
    ("#caption", "a purple dragon", "does not know"),
])
def test_bad_input_shows_a_message_and_the_server_keeps_serving(page, field, value, message):
    page.fill("#caption", "a small blue square on the right at sunset")
    page.fill("#delta", "0.65")
    page.fill("#window", "16")
    page.uncheck("#compare")
    _submit(page)
    assert len(page.query_selector_all(".run")) == 1
    page.fill(field, value)
    _submit(page)
    assert message in page.inner_text("#error")
    assert page.query_selector_all(".run") == []  # the last pictures do not stay under it
    page.fill("#caption", "a small blue square on the right at sunset")
    page.fill("#delta", "0.65")
    page.fill("#window", "16")
    _submit(page)
    assert page.inner_text("#error") == ""
    assert [r.get_attribute("data-method") for r in page.query_selector_all(".run")] == ["csd"]
