"""The playground at ``GET /`` in a real browser: headless Chromium driven by Selenium against
``ditserve serve`` on the demo models. Screenshots of each state go to the test's tmp folder."""

from __future__ import annotations

import base64
import io
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers import ServeProcess

KEY = "playground-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip(
    "selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')"
)
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "Chromium is absent: apt-get install -y chromium chromium-driver (.ci/run does)",
        allow_module_level=True,
    )

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory) -> Path:
    from tests.unit.test_lora_engine import weights, write_kohya  # an adapter that fits the demo models

    root = tmp_path_factory.mktemp("loras")
    write_kohya(root / "style.safetensors", weights(1))
    return root


def _realtime_server(root: Path) -> ServeProcess:
    from tests.families.anyflow import build_folder  # a tiny chunk-autoregressive (realtime) video model

    return ServeProcess("--model", str(build_folder(root / "tiny-anyflow-far")), timeout_s=300)


@pytest.fixture(scope="module")
def servers(lora_root, tmp_path_factory):
    """The default model (demo-scenes) with an admin key, and a tiny realtime video model for the video and
    realtime tabs (a realtime model serves /v1/videos jobs too), started side by side (starting is most of
    this module's time)."""
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(ServeProcess, "--api-key", KEY, "--lora-root", str(lora_root)),
            pool.submit(_realtime_server, tmp_path_factory.mktemp("realtime")),
        ]
        started = [f.result() if f.exception() is None else f.exception() for f in futures]
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        for s in started:
            if not isinstance(s, BaseException):
                s.stop()
        raise failed[0]
    yield started
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ServeProcess.stop, started))


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def video_server(servers):
    return servers[1]


@pytest.fixture(scope="module")
def realtime_server(servers):
    return servers[1]


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,800"):
        options.add_argument(arg)
    options.add_argument("--autoplay-policy=no-user-gesture-required")
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture
def shots(tmp_path):
    def shot(browser, name: str) -> None:
        browser.save_screenshot(str(tmp_path / f"{name}.png"))

    return shot


def hook(browser, testid: str, root=None):
    return (root or browser).find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"]')


def wait(browser, condition, timeout: float = 60):
    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(lambda _: condition())


def fill(element, text: str) -> None:
    element.clear()
    element.send_keys(text)


def test_prompt_shows_step_progress_then_the_prompts_image(browser, server, shots):
    from ditserve.replica.models.scenes import held_out_scenes
    from ditserve.replica.models.scorer import score_scene

    scene = held_out_scenes()[0]
    browser.get(server.base_url + "/")
    wait(browser, lambda: hook(browser, "model").get_attribute("value") == "demo-scenes")
    fill(hook(browser, "prompt"), scene.caption)
    fill(hook(browser, "size"), "64x64")
    fill(hook(browser, "steps"), "20")
    fill(hook(browser, "seed"), "1000")
    hook(browser, "generate").click()
    result = hook(browser, "result")
    wait(browser, lambda: result.is_displayed() and result.get_attribute("src").startswith("data:image/png"))
    shots(browser, "generate-done")

    ticks = browser.find_elements(By.CSS_SELECTOR, '[data-testid="previews"] .tick')
    assert [int(t.get_attribute("data-step")) for t in ticks] == list(range(1, 21))
    assert hook(browser, "progress").get_attribute("value") == "20"
    assert hook(browser, "replica").text.strip(), "the serving replica is shown"
    png = base64.b64decode(result.get_attribute("src").split(",", 1)[1])
    assert score_scene(Image.open(io.BytesIO(png))) == (scene.background, scene.colour)
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="error"]')
    # kept in this browser's history, as a download link
    first = hook(browser, "history-0")
    assert first.get_attribute("download").endswith(".png") and first.get_attribute(
        "href"
    ) == result.get_attribute("src")
    browser.refresh()
    wait(browser, lambda: hook(browser, "history-0").get_attribute("href").startswith("data:image/png"))


