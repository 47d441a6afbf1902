"""The Gradio app mounted at / of the real server: called by ``gradio_client`` and driven by a real browser."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest_plugins = ("tests._serve_fixtures",)  # the shared serving fixtures (index, engine, server)


# gradio's queue trips pandas deprecation warnings of its own; nothing this project can act on
pytestmark = pytest.mark.filterwarnings("ignore::Warning:gradio.queueing")

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_gradio_client__calls_search_and_classify(live_server, serve_corpus, served_engine):
    from gradio_client import Client, handle_file

    client = Client(live_server.url + "/", verbose=False)
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert {"/search", "/classify", "/search_by_id", "/stats"} <= set(endpoints)
    query = serve_corpus / "blue" / "blue_007.png"
    update, about, item_id = client.predict(handle_file(str(query)), 4, -1, api_name="/search")
    # the gallery comes as an update that also clears the page's selection
    assert update["selected_index"] is None
    gallery = update["value"]
    assert len(gallery) == 4 and about.startswith("Searched from the uploaded image") and item_id is None
    assert gallery[0]["caption"].startswith("1.000 · blue\nblue/blue_007.png\nid ")
    label = client.predict(handle_file(str(query)), api_name="/classify")
    assert label["label"] == "blue"
    (api,) = served_engine.classify([str(query)])  # the same default k as the API and the CLI
    assert {c["label"]: c["confidence"] for c in label["confidences"]} == pytest.approx(api.probabilities)
    item_id = int(gallery[1]["caption"].rsplit("id ", 1)[1])
    update2, chart, about, shown = client.predict(item_id, 3, -1, api_name="/search_by_id")
    assert len(update2["value"]) == 3 and f"item {item_id}" in about and chart["label"] == "blue"
    # the query panel now shows the item searched from, byte for byte its indexed file
    assert Path(shown).read_bytes() == (serve_corpus / served_engine.item(item_id)["path"]).read_bytes()
    above, _, _ = client.predict(handle_file(str(query)), 100, 0.99, api_name="/search")
    scores = [float(g["caption"].split(" ")[0]) for g in above["value"]]
    assert scores and min(scores) >= 0.99
    stats = client.predict(api_name="/stats")
    assert "48 items" in stats and "IDMap2,Flat" in stats


def _browser(p, chromium: str, live_server, width: int, height: int):
    browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": width, "height": height})
    # the closed network never answers (fonts, CDNs): refuse anything but our server at once
    page.route(
        "**/*", lambda route: route.continue_() if route.request.url.startswith(live_server.url) else route.abort()
    )
    return browser, page


def _chromium() -> str:
    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but no chromium is installed (.ci/run installs it with apt-get)")
        pytest.skip("no chromium on this machine (apt-get install chromium); CI runs this test")
    return chromium


def _keep(shot: Path, name: str) -> None:
    out = os.environ.get("MOCO_SCREENSHOT")  # set to keep the screenshots (docs/serve_app.png is made this way)
    if out:
        target = Path(out) if name == "app" else Path(out).with_name(f"{Path(out).stem}_{name}.png")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)


def test_browser__upload_fills_the_gallery_and_a_click_searches_from_a_result(live_server, serve_corpus, tmp_path):
    chromium = _chromium()
    from playwright.sync_api import expect, sync_playwright

    shot, second_shot = tmp_path / "app.png", tmp_path / "second_query.png"
    with sync_playwright() as p:
        browser, page = _browser(p, chromium, live_server, 1280, 900)
        try:
            page.goto(live_server.url + "/", wait_until="domcontentloaded")
            expect(page.locator("#stats")).to_contain_text("48 items", timeout=30_000)
            page.locator("#query-image input[type=file]").set_input_files(str(serve_corpus / "red" / "red_005.png"))
            # the upload itself runs the search (the Search button repeats it)
            images = page.locator("#results img")
            expect(images).to_have_count(10, timeout=30_000)  # the slider's default k
            expect(page.locator("#prediction")).to_contain_text("red", timeout=30_000)
            expect(page.locator("#prediction")).to_contain_text("20 neighbours vote")  # the API's and CLI's k
            # the query preview is shown large, not at the image's own 32 px
            box = page.locator("#query-image img").first.bounding_box()
            assert box["width"] >= 150 and box["height"] >= 150, box
            # every caption is readable whole: score, label, path and id, nothing cut off
            captions = page.locator("#results .caption-label")
            expect(captions).to_have_count(10)
            first = captions.first
            expect(first).to_contain_text("red/red_005.png")
            expect(first).to_contain_text("id ")
            assert first.evaluate("e => e.scrollWidth <= e.clientWidth && e.scrollHeight <= e.clientHeight")
            assert "…" not in first.inner_text()
            page.wait_for_timeout(300)  # let the last fade-in finish for the screenshot
            page.screenshot(path=str(shot), full_page=True)
            before = page.locator("#query-image img").first.get_attribute("src")
            images.nth(1).click()  # a click on a result searches from that item
            expect(page.locator("#about")).to_contain_text("Searched from item", timeout=30_000)
            expect(page.locator("#results img")).to_have_count(10, timeout=30_000)
            # and the query panel shows that item, not the upload any more
            expect(page.locator("#query-image img").first).not_to_have_attribute("src", before, timeout=30_000)
            # a second query, by upload: the page describes it, not the clicked item, and selects nothing
            page.locator("#query-image input[type=file]").set_input_files(str(serve_corpus / "blue" / "blue_003.png"))
            expect(page.locator("#about")).to_contain_text("Searched from the uploaded image", timeout=30_000)
            expect(page.locator("#about")).not_to_contain_text("Searched from item")
            expect(page.locator("#results .caption-label").first).to_contain_text("blue/blue_003.png", timeout=30_000)
            expect(page.locator("#results .thumbnail-item.selected")).to_have_count(0)
            expect(page.locator("#item-id input")).to_have_value("")
            expect(page.locator("#prediction")).to_contain_text("blue", timeout=30_000)
            page.mouse.move(0, 0)  # no hover ring in the picture
            page.wait_for_timeout(300)
            page.screenshot(path=str(second_shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    _keep(shot, "app")
    _keep(second_shot, "second_query")


def test_browser__a_phone_sized_viewport_shows_every_result(live_server, serve_corpus, tmp_path):
    chromium = _chromium()
    from playwright.sync_api import expect, sync_playwright

    shot = tmp_path / "narrow.png"
    with sync_playwright() as p:
        browser, page = _browser(p, chromium, live_server, 390, 844)
        try:
            page.goto(live_server.url + "/", wait_until="domcontentloaded")
            expect(page.locator("#stats")).to_contain_text("48 items", timeout=30_000)
            page.locator("#query-image input[type=file]").set_input_files(str(serve_corpus / "green" / "green_002.png"))
            items = page.locator("#results .thumbnail-item")
            expect(items).to_have_count(10, timeout=30_000)
            page.wait_for_timeout(300)
            gallery = page.locator("#results").bounding_box()
            assert gallery["x"] >= 0 and gallery["x"] + gallery["width"] <= 390 + 1, gallery
            for i in range(10):  # each result lies inside the gallery (none clipped away) and inside the page
                box = items.nth(i).bounding_box()
                assert box["width"] >= 100, box
                assert box["x"] >= gallery["x"] - 1 and box["x"] + box["width"] <= gallery["x"] + gallery["width"] + 1
                assert box["y"] + box["height"] <= gallery["y"] + gallery["height"] + 1, (i, box, gallery)
            expect(page.locator("#results .caption-label").nth(9)).to_contain_text("id ")
            items.nth(9).scroll_into_view_if_needed()  # the gallery's images load lazily
            page.wait_for_timeout(500)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    _keep(shot, "narrow")


def test_browser__label_filter_min_score_and_the_duplicates_panel(live_server, serve_corpus, tmp_path):
    chromium = _chromium()
    from playwright.sync_api import expect, sync_playwright

    shot = tmp_path / "features.png"
    with sync_playwright() as p:
        browser, page = _browser(p, chromium, live_server, 1280, 900)
        try:
            page.goto(live_server.url + "/", wait_until="domcontentloaded")
            expect(page.locator("#stats")).to_contain_text("48 items", timeout=30_000)
            picker = page.locator("#label-filter input").first
            picker.click()
            picker.fill("yellow")
            picker.press("Enter")
            page.keyboard.press("Escape")
            score = page.locator("#min-score input[type=number]")
            score.fill("0.5")
            score.press("Enter")
            page.locator("#query-image input[type=file]").set_input_files(str(serve_corpus / "red" / "red_005.png"))
            captions = page.locator("#results .caption-label")
            expect(page.locator("#about")).to_contain_text("scoring at least 0.5", timeout=30_000)
            expect(captions.first).to_contain_text("yellow", timeout=30_000)
            texts = captions.all_inner_texts()
            assert texts and all("· yellow" in t and float(t.split(" ")[0]) >= 0.5 for t in texts), texts
            # near-duplicates of an item: the panel lists the items at least that similar
            page.locator("#item-id input").fill("3")
            page.locator("#duplicates-panel").get_by_text("Near-duplicates of an item").first.click()
            dup_score = page.locator("#dup-threshold input[type=number]")
            dup_score.fill("0.975")
            dup_score.press("Enter")
            page.locator("#dup-button").click()
            expect(page.locator("#dup-about")).to_contain_text("near-duplicates of item 3", timeout=30_000)
            expect(page.locator("#duplicates .caption-label").first).to_contain_text("id ", timeout=30_000)
            page.mouse.move(0, 0)
            page.wait_for_timeout(300)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    _keep(shot, "features")
