"""`sgraf serve` in a real browser: Debian's Chromium, driven by selenium, against a server on
127.0.0.1 over a small demo gallery (the embedded benchmark, a briefly trained model).

Skipped, saying why, where Chromium or its driver is absent; under CI (`CI=true`), which
installs them (`.ci/run`), their absence fails the test instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import urllib.parse

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")

from test_own_gallery import own  # noqa: E402,F401  (a fixture: a gallery of one's own pictures)

N_TEST = 32


def _chromium() -> tuple[str, str]:
    browser = next((shutil.which(name) for name in ("chromium", "chromium-browser") if shutil.which(name)), None)
    driver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", browser), ("chromium-driver (chromedriver)", driver)) if not path]
    if missing:
        why = f"{' and '.join(missing)} not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the browser test, but {why}")
        pytest.skip(why)
    try:
        import selenium  # noqa: F401
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI must run the browser test, but selenium is not installed (the dev extra)")
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    return browser, driver


@pytest.fixture(scope="module")
def demo_gallery(tmp_path_factory) -> dict:
    """The embedded benchmark (synthetic features, rendered pictures), a SAF model trained for a
    few seconds, and an index of its 32 test images."""
    _chromium()   # skip before spending time on training
    from sgraf.api import Matcher
    from sgraf.data.benchmark import generate_benchmark
    from sgraf.data.precomp import PrecompSplit
    from sgraf.search import build_index
    from sgraf.training import fit, resolve_config

    root = tmp_path_factory.mktemp("browser")
    data = root / "data"
    generate_benchmark(data, seed=0, n_train=TRAIN_IMAGES, n_dev=16, n_test=N_TEST)
    config, _ = resolve_config("demo", overrides=[*TRAINING, "progress=false", "seed=0"])
    # the same sums whatever an earlier test of this worker left: one thread, the kernels' routes
    # not chosen by timing (the model's quality sits near the check in _query otherwise)
    threads, tune = torch.get_num_threads(), os.environ.get("SGRAF_TUNE")
    torch.set_num_threads(1)
    os.environ["SGRAF_TUNE"] = "off"
    try:
        fit(config, data, root / "run", preset="demo")
    finally:
        torch.set_num_threads(threads)
        if tune is None:
            os.environ.pop("SGRAF_TUNE")
        else:
            os.environ["SGRAF_TUNE"] = tune
    matcher = Matcher.load([root / "run" / "best.pt"])
    test = PrecompSplit(data, "test")
    build_index(matcher, test.images, test.captions, root / "index", caps_per_image=test.caps_per_image,
                source={"data_dir": str(data.resolve()), "split": "test"})
    return {"root": root, "data": data, "index": root / "index", "captions": test.captions}


# A short training that matches well beyond chance on this gallery: SAF (word attention, SAF
# weights) with the auxiliary global loss, 240 training images, 3 epochs (measured: 22 of the 32
# test pictures in the top 5 for their first caption, t2i R@5 57 % against 16 % by chance).
TRAIN_IMAGES = 240
TRAINING = ["module=saf", "embed_size=32", "sim_dim=16", "word_dim=16", "batch_size=32", "lr=3e-3",
            "max_violation=false", "global_loss_weight=1", "checkpoint_every=0", "epochs=3"]


@pytest.fixture(scope="module")
def server(demo_gallery):
    """`sgraf serve`'s application under uvicorn, in a thread, on 127.0.0.1 and a free port."""
    import uvicorn

    from sgraf.serve.app import create_app
    from sgraf.serve.service import SearchService

    service = SearchService.open(demo_gallery["index"], shortlist=N_TEST)   # the whole gallery re-ranked
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started, "the server did not start"
    yield {"url": f"http://127.0.0.1:{port}", "service": service}
    uv.should_exit = True
    thread.join(30)


@pytest.fixture
def browser(monkeypatch):
    chromium, chromedriver = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")    # selenium must not look for drivers online
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1100,1500", "--disable-extensions", "--no-first-run"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _query(server: dict, captions: list[str]) -> tuple[str, int]:
    """A caption of a test picture that the service ranks in its top 5, after checking that the
    model matches far beyond chance (so finding it is no accident of a near-random model)."""
    service = server["service"]
    found = []
    for image_id in range(N_TEST):
        caption = captions[image_id * 5]
        ids = [r["id"] for r in service.search_text(caption, top_k=5, allow_unknown=True)["results"]]
        found.append((image_id in ids, caption, image_id))
    share = np.mean([hit for hit, _, _ in found])
    assert share >= 0.4, f"the briefly trained model finds only {share:.0%} of the pictures in its top 5 (chance 16%)"
    _, caption, image_id = next(item for item in found if item[0])
    return caption, image_id


