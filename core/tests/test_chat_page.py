"""The chat page at `/` of `verispec serve` (verispec.server.page).

Its files answer with their content types and stay open under an API key (TestClient). Then
the page itself, in real headless Chromium (selenium over Debian's chromium + chromium-driver,
no browser download), against uvicorn on a loopback port over the toy GGUF with a 1-gram echo
speculator and an API key: a turn without the key shows the 401's message; with it, an echo
turn streams in (its text grows before its stats line appears) and drafts with acceptance, the
next turn (speculation switched off) reuses the first turn's prefix and says "off"; the stop
button aborts a turn whose generation is held mid-stream, and the server cancels it. A
screenshot of the page is written under pytest's tmp dir (and $VERISPEC_ARTEFACTS when set).
"""
import os
import re
import shutil
import threading
from pathlib import Path

import httpx
import pytest

uvicorn = pytest.importorskip("uvicorn")
from fastapi.testclient import TestClient  # noqa: E402

from verispec import api  # noqa: E402
from verispec.engine import SpecOptions  # noqa: E402
from verispec.hookspecs import hookimpl  # noqa: E402
from verispec.registry import Registry  # noqa: E402
from verispec.server import create_app  # noqa: E402
from verispec.specs import SpeculatorSpec  # noqa: E402
from verispec.testing import toy_plugin  # noqa: E402
from verispec.testing.serving import serving  # noqa: E402
from verispec.testing.toy import CHAT_TEMPLATE, EchoSpeculator, write_toy_gguf  # noqa: E402

KEY = "sk-page-7c1e"
ECHO_PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
MAX_TOKENS = 32
INSTALL = ("apt-get install chromium chromium-driver, and .venv/bin/python -m pip install selenium "
           "(core's [test] extra)")
WAIT_S = 60  # a deadline for a page condition to fail at, not a measurement


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False,
                          seed=3, chat_template=CHAT_TEMPLATE)


class Echo:
    """The 1-gram echo speculator (verispec.testing.toy): it drafts where the text repeats."""

    @hookimpl
    def register_speculators(self, register):
        register(SpeculatorSpec(name="echo", summary="1-gram echo (test)",
                                factory=lambda trunk, **kw: EchoSpeculator(kw["spec"], max_draft_tokens=4)))


def _echo_engine(model_path):
    registry = Registry.from_plugins({"toy": toy_plugin, "speculators": Echo()})
    return api.load(model_path, registry=registry, context_length=512,
                    spec=SpecOptions(spec_type="echo", adaptive=False))  # adaptive off: it always drafts


def test_the_page_and_its_files_have_their_content_types_and_need_no_key(model_path):
    client = TestClient(create_app(_echo_engine(model_path), model_name="toy", api_key=KEY))
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert 'src="chat.js"' in page.text and 'href="chat.css"' in page.text and "://" not in page.text
    for path, media_type, word in [("/chat.js", "text/javascript", "/v1/chat/completions"),
                                   ("/chat.css", "text/css", ".stats")]:
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"] == f"{media_type}; charset=utf-8", path
        assert word in r.text
        assert "default-src 'self'" in r.headers["content-security-policy"]  # nothing loads from elsewhere
    assert "innerHTML" not in client.get("/chat.js").text  # model text only ever goes in as textContent
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                       ).status_code == 401
    missing = client.get("/nope")
    assert missing.status_code == 404 and "GET / (the chat page)" in missing.json()["error"]["message"]


# ---- the page in headless Chromium ----

class HeldForward:
    """Wraps the trunk's forward: while `hold(n)` is in force, the forward after the next n waits
    until `release()` (so a turn can be caught mid-stream without timing anything)."""

    def __init__(self, trunk):
        self.forward, self.left, self.released = trunk.forward, None, threading.Event()
        self.released.set()

    def __call__(self, batch):
        if self.left is not None:
            if self.left == 0:
                self.released.wait()
            else:
                self.left -= 1
        return self.forward(batch)

    def hold(self, n: int) -> None:
        self.released.clear()
        self.left = n

    def release(self) -> None:
        self.left = None
        self.released.set()