def test_bad_size_shows_the_apis_message_next_to_the_size_field(browser, server, shots):
    browser.get(server.base_url + "/")
    fill(hook(browser, "prompt"), "a red circle on blue")
    fill(hook(browser, "size"), "100x100")
    hook(browser, "generate").click()
    error = wait(browser, lambda: hook(browser, "error"))
    shots(browser, "generate-bad-size")
    assert "multiples of 16" in error.text
    assert error.get_attribute("data-param") == "size"
    assert hook(browser, "generate").is_enabled(), "nothing stays busy after an error"
    assert hook(browser, "status").text == "failed"


def test_session_refines_the_image_step_by_step(browser, server, shots):
    """Each step sends the form's fields: the first step, with a negative prompt and a seed, is the image
    POST /v1/images/generations draws with the same ones; the next refines it."""
    import httpx

    browser.get(server.base_url + "/")
    hook(browser, "tab-sessions").click()
    fill(hook(browser, "session-size"), "64x64")
    fill(hook(browser, "session-negative-prompt"), "a green background")
    fill(hook(browser, "session-steps"), "4")
    fill(hook(browser, "session-seed"), "5")
    pictures = []
    for step, prompt in enumerate(
        ["a red circle on a blue background", "a red square on a blue background"], 1
    ):
        fill(hook(browser, "session-prompt"), prompt)
        hook(browser, "session-step").click()
        wait(browser, lambda step=step: hook(browser, "session-step-no").text == str(step))
        pictures.append(hook(browser, "session-result").get_attribute("src"))
    shots(browser, "session-refined")
    assert hook(browser, "session-id").text and all(p.startswith("data:image/png") for p in pictures)
    assert pictures[0] != pictures[1]
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="error"]')

    def request(negative_prompt: str):
        fields = {"prompt": "a red circle on a blue background", "negative_prompt": negative_prompt}
        fields |= {"size": "64x64", "num_inference_steps": 4, "seed": 5}
        answer = httpx.post(server.base_url + "/v1/images/generations", json=fields, timeout=120)
        assert answer.status_code == 200, answer.text
        return png_of("data:image/png;base64," + answer.json()["data"][0]["b64_json"]).tobytes()

    assert png_of(pictures[0]).tobytes() == request("a green background")
    assert png_of(pictures[0]).tobytes() != request("a yellow background")  # the negative prompt counts


def test_lora_loaded_in_the_cluster_tab_appears_in_the_generate_form(browser, server, shots):
    browser.get(server.base_url + "/")
    fill(hook(browser, "api-key"), KEY)
    hook(browser, "tab-cluster").click()
    wait(
        browser, lambda: len(browser.find_elements(By.CSS_SELECTOR, '[data-testid="replicas"] tbody tr')) == 1
    )
    fill(hook(browser, "lora-name"), "style")
    fill(hook(browser, "lora-path"), "style.safetensors")
    hook(browser, "lora-load").click()
    wait(
        browser,
        lambda: browser.find_elements(By.CSS_SELECTOR, '[data-testid="lora-unload-style"]'),
        timeout=120,
    )
    shots(browser, "cluster-lora-loaded")
    hook(browser, "tab-generate").click()
    use = hook(browser, "lora-use-style")
    assert use.is_displayed() and hook(browser, "lora-scale-style").get_attribute("value") == "1"
    shots(browser, "generate-with-lora")


def test_video_job_plays_inline(browser, video_server, shots):
    browser.get(video_server.base_url + "/")
    hook(browser, "tab-videos").click()
    fill(hook(browser, "video-prompt"), "waves on a beach")
    fill(hook(browser, "video-size"), "64x64")
    fill(hook(browser, "video-frames"), "5")
    fill(hook(browser, "video-steps"), "2")
    hook(browser, "video-create").click()
    video = hook(browser, "video")
    wait(browser, lambda: video.is_displayed(), timeout=120)
    # the browser decoded the MP4 and plays it: frames advance
    wait(
        browser,
        lambda: browser.execute_script(
            "const v = arguments[0]; return v.readyState >= 2 && v.currentTime > 0", video
        ),
    )
    assert browser.execute_script("return arguments[0].videoWidth", video) == 64
    shots(browser, "video-playing")