def test_type_a_caption_find_the_picture_and_open_its_explanation(server, browser, demo_gallery):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    caption, image_id = _query(server, demo_gallery["captions"])
    wait = WebDriverWait(browser, 30)
    browser.get(server["url"] + "/")
    wait.until(lambda d: "pictures" in d.find_element(By.ID, "gallery-info").text)
    assert f"{N_TEST} pictures" in browser.find_element(By.ID, "gallery-info").text

    box = browser.find_element(By.ID, "query")
    box.send_keys(caption)
    browser.find_element(By.ID, "allow-unknown").click()
    browser.find_element(By.ID, "search-button").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results .card")) >= 5)
    cards = browser.find_elements(By.CSS_SELECTOR, "#results .card")
    top5 = [int(card.get_attribute("data-id")) for card in cards[:5]]
    assert image_id in top5, f"picture {image_id} not in the page's top 5 {top5} for {caption!r}"
    card = cards[top5.index(image_id)]
    assert card.find_element(By.CSS_SELECTOR, ".rank").text == f"#{top5.index(image_id) + 1}"
    picture = card.find_element(By.TAG_NAME, "img")
    assert picture.get_attribute("src").endswith(f"/images/{image_id:05d}.png")
    wait.until(lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", picture) > 0)
    screenshot = os.environ.get("SGRAF_SERVE_SCREENSHOT")
    _assert_labels_apart(browser)

    # the explanation: the picture with the chosen word's attention over it, SAF's weight per word
    card.click()
    wait.until(ready.visibility_of_element_located((By.ID, "explain-panel")))
    canvas = browser.find_element(By.ID, "attention")
    wait.until(lambda d: canvas.get_attribute("data-drawn") not in (None, "", "picture")
               and canvas.get_attribute("data-picture") == "drawn")   # the word's map over the picture
    first_word = canvas.get_attribute("data-drawn")
    assert first_word in caption
    pixels = browser.execute_script(
        "const c = arguments[0]; const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let lo = 255, hi = 0;"
        "for (let i = 0; i < d.length; i += 4) { lo = Math.min(lo, d[i]); hi = Math.max(hi, d[i]); }"
        "return [lo, hi];", canvas)
    assert pixels[1] - pixels[0] > 50, "the attention picture is blank"
    before = canvas.screenshot_as_png
    words = browser.find_elements(By.CSS_SELECTOR, "#words button[data-word]")
    tokens = caption.split()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#words li")) >= len(tokens) + 3   # [global], <start>, <end>
    other = next(b for b in words if b.text not in (first_word, "<start>", "<end>"))
    other.click()
    wait.until(lambda d: canvas.get_attribute("data-drawn") == other.text)
    assert canvas.screenshot_as_png != before, "picking another word did not change the attention picture"
    assert "saf" in browser.find_element(By.ID, "explain-scores").text
    png = browser.find_element(By.ID, "explain-png").get_attribute("href")
    assert "/api/explain.png?" in png and f"image_id={image_id}" in png
    if screenshot:
        browser.execute_script("window.scrollTo(0, 0)")
        browser.save_screenshot(screenshot)

    # search from the picture: its best captions; the earlier explanation leaves the screen
    card.find_element(By.CSS_SELECTOR, ".captions-link").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#captions li")) >= 5)
    if os.environ.get("SGRAF_SERVE_SCREENSHOT_CAPTIONS"):
        browser.save_screenshot(os.environ["SGRAF_SERVE_SCREENSHOT_CAPTIONS"])
    assert not browser.find_element(By.ID, "explain-panel").is_displayed(), \
        "the explanation of the earlier search stays on screen under the picture's captions"
    assert not browser.find_elements(By.CSS_SELECTOR, "#results .card.selected")
    assert f"picture {image_id}" in browser.find_element(By.ID, "captions-title").text
    expected = server["service"].search_image(image_id, top_k=10)["results"]
    shown = [item.find_element(By.CSS_SELECTOR, ".caption").text
             for item in browser.find_elements(By.CSS_SELECTOR, "#captions li")]
    assert shown == [hit["caption"] for hit in expected]

    # a caption explains again; a new text search then clears both the explanation and the captions
    browser.find_elements(By.CSS_SELECTOR, "#captions li")[0].click()
    wait.until(ready.visibility_of_element_located((By.ID, "explain-panel")))
    assert f"picture {image_id}" in browser.find_element(By.ID, "explain-title").text
    box.clear()
    box.send_keys(demo_gallery["captions"][5])
    browser.find_element(By.ID, "search-button").click()
    wait.until(lambda d: demo_gallery["captions"][5] in d.find_element(By.ID, "results-title").text)
    assert not browser.find_element(By.ID, "explain-panel").is_displayed()
    assert not browser.find_element(By.ID, "captions-panel").is_displayed()

    # a search refused (an unknown word) leaves no earlier search's pictures under its title
    box.clear()
    box.send_keys("a zebraxyz")
    browser.find_element(By.ID, "allow-unknown").click()              # off again: unknown words refused
    browser.find_element(By.ID, "search-button").click()
    wait.until(lambda d: "zebraxyz" in d.find_element(By.ID, "status").text)
    assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
    assert not browser.find_elements(By.CSS_SELECTOR, "#results .card")
    assert browser.find_element(By.ID, "results-title").text == ""


def test_a_search_lives_in_the_address_and_the_page_works_from_the_keyboard(server, browser, demo_gallery):
    """A reload or a shared link had shown an empty page, Back had left the app, Enter on a
    caption did nothing, and an unknown word was drawn (and chosen first) as if the model had
    read it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    caption, image_id = _query(server, demo_gallery["captions"])
    wait = WebDriverWait(browser, 30)
    browser.get(server["url"] + "/?" + urllib.parse.urlencode({"text": caption, "top_k": 5, "allow_unknown": "true"}))
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results .card")) == 5)     # a shared link
    first = [card.get_attribute("data-id") for card in browser.find_elements(By.CSS_SELECTOR, "#results .card")]
    assert browser.find_element(By.ID, "query").get_attribute("value") == caption
    assert browser.find_element(By.ID, "allow-unknown").is_selected()
    # a second search is a new address; Back shows the first again
    box = browser.find_element(By.ID, "query")
    box.clear()
    box.send_keys(demo_gallery["captions"][5] + Keys.ENTER)
    wait.until(lambda d: demo_gallery["captions"][5] in d.find_element(By.ID, "results-title").text)
    assert "text=" in browser.current_url
    browser.back()
    wait.until(lambda d: caption in d.find_element(By.ID, "results-title").text)
    assert [card.get_attribute("data-id") for card in browser.find_elements(By.CSS_SELECTOR, "#results .card")] == first
    browser.refresh()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results .card")) == 5)

    # the keyboard: Enter (or Space) on a card explains it; Enter on a caption explains it
    card = browser.find_elements(By.CSS_SELECTOR, "#results .card")[0]
    card.send_keys(Keys.SPACE)
    wait.until(ready.visibility_of_element_located((By.ID, "explain-panel")))
    card.find_element(By.CSS_SELECTOR, ".captions-link").send_keys(Keys.ENTER)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#captions li")) >= 5)
    assert "image_id=" in browser.current_url
    assert not browser.find_element(By.ID, "explain-panel").is_displayed()   # Enter on the button was the button's
    browser.find_elements(By.CSS_SELECTOR, "#captions li[tabindex]")[0].send_keys(Keys.ENTER)
    wait.until(ready.visibility_of_element_located((By.ID, "explain-panel")))

    # a word the vocabulary does not know is shown as read, and not chosen first
    box = browser.find_element(By.ID, "query")
    box.clear()
    words = caption.split()
    box.send_keys(" ".join([*words[:2], "zebraxyz", *words[2:]]) + Keys.ENTER)
    wait.until(lambda d: "zebraxyz" in d.find_element(By.ID, "results-title").text)
    browser.find_elements(By.CSS_SELECTOR, "#results .card")[0].click()
    canvas = browser.find_element(By.ID, "attention")
    wait.until(lambda d: canvas.get_attribute("data-drawn") not in (None, "", "picture"))
    assert canvas.get_attribute("data-drawn") != "zebraxyz"
    marked = [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#words button.unknown")]
    assert marked == ["zebraxyz \u2192 <unk>"], marked
    # the results' explanations keep the search's allow_unknown when the box is unticked
    browser.find_element(By.ID, "allow-unknown").click()
    browser.find_elements(By.CSS_SELECTOR, "#results .card")[1].click()
    wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("explained"))
    assert browser.find_element(By.ID, "explain-panel").is_displayed()


def test_a_busy_server_is_asked_again_after_the_seconds_it_names(server, browser, demo_gallery, monkeypatch):
    """A 503 with Retry-After (the queue was full) had ended the search with "retry in 1 s": the
    page now asks again itself, saying so, and shows the answer; a newer search drops the retries.
    A 429 (this address has as many requests waiting as one client may) is asked again alike."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from sgraf.serve.worker import Busy, ClientBusy, Worker

    refusals, seen = [2], []
    search_text = Worker.search_text

    def busy_at_first(self, text, *args, **kwargs):
        if refusals[0]:
            refusals[0] -= 1
            if refusals[0] == 1:
                raise ClientBusy("too many requests: this client has 1 request waiting (the limit per client); "
                                 "retry once they are answered")
            raise Busy("the server is busy: 1 request is waiting; retry shortly")
        return search_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Worker, "search_text", busy_at_first)
    caption = demo_gallery["captions"][0]
    wait = WebDriverWait(browser, 30)
    browser.get(server["url"] + "/?" + urllib.parse.urlencode({"text": caption, "top_k": 5}))
    wait.until(lambda d: seen.append(d.find_element(By.ID, "status").text) or
               len(d.find_elements(By.CSS_SELECTOR, "#results .card")) == 5)
    assert refusals == [0] and any("asking again in 1 s" in text for text in seen), seen
    assert any(text.startswith("too many requests: this client has 1 request waiting (the limit per client): "
                               "asking again in 1 s") for text in seen), seen
    assert browser.find_element(By.ID, "status").text.startswith("5 pictures in")
    # refused more often than the page retries: the error stays, naming the wait
    refusals[0] = 10
    browser.find_element(By.ID, "query").submit()
    wait.until(lambda d: "error" in d.find_element(By.ID, "status").get_attribute("class"))
    assert browser.find_element(By.ID, "status").text == ("the server is busy: 1 request is waiting; retry shortly "
                                                          "(retry in 1 s)")
    assert refusals == [6]          # the first try and three more


