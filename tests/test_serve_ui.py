"""The Gradio app mounted at / of the real server: called by ``gradio_client`` and driven by a real browser."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest_plugins = ("tests._serve_fixtures",)  # the shared serving fixtures (index, engine, server)


# gradio's queue trips pandas deprecation warnings of its own; nothing this project can act on
pytestmark = pytest.mark.filterwarnings("ignore::Warning:gradio.queueing")

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_gradio_client__calls_search_and_classify(live_server, serve_corpus):
    from gradio_client import Client, handle_file

    client = Client(live_server.url + "/", verbose=False)
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert {"/search", "/classify", "/search_by_id", "/stats"} <= set(endpoints)
    query = serve_corpus / "blue" / "blue_007.png"
    gallery = client.predict(handle_file(str(query)), 4, api_name="/search")
    assert len(gallery) == 4
    assert gallery[0]["caption"].startswith("1.000 · blue · blue/blue_007.png")
    label = client.predict(handle_file(str(query)), 10, api_name="/classify")
    assert label["label"] == "blue"
    item_id = int(gallery[1]["caption"].rsplit("id ", 1)[1])
    gallery2, chart, about = client.predict(item_id, 3, api_name="/search_by_id")
    assert len(gallery2) == 3 and f"item {item_id}" in about and chart["label"] == "blue"
    stats = client.predict(api_name="/stats")
    assert "48 items" in stats and "IDMap2,Flat" in stats


def test_browser__upload_fills_the_gallery_and_a_click_searches_from_a_result(live_server, serve_corpus, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but no chromium is installed (.ci/run installs it with apt-get)")
        pytest.skip("no chromium on this machine (apt-get install chromium); CI runs this test")
    from playwright.sync_api import expect, sync_playwright

    shot = tmp_path / "app.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            # the closed network never answers (fonts, CDNs): refuse anything but our server at once
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(live_server.url)
                       else route.abort())
            page.goto(live_server.url + "/", wait_until="domcontentloaded")
            expect(page.locator("#stats")).to_contain_text("48 items", timeout=30_000)
            page.locator("#query-image input[type=file]").set_input_files(str(serve_corpus / "red" / "red_005.png"))
            # the upload itself runs the search (the Search button repeats it)
            images = page.locator("#results img")
            expect(images).to_have_count(10, timeout=30_000)  # the slider's default k
            expect(page.locator("#results")).to_contain_text("red/red_005.png")
            expect(page.locator("#prediction")).to_contain_text("red", timeout=30_000)
            page.wait_for_timeout(300)  # let the last fade-in finish for the screenshot
            page.screenshot(path=str(shot), full_page=True)
            second = page.locator("#results img").nth(1)
            second.click()  # a click on a result searches from that item
            expect(page.locator("#about")).to_contain_text("Searched from item", timeout=30_000)
            expect(page.locator("#results img")).to_have_count(10, timeout=30_000)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    out = os.environ.get("MOCO_SCREENSHOT")  # set to keep the screenshot (docs/serve_app.png is made this way)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, out)