@pytest.fixture(scope="module")
def served(model_path):
    """(base URL, the HeldForward, the Generations the server started): uvicorn in a thread."""
    engine = _echo_engine(model_path)
    held = HeldForward(engine.trunk)
    engine.trunk.forward = held
    generations, generate = [], engine.generate

    def recording_generate(*args, **kwargs):
        generations.append(generate(*args, **kwargs))
        return generations[-1]
    engine.generate = recording_generate
    with serving(create_app(engine, model_name="toy", api_key=KEY)) as base_url:
        yield base_url, held, generations
        held.release()



@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through chromedriver, both Debian's; skipped with the install command
    where either (or selenium) is missing, a failure under CI (CI=true)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    missing = [name for name, found in [("chromium", chromium), ("chromedriver", chromedriver),
                                        ("selenium", webdriver)] if not found]
    if missing:
        message = f"the chat page test needs {', '.join(missing)}: {INSTALL}"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1100,1000", "--no-first-run"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    yield driver
    driver.quit()


def _wait(driver, condition, what):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def _by_css(driver, selector):
    from selenium.webdriver.common.by import By
    return driver.find_elements(By.CSS_SELECTOR, selector)


def _fill(driver, element_id, value):
    field = _by_css(driver, f"#{element_id}")[0]
    field.clear()
    field.send_keys(value)


def _send(driver, prompt):
    """Type `prompt`, press send, and return the new turn's element once its stats line is final."""
    count = len(_by_css(driver, ".turn"))
    _fill(driver, "prompt", prompt)
    _by_css(driver, "#send")[0].click()
    _wait(driver, lambda d: len(_by_css(d, ".turn")) == count + 1, "the turn did not appear")
    turn = _by_css(driver, ".turn")[-1]
    _wait(driver, lambda d: _by_css(turn, ".reason-code") or _by_css(turn, ".stats.error"),
          "the turn did not finish")
    return turn


# Records, in order, every text the page writes into an answer and when a stats line gets its
# figures: [("answer", turn index, text length) | ("stats", turn index, number of figures)].
_RECORD_WRITES = """
window.writes = [];
new MutationObserver((records) => {
  const turns = [...document.querySelectorAll(".turn")];
  for (const r of records) {
    const box = r.target.closest(".answer, .stats");
    if (!box || !r.addedNodes.length) continue;
    const kind = box.classList.contains("answer") ? "answer" : "stats";
    const length = kind === "answer" ? [...r.addedNodes].map((n) => n.textContent).join("").length
                                     : box.querySelectorAll("span").length;
    window.writes.push([kind, turns.indexOf(box.closest(".turn")), length]);
  }
}).observe(document.getElementById("turns"), {childList: true, subtree: true});
"""


def _figures(turn) -> dict[str, str]:
    return {span.get_attribute("class").split()[0]: span.text for span in _by_css(turn, ".stats span")}


def _streamed_in(writes, index) -> bool:
    """The answer of turn `index` was written more than once, growing, all before its stats line."""
    answer = [n for kind, i, n in writes if kind == "answer" and i == index]
    stats_at = [at for at, (kind, i, n) in enumerate(writes) if kind == "stats" and i == index and n > 0]
    last_answer_at = max(at for at, (kind, i, n) in enumerate(writes) if kind == "answer" and i == index)
    return (len(answer) >= 2 and answer == sorted(answer) and answer[-1] > answer[0] > 0
            and stats_at and min(stats_at) > last_answer_at)


def _metrics(base_url) -> dict[str, float]:
    lines = httpx.get(f"{base_url}/metrics").text.splitlines()
    return {line.split()[0][len("verispec_"):]: float(line.split()[1]) for line in lines
            if line.startswith("verispec_") and "{" not in line}


def _save_screenshot(driver, tmp_path, name) -> Path:
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 0
    if os.environ.get("VERISPEC_ARTEFACTS"):
        artefacts = Path(os.environ["VERISPEC_ARTEFACTS"])
        artefacts.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, artefacts / name)
    return shot