def _assert_labels_apart(browser) -> None:
    """Every card's rank, picture number and score stand apart: labels on one line keep a gap."""
    boxes = browser.execute_script(
        "return [...document.querySelectorAll('#results .card')].map(card =>"
        " ['.rank', '.id', '.score'].map(s => { const r = card.querySelector(s).getBoundingClientRect();"
        " return [r.left, r.right, r.top, r.bottom, card.querySelector(s).textContent]; }));")
    assert boxes, "no cards"
    for card in boxes:
        for i, a in enumerate(card):
            for b in card[i + 1:]:
                same_line = a[2] < b[3] and b[2] < a[3]
                gap = max(b[0] - a[1], a[0] - b[1])
                assert not same_line or gap >= 4, f"card labels run together: {a[4]!r} and {b[4]!r} ({gap:.1f} px)"


def test_own_pictures_keep_their_shape_and_show_their_names(own, browser, tmp_path):
    """A gallery of one's own pictures (`test_own_gallery`): each card names its file, and the
    explanation draws a tall phone photo at its own shape (a 400 x 300 photo had been squashed
    into the square canvas)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    from sgraf.cli import main
    from sgraf.serve.app import create_app
    from sgraf.serve.service import SearchService
    from test_serve_limits import _uvicorn_server

    _chromium()
    index = tmp_path / "index"
    assert main(["index", "--checkpoint", str(own["root"] / "sgr.pt"), "--data", str(own["data"]), "--split", "test",
                 "--out", str(index), "--quiet"]) == 0
    server, thread, port = _uvicorn_server(create_app(SearchService.open(index, shortlist=4)))
    try:
        wait = WebDriverWait(browser, 30)
        browser.get(f"http://127.0.0.1:{port}/")
        wait.until(lambda d: "pictures" in d.find_element(By.ID, "gallery-info").text)
        browser.find_element(By.ID, "query").send_keys("a red ball")
        browser.find_element(By.ID, "search-button").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results .card")) == 4)
        names = [card.find_element(By.CSS_SELECTOR, ".name").text
                 for card in browser.find_elements(By.CSS_SELECTOR, "#results .card")]
        assert sorted(names) == sorted(own["names"])
        phone = next(card for card in browser.find_elements(By.CSS_SELECTOR, "#results .card")
                     if card.find_element(By.CSS_SELECTOR, ".name").text == "phone shot.jpg")
        phone.click()
        wait.until(ready.visibility_of_element_located((By.ID, "explain-panel")))
        canvas = browser.find_element(By.ID, "attention")
        wait.until(lambda d: canvas.get_attribute("data-picture") == "drawn" and canvas.get_attribute("data-frame"))
        left, top, width, height = (float(v) for v in canvas.get_attribute("data-frame").split(","))
        assert abs(width / height - 40 / 120) < 0.01 and top == 0.0 and left > 0   # upright, tall, centred
    finally:
        server.should_exit = True
        thread.join(30)