# -- previews, edits, step cache, realtime (one page load each, on the shared demo-scenes server) --------
ORDER_OBSERVER = """
window.__seen = [];
const partials = document.querySelector('[data-testid="partials"]');
const result = document.querySelector('[data-testid="result"]');
new MutationObserver((records) => {
  for (const r of records) for (const n of r.addedNodes) window.__seen.push('partial:' + n.dataset.step);
}).observe(partials, {childList: true});
new MutationObserver(() => window.__seen.push('result')).observe(result, {attributeFilter: ['src']});
"""


def png_of(src: str) -> Image.Image:
    assert src.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))


def test_step_previews_appear_before_the_image(browser, server, shots):
    browser.get(server.base_url + "/")
    wait(browser, lambda: hook(browser, "model").get_attribute("value") == "demo-scenes")
    assert hook(browser, "preview").is_selected(), "previews are on by default"
    fill(hook(browser, "prompt"), "a red circle on a blue background")
    fill(hook(browser, "size"), "64x64")
    fill(hook(browser, "steps"), "4")
    fill(hook(browser, "seed"), "3")
    browser.execute_script(ORDER_OBSERVER)
    hook(browser, "generate").click()
    result = hook(browser, "result")
    wait(browser, lambda: hook(browser, "progress").get_attribute("data-done") == "1")
    shots(browser, "generate-previews-done")

    # one latent preview per step but the last, each shown before the final image replaced them
    assert browser.execute_script("return window.__seen") == ["partial:1", "partial:2", "partial:3", "result"]
    thumbs = browser.find_elements(By.CSS_SELECTOR, '[data-testid="partials"] img')
    assert [t.get_attribute("data-index") for t in thumbs] == ["0", "1", "2"]
    assert all(png_of(t.get_attribute("src")).size == (8, 8) for t in thumbs)  # the latents: 1/8 size
    assert len({t.get_attribute("src") for t in thumbs}) == 3, "each step's latents differ"
    assert png_of(result.get_attribute("src")).size == (64, 64)
    assert not hook(browser, "preview-image").is_displayed()
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="error"]')


def test_uploaded_image_goes_through_edits(browser, server, shots, tmp_path):
    """The page's image-to-image result is the one POST /v1/images/edits gives for the same fields."""
    import httpx

    from ditserve.replica.models.scenes import Scene, draw_scene

    source = tmp_path / "source.png"
    draw_scene(Scene("circle", "red", "blue"), __import__("random").Random(0)).save(source)
    browser.get(server.base_url + "/")
    wait(browser, lambda: hook(browser, "model").get_attribute("value") == "demo-scenes")
    fill(hook(browser, "prompt"), "a red square on a blue background")
    fill(hook(browser, "steps"), "4")
    fill(hook(browser, "seed"), "11")
    fill(hook(browser, "strength"), "0.75")
    hook(browser, "image").send_keys(str(source))
    hook(browser, "generate").click()
    result = hook(browser, "result")
    wait(browser, lambda: hook(browser, "progress").get_attribute("data-done") == "1")
    shots(browser, "edit-done")
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="error"]')
    assert hook(browser, "status").text == "done (64x64)"  # the upload's size (no size given)
    assert hook(browser, "result-seed").text == "11" and hook(browser, "replica").text.strip()
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="partials"] img')

    fields = {"prompt": "a red square on a blue background", "model": "demo-scenes"}
    fields |= {"num_inference_steps": "4", "seed": "11", "strength": "0.75"}
    answer = httpx.post(
        server.base_url + "/v1/images/edits",
        data=fields,
        files={"image": ("source.png", source.read_bytes(), "image/png")},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    page = base64.b64decode(result.get_attribute("src").split(",", 1)[1])
    assert page == base64.b64decode(answer.json()["data"][0]["b64_json"])
    # removing the upload goes back to text-to-image
    hook(browser, "image-clear").click()
    assert hook(browser, "image").get_attribute("value") == ""


def test_taylorseer_shows_cached_forwards(browser, server, shots):
    from selenium.webdriver.support.ui import Select

    browser.get(server.base_url + "/")
    wait(browser, lambda: hook(browser, "model").get_attribute("value") == "demo-scenes")
    policy = Select(hook(browser, "cache-policy"))
    policy.select_by_value("fbcache")
    assert (
        hook(browser, "cache-threshold").is_displayed() and not hook(browser, "cache-interval").is_displayed()
    )
    fill(hook(browser, "prompt"), "a green square on a white background")
    fill(hook(browser, "size"), "64x64")
    fill(hook(browser, "steps"), "8")
    usage = {}
    for name in ("none", "taylorseer"):
        policy.select_by_value(name)
        if name == "taylorseer":
            assert hook(browser, "cache-interval").is_displayed()
            assert not hook(browser, "cache-threshold").is_displayed()
            fill(hook(browser, "cache-interval"), "3")
        hook(browser, "generate").click()
        wait(browser, lambda: hook(browser, "progress").get_attribute("data-done") == "1")
        assert hook(browser, "cache-used").text == name
        usage[name] = (
            int(hook(browser, "transformer-forwards").text),
            int(hook(browser, "cached-forwards").text),
        )
    shots(browser, "generate-taylorseer")
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="error"]')
    forwards = usage["none"][0]
    assert forwards % 8 == 0 and usage["none"] == (forwards, 0)  # one (or one per CFG branch) a step
    assert usage["taylorseer"][0] == forwards and 0 < usage["taylorseer"][1] < forwards