def test_two_turns_stream_in_with_their_stats_and_switching_speculation_off_shows_off(
        browser, served, tmp_path):
    base_url, _, generations = served
    browser.get(base_url + "/")
    _wait(browser, lambda d: "speculator echo" in _by_css(d, "#server")[0].text,
          "the page did not read /health")
    _fill(browser, "api-key", "")
    _fill(browser, "max-tokens", str(MAX_TOKENS))
    _fill(browser, "temperature", "0")

    started = len(generations)
    refused = _send(browser, "hello")  # no key yet: the server answers 401, the page says what to do
    assert "401" in refused.text and "API key field" in refused.text and len(generations) == started

    _fill(browser, "api-key", KEY)
    browser.execute_script(_RECORD_WRITES)
    echo = _send(browser, ECHO_PROMPT)
    figures = _figures(echo)
    counts = re.fullmatch(r"drafted (\d+), accepted (\d+) \(\d+%\)", figures["drafts"])
    drafted, accepted = int(counts.group(1)), int(counts.group(2))
    assert figures["reason-code"] == "armed" and 0 < accepted <= drafted, figures
    assert figures["tokens"] == f"{MAX_TOKENS} tokens" and figures["speculator"] == "speculator echo"
    assert re.fullmatch(r"[\d.]+ tok/s", figures["tps"])
    assert re.fullmatch(r"first token \d+ ms", figures["ttft"])
    assert _by_css(echo, ".answer")[0].text.strip()

    _by_css(browser, "#speculation")[0].click()  # off, for the next turn
    assert _by_css(browser, "#speculation-state")[0].text.startswith("off")
    plain = _send(browser, "again: the cat sat on the mat")
    figures = _figures(plain)
    assert figures["reason-code"] == "off" and figures["drafts"] == "drafted 0, accepted 0", figures
    # the whole conversation was resent, so the first turn's prompt (byte-level tokens) is a reused prefix
    reused = int(re.fullmatch(r"reused (\d+) prefix tokens", figures["reused"]).group(1))
    assert reused > len(ECHO_PROMPT.encode())

    writes = browser.execute_script("return window.writes")
    assert _streamed_in(writes, 1) and _streamed_in(writes, 2), writes
    assert [g.cancelled for g in generations[started:]] == [False, False]
    _save_screenshot(browser, tmp_path, "chat_page.png")

    browser.refresh()  # the key is kept in localStorage; the conversation is not
    _wait(browser, lambda d: _by_css(d, "#api-key")[0].get_attribute("value") == KEY, "the key was not kept")
    assert not _by_css(browser, ".turn")


def test_stop_aborts_a_turn_mid_stream_and_the_server_cancels_it(browser, served, tmp_path):
    base_url, held, generations = served
    browser.get(base_url + "/")
    _fill(browser, "api-key", KEY)
    _fill(browser, "max-tokens", str(MAX_TOKENS))
    _fill(browser, "temperature", "0")
    before = _metrics(base_url)
    held.hold(3)  # prefill and two steps run, then the engine waits: the turn is caught mid-stream
    try:
        started = len(generations)
        _fill(browser, "prompt", ECHO_PROMPT)
        _by_css(browser, "#send")[0].click()
        _wait(browser, lambda d: _by_css(d, ".turn .answer") and _by_css(d, ".turn .answer")[-1].text.strip(),
              "no text streamed in")
        turn = _by_css(browser, ".turn")[-1]
        assert _by_css(turn, ".stats")[0].text == "streaming…" and not _by_css(turn, ".reason-code")
        _by_css(browser, "#stop")[0].click()
        _wait(browser, lambda d: "stopped after" in _by_css(turn, ".stats")[0].text, "the page did not stop")
        generation = generations[started]
        _wait(browser, lambda d: generation.cancelled, "the server did not cancel the request")
    finally:
        held.release()
    finished = before["requests_finished_total"] + 1
    _wait(browser, lambda d: _metrics(base_url)["requests_finished_total"] == finished,
          "the cancelled generation did not end")
    made = _metrics(base_url)["generated_tokens_total"] - before["generated_tokens_total"]
    shown = int(re.search(r"stopped after (\d+) tokens", _by_css(turn, ".stats")[0].text).group(1))
    assert 0 < shown <= made < MAX_TOKENS  # it ended at the step after the release, not at max_tokens
    assert _by_css(browser, "#send")[0].is_enabled() and not _by_css(browser, "#stop")[0].is_enabled()
    _save_screenshot(browser, tmp_path, "chat_page_stopped.png")