def test_realtime_tab_shows_the_servers_refusal_of_an_image_model(browser, server, shots):
    """The tab's msgpack init reaches the server, whose msgpack error is decoded and shown."""
    browser.get(server.base_url + "/")
    wait(browser, lambda: hook(browser, "model").get_attribute("value") == "demo-scenes")
    hook(browser, "tab-realtime").click()
    fill(hook(browser, "rt-prompt"), "a red fox running")
    fill(hook(browser, "rt-size"), "64x64")
    hook(browser, "rt-start").click()
    error = wait(browser, lambda: hook(browser, "error"))
    shots(browser, "realtime-refused")
    assert "realtime" in error.text and "demo-scenes" in error.text
    hook(browser, "rt-stop").click()
    wait(browser, lambda: hook(browser, "rt-state").text.startswith("closed"))
    assert hook(browser, "rt-start").is_enabled()


def test_realtime_tab_plays_chunks_and_sends_a_prompt_event(browser, realtime_server, shots):
    """A realtime model: JPEG frame batches are drawn as they arrive, the replica and each chunk's stats
    show, and a prompt event sent mid-session is echoed by a later chunk."""
    browser.get(realtime_server.base_url + "/")
    hook(browser, "tab-realtime").click()
    fill(hook(browser, "rt-prompt"), "a red fox running")
    fill(hook(browser, "rt-size"), "64x64")
    fill(hook(browser, "rt-frames"), "8")
    # 10 steps per chunk: the session (up to the tiny model's 32 chunks) is still running, seconds later, when
    # the prompt event goes out (the next chunk is queued as soon as one is denoised).
    fill(hook(browser, "rt-steps"), "10")
    fill(hook(browser, "rt-seed"), "5")
    hook(browser, "rt-start").click()
    wait(browser, lambda: int(hook(browser, "rt-chunks-done").text) >= 1)
    fill(hook(browser, "rt-event-prompt"), "a blue fox swimming")
    hook(browser, "rt-send").click()
    wait(browser, lambda: "event 1" in hook(browser, "rt-stats").text)
    wait(browser, lambda: int(hook(browser, "rt-frames-done").text) >= 9)  # the first frame, then a chunk
    shots(browser, "realtime-playing")
    canvas = hook(browser, "rt-canvas")
    assert (canvas.get_attribute("width"), canvas.get_attribute("height")) == ("64", "64")
    # the canvas shows a picture, not the blank it started as
    spread = browser.execute_script(
        "const d = arguments[0].getContext('2d').getImageData(0, 0, 64, 64).data;"
        "let lo = 255, hi = 0; for (let i = 0; i < d.length; i += 4) { lo = Math.min(lo, d[i]); hi = Math.max(hi, d[i]); }"
        "return hi - lo;",
        canvas,
    )
    assert spread > 0
    assert hook(browser, "rt-replica").text.strip()
    assert "frames in" in hook(browser, "rt-stats").text
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="error"]')
    hook(browser, "rt-stop").click()
    wait(browser, lambda: hook(browser, "rt-state").text.startswith("closed"))
