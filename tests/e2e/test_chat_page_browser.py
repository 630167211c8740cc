"""The chat page in a real browser (headless Chromium driven by Selenium) against the real stack.

Settings are typed into the page, a message is sent with Enter, the reply streams in with TTFT and
tokens/s under it, Stop ends the request as cancelled by the worker, a WebSocket the page drops
resumes from ``last_id`` with exactly the text the Redis stream holds, and refused requests (a bad key,
an unknown model, a rate limit's 429) and a stream that ends in an ``error`` event are explained to the
person (with the right advice for a message past the model's context, and the text of a send that was not accepted
put back in the input); Stop pressed before ingress accepted the request still stops it; a streaming reply is
followed only while the chat is at its bottom; a reload shows every message as it was (a failed turn too, never sent as
context); Settings are validated before any save and close with Escape; on a
phone-sized window the header stays on screen; and on the real default model (SmolLM2-135M-Instruct, greedy) the
page gets a right answer. Needs Debian's ``chromium`` and ``chromium-driver`` (``run.sh test`` installs them); without
them the module skips and says so (fails under ``CI``). ``SLUICEGATE_SAVE_SCREENSHOTS=1`` also writes the screenshots
into ``docs/screenshots/`` (they always go to the test's tmp dir).
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports below follow require_import (tests/needs.py), a CI-aware importorskip
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from needs import needs, require_import

from schemas import DoneEvent, TokenEvent, seq_from_entry_id

from .conftest import Pipeline

require_import("selenium", "pip install -e '.[dev]'")

from selenium import webdriver
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
PROMPT = "Tell me a long story about a river and its sluice gates."
# Stop must find the reply still streaming: greedy decoding of the random paced model (~5 ms a token on an
# idle core) goes on for hundreds of tokens, seconds, long after the test has clicked.
LONG = 1500
THROTTLED_KEY = "sk-throttled-page-test-key"
QUOTA_KEY = "sk-quota-page-test-key"  # 5 tokens a day: any request is over it
TTFT_AND_RATE = re.compile(r"^TTFT \d+(?: ms|\.\d\d s) · \d+\.\d tok/s · \d+ tokens$")

pytestmark = [
    needs(
        os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK),
        "headless Chromium (chromium, chromedriver)",
        "apt-get install -y chromium chromium-driver; bash infra/local/run.sh test does it",
    ),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def tiny_model_dir(paced_model_dir: Path) -> Path:
    """Replies must still be streaming when the test clicks Stop or drops the socket."""
    return paced_model_dir


@pytest.fixture(scope="module")
def pipeline_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A second key, limited to one request a minute, so the page meets a real 429; and ingress's exact prompt count
    off, so a prompt + max_tokens over the context reaches the worker, whose refusal is an error event in the
    stream (the one error the page can meet after its request was accepted)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.jsonl"
    keys.write_text(
        json.dumps({"key": THROTTLED_KEY, "tenant": "throttled", "rpm": 1})
        + "\n"
        + json.dumps({"key": QUOTA_KEY, "tenant": "quota", "tokens_per_day": 5})
        + "\n"
    )
    return {"SLUICEGATE_API_KEYS_FILE": str(keys), "SLUICEGATE_INGRESS_COUNT_PROMPT_TOKENS": "false"}


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,760"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=ChromeService(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def open_page(browser: webdriver.Chrome, pipeline: Pipeline) -> webdriver.Chrome:
    """The pipeline's chat page, freshly loaded with no saved settings."""
    browser.get(f"{pipeline.result_url}/")
    browser.execute_script("localStorage.clear(); sessionStorage.clear()")
    browser.get(f"{pipeline.result_url}/")
    # /config.json filled the ingress URL and (listing ingress's models) the model.
    wait_for(lambda: field(browser, "model").get_attribute("value") == pipeline.model, "model from /config.json")
    return browser


@pytest.fixture
def page(browser: webdriver.Chrome, pipeline: Pipeline) -> webdriver.Chrome:
    """The chat page of the paced random model, freshly loaded with no saved settings."""
    return open_page(browser, pipeline)


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def field(driver: webdriver.Chrome, name: str) -> WebElement:
    return driver.find_element(By.CSS_SELECTOR, f'#settings [name="{name}"]')


def configure(driver: webdriver.Chrome, **values: str) -> None:
    """Open Settings (when closed), type the values, Save."""
    if not driver.find_element(By.ID, "settings").is_displayed():
        driver.find_element(By.ID, "toggle-settings").click()
    for name, value in values.items():
        element = field(driver, name)
        element.clear()
        element.send_keys(value)
    driver.find_element(By.CSS_SELECTOR, '#settings button[type="submit"]').click()


def prompt_box(driver: webdriver.Chrome) -> WebElement:
    return driver.find_element(By.CSS_SELECTOR, '#composer [name="prompt"]')


def send(driver: webdriver.Chrome, prompt: str = PROMPT) -> WebElement:
    """Type the prompt into the emptied box (a failed send puts its text back there), press Enter; the assistant
    message that appears for it."""
    before = len(driver.find_elements(By.CSS_SELECTOR, ".message.assistant"))
    prompt_box(driver).clear()
    prompt_box(driver).send_keys(prompt, Keys.ENTER)
    return wait_for(
        lambda: (m := driver.find_elements(By.CSS_SELECTOR, ".message.assistant"))[before:] and m[before],
        "the assistant message",
    )


def reply_text(driver: webdriver.Chrome, message: WebElement) -> str:
    """The reply's text as streamed: the Markdown source the page keeps beside what it renders (``data-source``).
    Not Selenium's ``.text``, which folds whitespace, and not the rendered text, which Markdown changes."""
    return driver.execute_script("return arguments[0].querySelector('.text').dataset.source", message)


def state(message: WebElement) -> str | None:
    return message.get_attribute("data-state")


def wait_ended(message: WebElement, timeout_s: float = 240) -> str:
    return wait_for(lambda: (s := state(message)) in ("done", "stopped", "failed") and s, "the reply to end", timeout_s)


def stream_text(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


def screenshot(driver: webdriver.Chrome, tmp_path: Path, name: str) -> None:
    driver.save_screenshot(str(tmp_path / name))
    if os.environ.get("SLUICEGATE_SAVE_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOTS / name))


def test_settings_send_and_the_reply_streams_in_with_ttft_and_tokens_per_second(
    page: webdriver.Chrome, pipeline: Pipeline, tmp_path: Path
) -> None:
    assert field(page, "ingressUrl").get_attribute("value") == pipeline.ingress_url
    assert page.find_element(By.ID, "settings").is_displayed(), "settings open while no API key is set"
    configure(page, apiKey=pipeline.api_key, maxTokens="60", temperature="0")
    assert not page.find_element(By.ID, "settings").is_displayed()

    message = send(page)
    # Streamed: text shows while the reply is still streaming, and only grows.
    partial = wait_for(lambda: state(message) == "streaming" and reply_text(page, message), "streamed text")
    assert page.find_element(By.ID, "stop").is_enabled()
    assert wait_ended(message) == "done", message.text
    final = reply_text(page, message)
    assert final.startswith(partial) and len(final) > len(partial)

    events = pipeline.wait_stream_end(message.get_attribute("data-request-id"))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason in ("stop", "length"), done
    assert final == stream_text(events)
    metrics = message.find_element(By.CLASS_NAME, "metrics").text
    assert TTFT_AND_RATE.match(metrics), metrics
    assert metrics.endswith(f"· {done.usage.completion_tokens} tokens")
    expected_note = {"stop": "finished", "length": "finished: reached max tokens"}[done.finish_reason]
    assert message.find_element(By.CLASS_NAME, "note").text == expected_note
    screenshot(page, tmp_path, "reply-with-metrics.png")


def test_stop_cancels_the_request_and_the_worker_aborts_it(
    page: webdriver.Chrome, pipeline: Pipeline, tmp_path: Path
) -> None:
    configure(page, apiKey=pipeline.api_key, maxTokens=str(LONG), temperature="0")
    message = send(page)
    wait_for(lambda: len(reply_text(page, message)) > 20, "some streamed text")
    page.find_element(By.ID, "stop").click()
    assert page.switch_to.active_element == prompt_box(page), "Stop disables itself: the focus goes to the input"
    assert wait_ended(message, timeout_s=60) == "stopped", message.text
    assert page.switch_to.active_element == prompt_box(page)

    request_id = message.get_attribute("data-request-id")
    events = pipeline.wait_stream_end(request_id)
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "abort", done
    assert done.usage.completion_tokens < LONG
    wait_for(lambda: (r := pipeline.record(request_id)) is not None and r.status == "cancelled", "status cancelled")
    assert reply_text(page, message) == stream_text(events)
    assert message.find_element(By.CLASS_NAME, "note").text == "stopped"
    assert TTFT_AND_RATE.match(message.find_element(By.CLASS_NAME, "metrics").text)
    assert page.find_element(By.ID, "send").is_enabled() and not page.find_element(By.ID, "stop").is_enabled()
    screenshot(page, tmp_path, "stopped-reply.png")


def test_a_dropped_websocket_resumes_from_last_id_with_exactly_the_streams_text(
    page: webdriver.Chrome, pipeline: Pipeline
) -> None:
    configure(page, apiKey=pipeline.api_key, maxTokens="120", temperature="0")
    message = send(page)
    wait_for(lambda: len(reply_text(page, message)) > 20, "some streamed text")
    assert page.execute_script("return window.sluicegateChat.current.dropConnection()") is True
    wait_for(
        lambda: len(page.execute_script("return window.sluicegateChat.latest.connections")) > 1, "a second connection"
    )
    assert state(message) == "streaming", "the drop ended the reply instead of resuming it"
    assert wait_ended(message) == "done", message.text

    events = pipeline.wait_stream_end(message.get_attribute("data-request-id"))
    assert reply_text(page, message) == stream_text(events)  # nothing missing, nothing twice
    connections = page.execute_script("return window.sluicegateChat.latest.connections")
    assert len(connections) == 2, connections
    first, resumed = connections
    assert first["lastId"] is None and first["droppedByPage"] is True
    # The resume asked for everything after the last event seen, and the stream went on from exactly there.
    assert resumed["lastId"] is not None and resumed["firstSeq"] == seq_from_entry_id(resumed["lastId"]) + 1


def test_a_reload_mid_reply_shows_the_conversation_and_follows_the_reply_to_its_end(
    page: webdriver.Chrome, pipeline: Pipeline
) -> None:
    """The conversation and the turn in flight live in the tab's sessionStorage: after a reload the page shows
    them again and follows the reply from its stream, which the worker went on generating, to the same text."""
    configure(page, apiKey=pipeline.api_key, maxTokens="40", temperature="0")
    first = send(page, "First question")
    assert wait_ended(first) == "done", first.text
    first_reply = reply_text(page, first)
    message = send(page)
    request_id = message.get_attribute("data-request-id") or wait_for(
        lambda: message.get_attribute("data-request-id"), "the request id"
    )
    wait_for(lambda: reply_text(page, message), "some streamed text")
    page.refresh()
    messages = wait_for(
        lambda: (
            [*page.find_elements(By.CSS_SELECTOR, ".message")][:4][3:]
            and (page.find_elements(By.CSS_SELECTOR, ".message"))
        ),
        "the four messages again",
    )
    assert [m.get_attribute("class").split()[1] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert reply_text(page, messages[1]) == first_reply
    followed = messages[3]
    assert followed.get_attribute("data-request-id") == request_id
    assert wait_ended(followed) == "done", followed.text
    assert reply_text(page, followed) == stream_text(pipeline.wait_stream_end(request_id))
    # Its earlier tokens came back in one burst: a TTFT or a rate would be made up, so only the count is shown.
    assert re.fullmatch(r"\d+ tokens?", followed.find_element(By.CLASS_NAME, "metrics").text)
    # The followed turn is context for the next one, as if the page had never been reloaded.
    history = page.execute_script("return sessionStorage.getItem('sluicegate.chat.session')")
    assert [m["role"] for m in json.loads(history)["conversation"]] == ["user", "assistant"] * 2


_REFUSE_THE_FIRST_POST = """const original = window.fetch;
let refused = false;
window.fetch = async (url, init) => {
  if (!init || init.method !== "POST" || refused) return original(url, init);
  refused = true;
  const body = JSON.stringify({ error: { type: "invalid_request_error", ...arguments[0] } });
  return new Response(body, { status: 400, headers: { "Content-Type": "application/json" } });
};"""


def test_a_reload_mid_reply_keeps_the_note_that_earlier_turns_were_left_out(
    page: webdriver.Chrome, pipeline: Pipeline
) -> None:
    """The reply in flight is shown again after a reload with what was said of it when it was sent: here that the
    conversation's oldest turn was left out to fit the context (ingress's first answer, a context refusal)."""
    configure(page, apiKey=pipeline.api_key, maxTokens="40", temperature="0")
    first = send(page, "First question")
    assert wait_ended(first) == "done", first.text
    page.execute_script(_REFUSE_THE_FIRST_POST, context_refusal(9000, 40))
    message = send(page)
    left_out = "1 earlier turn left out to fit the model's context"
    wait_for(lambda: message.find_element(By.CLASS_NAME, "aside").text == left_out, "the note")
    wait_for(lambda: reply_text(page, message), "some streamed text")
    page.refresh()
    followed = wait_for(
        lambda: (m := page.find_elements(By.CSS_SELECTOR, ".message.assistant"))[1:] and m[-1], "the reply again"
    )
    assert followed.find_element(By.CLASS_NAME, "aside").text == left_out
    assert wait_ended(followed) == "done", followed.text
    # Followed again from its stream, not shown from a finished turn: its earlier tokens came in one burst.
    assert re.fullmatch(r"\d+ tokens?", followed.find_element(By.CLASS_NAME, "metrics").text)


_SHOWN_MESSAGES = """return [...document.querySelectorAll("#log > .message")].map((m) => ({
  classes: [...m.classList].filter((c) => c !== "streaming").sort(),
  state: m.dataset.state ?? null,
  requestId: m.dataset.requestId ?? null,
  source: m.querySelector(".text").dataset.source,
  shown: m.querySelector(".text").textContent,
  note: m.querySelector(".note").textContent,
  metrics: m.querySelector(".metrics").textContent,
  aside: m.querySelector(".aside").textContent,
}));"""

_RECORD_POSTS = """window.sentBodies = [];
const original = window.fetch;
window.fetch = (url, init) => {
  if (init && init.method === "POST") window.sentBodies.push(JSON.parse(init.body));
  return original(url, init);
};"""


def test_a_reload_shows_every_message_as_it_was_and_a_failed_turn_is_still_not_context(
    page: webdriver.Chrome, pipeline: Pipeline
) -> None:
    """A finished, a stopped and a refused turn come back after a reload with their text, state, note and metrics
    (the refused one too, though it never was context); the next turn sends only the finished and stopped turns."""
    configure(page, apiKey=pipeline.api_key, maxTokens="12", temperature="0")
    finished = send(page, "First question")
    assert wait_ended(finished) == "done", finished.text
    configure(page, maxTokens=str(LONG))
    stopped = send(page, "Second question, stopped")
    wait_for(lambda: len(reply_text(page, stopped)) > 20, "some streamed text")
    page.find_element(By.ID, "stop").click()
    assert wait_ended(stopped, timeout_s=60) == "stopped", stopped.text
    configure(page, apiKey="sk-not-a-real-key")
    refused = send(page, "Third question, refused")
    assert wait_ended(refused, timeout_s=30) == "failed", refused.text
    before = page.execute_script(_SHOWN_MESSAGES)
    assert len(before) == 6, before
    assert [m["source"] for m in before[::2]] == [
        "First question",
        "Second question, stopped",
        "Third question, refused",
    ]
    assert [m["state"] for m in before[1::2]] == ["done", "stopped", "failed"], before
    assert before[1]["note"] in ("finished", "finished: reached max tokens"), before[1]
    assert TTFT_AND_RATE.match(before[1]["metrics"]), before[1]
    assert before[3]["note"] == "stopped" and TTFT_AND_RATE.match(before[3]["metrics"])
    assert before[5]["note"].startswith("Not authorised (401):") and before[5]["metrics"] == ""
    assert [m["classes"] for m in before[1::2]] == [
        ["assistant", "message"],
        ["assistant", "message", "stopped"],
        ["assistant", "failed", "message"],
    ]

    page.refresh()
    wait_for(lambda: len(page.find_elements(By.CSS_SELECTOR, "#log > .message")) == 6, "the six messages again")
    assert page.execute_script(_SHOWN_MESSAGES) == before
    # At the end of the chat, the last reply's note in view (Settings open for the wrong key, or not).
    wait_for(lambda: page.execute_script(_LOG_GEOMETRY)["below"] <= 1, "the chat at its end")

    # The next turn's context: the finished and the stopped turns, as streamed; the refused one is not sent.
    wait_for(lambda: field(page, "model").get_attribute("value") == pipeline.model, "model from /config.json")
    configure(page, apiKey=pipeline.api_key, maxTokens="8")
    page.execute_script(_RECORD_POSTS)
    fourth = send(page, "Fourth question")
    assert wait_ended(fourth) == "done", fourth.text
    (body,) = page.execute_script("return window.sentBodies")
    assert body["messages"] == [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": before[1]["source"]},
        {"role": "user", "content": "Second question, stopped"},
        {"role": "assistant", "content": before[3]["source"]},
        {"role": "user", "content": "Fourth question"},
    ]

    # New chat forgets all of it, across a reload too.
    page.find_element(By.ID, "new-chat").click()
    assert not page.find_elements(By.CSS_SELECTOR, "#log > .message")
    page.refresh()
    wait_for(lambda: field(page, "model").get_attribute("value") == pipeline.model, "model from /config.json")
    assert not page.find_elements(By.CSS_SELECTOR, "#log > .message")


def test_a_session_kept_by_the_previous_page_still_loads(page: webdriver.Chrome) -> None:
    """A tab's session written before the page kept its shown messages ({conversation, pending}): the conversation
    is shown as before."""
    old = [{"role": "user", "content": "An old question"}, {"role": "assistant", "content": "An **old** answer"}]
    keep = (
        "sessionStorage.setItem('sluicegate.chat.session', JSON.stringify({conversation: arguments[0], pending: null}))"
    )
    page.execute_script(keep, old)
    page.refresh()
    shown = wait_for(lambda: len(m := page.execute_script(_SHOWN_MESSAGES)) == 2 and m, "the old conversation")
    assert [(m["classes"], m["source"], m["state"], m["note"]) for m in shown] == [
        (["message", "user"], "An old question", None, ""),
        (["assistant", "message"], "An **old** answer", None, ""),
    ]
    assert shown[1]["shown"].strip() == "An old answer"  # as Markdown


def test_a_second_enter_while_a_turn_is_in_flight_starts_nothing(page: webdriver.Chrome, pipeline: Pipeline) -> None:
    """Enter submits the form even with Send disabled: a second message typed while the first is still being
    submitted must not start a second turn beside it (it once did, and the first turn's end broke the second)."""
    configure(page, apiKey=pipeline.api_key, maxTokens="30", temperature="0")
    page.execute_script(
        """const form = document.querySelector('#composer');
        form.elements.prompt.value = 'one'; form.requestSubmit();
        form.elements.prompt.value = 'two'; form.requestSubmit();"""
    )
    assert len(page.find_elements(By.CSS_SELECTOR, ".message.user")) == 1
    assert not page.find_element(By.ID, "new-chat").is_enabled()
    (message,) = page.find_elements(By.CSS_SELECTOR, ".message.assistant")
    assert wait_ended(message) == "done", message.text
    assert page.find_element(By.CSS_SELECTOR, '#composer [name="prompt"]').get_attribute("value") == "two"
    assert page.find_element(By.ID, "new-chat").is_enabled()


_HOLD_ACCEPTED_POSTS = """window.releasePost = null;
const original = window.fetch;
window.fetch = async (url, init) => {
  const response = await original(url, init);
  // The server has accepted the request; its answer reaches the page only when the test releases it.
  if (init && init.method === "POST") await new Promise((resolve) => (window.releasePost = resolve));
  return response;
};"""


def test_stop_pressed_before_the_request_is_accepted_cancels_it_once_it_is(
    page: webdriver.Chrome, pipeline: Pipeline
) -> None:
    """Stop while the page still says "submitting ..." (ingress's 202 not yet read): the stop is remembered, the
    request cancelled as soon as the page has its stream, and the reply ends as stopped, not at max tokens."""
    configure(page, apiKey=pipeline.api_key, maxTokens=str(LONG), temperature="0")
    page.execute_script(_HOLD_ACCEPTED_POSTS)
    message = send(page)
    wait_for(lambda: page.execute_script("return typeof window.releasePost === 'function'"), "the held 202")
    assert page.find_element(By.ID, "status").text == "submitting ..."
    page.find_element(By.ID, "stop").click()
    assert page.find_element(By.ID, "status").text == "stopping ..."
    assert page.switch_to.active_element == prompt_box(page)
    page.execute_script("window.releasePost()")
    assert wait_ended(message, timeout_s=60) == "stopped", message.text
    request_id = message.get_attribute("data-request-id")
    done = pipeline.wait_stream_end(request_id)[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "abort", done
    assert done.usage.completion_tokens < LONG
    assert message.find_element(By.CLASS_NAME, "note").text == "stopped"
    assert page.find_element(By.ID, "send").is_enabled() and not page.find_element(By.ID, "stop").is_enabled()
    # What the next turn sends as context: a reply stopped before any text is not there, nor its question (an
    # empty assistant turn made the model answer the next question with nothing).
    kept = page.execute_script("return JSON.parse(sessionStorage.getItem('sluicegate.chat.session')).conversation")
    assert all(m["content"].strip() for m in kept if m["role"] == "assistant"), kept
    assert len(kept) == (2 if reply_text(page, message).strip() else 0), kept


_LOG_GEOMETRY = """const log = document.getElementById("log");
return {top: log.scrollTop, height: log.scrollHeight, below: log.scrollHeight - log.scrollTop - log.clientHeight};"""


def test_a_streaming_reply_is_followed_only_while_the_chat_is_at_its_bottom(
    page: webdriver.Chrome, pipeline: Pipeline
) -> None:
    """Scrolled up to read, the person stays where they are while the reply streams on; back at the bottom, the
    chat follows the reply again."""
    configure(page, apiKey=pipeline.api_key, maxTokens=str(LONG), temperature="0")
    page.execute_script("for (let i = 0; i < 30; i++) addMessage('user', `An earlier message, number ${i}.`)")
    message = send(page)
    wait_for(lambda: len(reply_text(page, message)) > 20, "some streamed text")
    assert page.execute_script(_LOG_GEOMETRY)["below"] <= 48, "the chat follows the reply it just sent"

    page.execute_script("document.getElementById('log').scrollTop = 0")
    start = page.execute_script(_LOG_GEOMETRY)["height"]
    wait_for(lambda: page.execute_script(_LOG_GEOMETRY)["height"] > start + 60, "the reply to grow")
    assert state(message) == "streaming"
    assert page.execute_script(_LOG_GEOMETRY)["top"] == 0, "the chat jumped back to the bottom"

    page.execute_script("const log = document.getElementById('log'); log.scrollTop = log.scrollHeight")
    start = page.execute_script(_LOG_GEOMETRY)["height"]
    wait_for(lambda: page.execute_script(_LOG_GEOMETRY)["height"] > start + 60, "the reply to grow more")
    assert state(message) == "streaming"
    assert page.execute_script(_LOG_GEOMETRY)["below"] <= 48, "back at the bottom, the chat follows again"
    page.find_element(By.ID, "stop").click()
    assert wait_ended(message, timeout_s=60) in ("stopped", "done"), message.text


_REFUSE_POSTS = """window.posts = 0;
window.refusal = null; // {message, code, param}, or "unreachable"
window.holdPosts = false;
const original = window.fetch;
window.fetch = async (url, init) => {
  if (!init || init.method !== "POST") return original(url, init);
  window.posts += 1;
  if (window.holdPosts) await new Promise((resolve) => (window.releasePost = resolve));
  if (window.refusal === "unreachable") throw new TypeError("Failed to fetch");
  const body = JSON.stringify({ error: { type: "invalid_request_error", ...window.refusal } });
  return new Response(body, { status: 400, headers: { "Content-Type": "application/json" } });
};"""


def context_refusal(in_messages: int, completion: int, context: int = 8192) -> dict[str, str]:
    """Ingress's 400 for a prompt + max tokens past the context, worded as vLLM words it."""
    total = in_messages + completion
    return {
        "code": "context_length_exceeded",
        "param": "messages",
        "message": f"This model's maximum context length is {context} tokens. However, you requested {total} "
        f"tokens ({in_messages} in the messages, {completion} in the completion). Please reduce the length of the "
        "messages or completion.",
    }


def test_a_message_too_long_for_the_context_is_to_be_shortened_and_a_refused_send_keeps_its_text(
    page: webdriver.Chrome, pipeline: Pipeline
) -> None:
    """A message that alone fills the model's context is to be shortened (lowering Max tokens could not help); one
    that fits with fewer tokens to generate gets the Max tokens advice. A send that was not accepted puts its text
    back in the input, unless the person has typed something new meanwhile; a reload keeps what is in the input."""
    configure(page, apiKey=pipeline.api_key, maxTokens="256", temperature="0")
    page.execute_script(_REFUSE_POSTS)
    settings = page.find_element(By.ID, "settings")

    page.execute_script("window.refusal = arguments[0]", context_refusal(9041, 256))
    message = send(page, "A very long message")
    assert wait_ended(message, timeout_s=30) == "failed"
    note = message.find_element(By.CLASS_NAME, "note").text
    assert note.startswith("Message too long for the model (400): This model's maximum context length"), note
    assert note.endswith("Shorten the message and send it again."), note
    assert "Max tokens" not in note and not settings.is_displayed(), "Max tokens is not what to change"
    assert prompt_box(page).get_attribute("value") == "A very long message"

    page.execute_script("window.refusal = arguments[0]", context_refusal(8000, 256))
    message = send(page, "A long message")
    assert wait_ended(message, timeout_s=30) == "failed"
    note = message.find_element(By.CLASS_NAME, "note").text
    assert note.endswith("Lower Max tokens in Settings (this message leaves room for at most 192)."), note
    assert settings.is_displayed()
    assert prompt_box(page).get_attribute("value") == "A long message"
    assert page.execute_script("return window.posts") == 2, "no earlier turn to leave out: nothing sent again"

    page.execute_script("window.refusal = 'unreachable'; window.holdPosts = true")
    message = send(page, "Anyone there?")
    wait_for(lambda: page.execute_script("return typeof window.releasePost === 'function'"), "the held request")
    assert prompt_box(page).get_attribute("value") == ""
    prompt_box(page).send_keys("Something new")
    page.execute_script("window.releasePost()")
    assert wait_ended(message, timeout_s=30) == "failed"
    assert message.find_element(By.CLASS_NAME, "note").text.startswith("Could not reach ingress")
    assert prompt_box(page).get_attribute("value") == "Something new", "the new text is kept, not joined"

    page.execute_script("window.holdPosts = false")
    message = send(page, "Anyone there now?")
    assert wait_ended(message, timeout_s=30) == "failed"
    assert prompt_box(page).get_attribute("value") == "Anyone there now?"

    # A reload keeps the message put back (and anything being typed): it was only ever in the input.
    page.refresh()
    wait_for(lambda: prompt_box(page).get_attribute("value") == "Anyone there now?", "the put-back message kept")
    prompt_box(page).send_keys(" Hello?")
    page.refresh()
    wait_for(lambda: prompt_box(page).get_attribute("value") == "Anyone there now? Hello?", "the typed text kept")


def test_on_a_phone_a_long_status_stays_one_line_and_the_buttons_stay_on_screen(
    browser: webdriver.Chrome, pipeline: Pipeline, tmp_path: Path
) -> None:
    """At 375 px a refused key's long status is cut to one line (the whole of it in its title), and the header keeps
    the title and both buttons on screen, each on one line."""
    browser.set_window_size(375, 700)
    try:
        page = open_page(browser, pipeline)
        configure(page, apiKey="sk-not-a-real-key")
        status = page.find_element(By.ID, "status")
        wait_for(lambda: status.text.startswith("could not list models: Not authorised (401)"), "the 401 status")
        box = page.execute_script(
            """const rect = (s) => document.querySelector(s).getBoundingClientRect();
            const status = document.getElementById("status");
            return {
              width: window.innerWidth, header: rect("header").height, title: status.title, text: status.textContent,
              status: rect("#status").height, statusLine: parseFloat(getComputedStyle(status).lineHeight),
              cut: status.scrollWidth > status.clientWidth,
              heights: ["header h1", "#new-chat", "#toggle-settings"].map((s) => rect(s).height),
              rights: ["header h1", "#new-chat", "#toggle-settings", "#status"].map((s) => rect(s).right),
            };"""
        )
        screenshot(page, tmp_path, "narrow-long-status.png")
        assert box["width"] <= 400, box
        assert box["title"] == box["text"] and "Check the API key in Settings." in box["title"], box
        assert box["cut"] and box["status"] <= 1.5 * box["statusLine"], box
        assert box["header"] < 100, box
        assert all(height < 40 for height in box["heights"]), box  # each on one line
        assert all(right <= box["width"] for right in box["rights"]), box
        assert page.find_element(By.ID, "toggle-settings").is_displayed()
    finally:
        browser.set_window_size(1100, 760)


def saved_settings(page: webdriver.Chrome) -> dict[str, Any]:
    return json.loads(page.execute_script("return localStorage.getItem('sluicegate.chat.settings')") or "{}")


def test_settings_are_validated_before_refresh_models_saves_them_and_escape_closes_them(
    page: webdriver.Chrome, pipeline: Pipeline
) -> None:
    """Refresh models saves the settings only when Save would (out-of-range or empty numbers are pointed at, not
    stored or replaced); Escape closes Settings; the system prompt box shows several lines and grows; closing
    without Save drops the edits."""
    configure(page, apiKey=pipeline.api_key, maxTokens="60", temperature="0.5")
    assert page.switch_to.active_element == prompt_box(page), "after Save, the focus is where a message is typed"
    good = saved_settings(page)
    assert good["maxTokens"] == 60 and good["temperature"] == 0.5
    page.find_element(By.ID, "toggle-settings").click()
    refresh = page.find_element(By.ID, "refresh-models")
    for name, bad, fine in [("temperature", "5", "0.5"), ("maxTokens", "0", "60"), ("temperature", "", "0.5")]:
        field(page, name).clear()
        if bad:
            field(page, name).send_keys(bad)
        refresh.click()
        assert saved_settings(page) == good, f"{name}={bad!r} was stored"
        assert page.switch_to.active_element == field(page, name), "the browser points at the invalid field"
        assert field(page, name).get_attribute("validationMessage")
        assert page.find_element(By.ID, "status").text.startswith("settings not saved")
        field(page, name).clear()
        field(page, name).send_keys(fine)
    field(page, "maxTokens").clear()
    field(page, "maxTokens").send_keys("77")
    refresh.click()
    wait_for(lambda: saved_settings(page).get("maxTokens") == 77, "the valid settings saved")
    assert field(page, "maxTokens").get_attribute("value") == "77"
    # An empty model is what Refresh models is for: it saves, lists the models and picks the first.
    field(page, "model").clear()
    refresh.click()
    wait_for(lambda: saved_settings(page).get("model") == pipeline.model, "the first listed model picked")
    assert field(page, "model").get_attribute("value") == pipeline.model

    # The API key is not offered to a password manager; the system prompt shows several lines and grows with its text.
    assert field(page, "apiKey").get_attribute("autocomplete") == "off"
    system = field(page, "system")
    assert int(system.get_attribute("rows")) >= 3
    empty_height = system.size["height"]
    system.send_keys(*[f"Rule {n}: answer briefly." + Keys.SHIFT + Keys.ENTER + Keys.SHIFT for n in range(6)])
    assert system.size["height"] > empty_height + 30, "the system prompt box grew with its text"

    system.send_keys(Keys.ESCAPE)
    assert not page.find_element(By.ID, "settings").is_displayed()
    toggle = page.find_element(By.ID, "toggle-settings")
    assert toggle.get_attribute("aria-expanded") == "false" and page.switch_to.active_element == toggle

    # Closing without Save drops what was typed (Escape or the toggle alike): reopened, the form shows the settings
    # the chat uses, not edits that never took effect.
    toggle.click()
    assert field(page, "system").get_attribute("value") == "", "the unsaved system prompt is gone"
    field(page, "maxTokens").clear()
    field(page, "maxTokens").send_keys("99")
    toggle.click()
    toggle.click()
    assert field(page, "maxTokens").get_attribute("value") == "77"
    assert saved_settings(page)["maxTokens"] == 77


def test_a_blank_message_is_not_sent_and_the_browser_says_why(page: webdriver.Chrome, pipeline: Pipeline) -> None:
    configure(page, apiKey=pipeline.api_key, maxTokens="8", temperature="0")
    box = prompt_box(page)
    box.send_keys("   ", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "  ", Keys.ENTER)
    assert not page.find_elements(By.CSS_SELECTOR, ".message")
    assert page.execute_script("return arguments[0].validity.valid", box) is False
    assert "spaces and blank lines alone are not sent" in box.get_attribute("validationMessage")
    box.send_keys("Hello?")
    assert page.execute_script("return arguments[0].validity.valid", box) is True
    box.send_keys(Keys.ENTER)
    (message,) = wait_for(lambda: page.find_elements(By.CSS_SELECTOR, ".message.assistant"), "the reply")
    assert wait_ended(message) == "done", message.text
    assert page.find_elements(By.CSS_SELECTOR, ".message.user")[0].text.endswith("Hello?")


_FOLLOW_TWO_ON_ONE_SOCKET = """
const [ingress, key, model, streams, done] = arguments;
const submit = async (prompt) => {
  const response = await fetch(`${ingress}/v1/requests`, {
    method: "POST",
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body: JSON.stringify({ model, prompt, max_tokens: 12, temperature: 0 }),
  });
  return response.json();
};
(async () => {
  const socket = new WebSocket(streams);
  await new Promise((resolve) => (socket.onopen = resolve));
  const messages = [];
  const ended = new Set();
  const submitted = [await submit("one river"), await submit("two gates")];
  socket.onmessage = (message) => {
    const event = JSON.parse(message.data);
    messages.push(event);
    if (["done", "error", "closed"].includes(event.type)) ended.add(event.request_id);
    if (ended.size === submitted.length) done({ ids: submitted.map((s) => s.request_id), messages });
  };
  socket.send("not json");
  for (const { request_id, stream_token: token } of submitted) {
    socket.send(JSON.stringify({ type: "subscribe", request_id, token }));
  }
})().catch((error) => done({ error: String(error) }));
"""


def test_a_browser_follows_two_requests_on_one_multiplexed_socket(
    browser: webdriver.Chrome, pipeline: Pipeline
) -> None:
    """The result service's ``/v1/streams`` in Chromium's own WebSocket: two requests' streams arrive whole on one
    socket, each exactly as the Redis stream holds it, after an ``invalid`` notice for a bad message."""
    browser.get(f"{pipeline.result_url}/")  # the page's origin, which ingress's CORS allows
    browser.set_script_timeout(60)
    streams = pipeline.result_url.replace("http://", "ws://") + "/v1/streams"
    got = browser.execute_async_script(
        _FOLLOW_TWO_ON_ONE_SOCKET, pipeline.ingress_url, pipeline.api_key, pipeline.model, streams
    )
    assert "error" not in got, got
    messages = got["messages"]
    assert messages[0]["type"] == "invalid"
    for request_id in got["ids"]:
        relayed = [m for m in messages if m.get("request_id") == request_id]
        events = pipeline.wait_stream_end(request_id)
        assert [m["seq"] for m in relayed] == [e.seq for e in events]
        assert relayed[-1]["type"] == "done" and stream_text(events) == "".join(
            m.get("text", "") for m in relayed if m["type"] == "token"
        )


def test_refused_requests_are_explained_to_the_person(
    page: webdriver.Chrome, pipeline: Pipeline, tmp_path: Path
) -> None:
    configure(page, apiKey="sk-not-a-real-key", maxTokens="16")
    message = send(page, "Hello?")
    assert wait_ended(message, timeout_s=30) == "failed"
    note = message.find_element(By.CLASS_NAME, "note").text
    assert note.startswith("Not authorised (401):") and "Check the API key in Settings." in note, note
    assert page.find_element(By.ID, "settings").is_displayed(), "settings opened to fix the key"
    assert page.find_element(By.ID, "send").is_enabled()
    assert prompt_box(page).get_attribute("value") == "Hello?", "nothing was sent: the text is back to send again"
    screenshot(page, tmp_path, "error-bad-api-key.png")

    configure(page, apiKey=pipeline.api_key, model="no-such-model")
    message = send(page, "Hello again?")
    assert wait_ended(message, timeout_s=30) == "failed"
    note = message.find_element(By.CLASS_NAME, "note").text
    assert note.startswith("Model not found (404):") and "no-such-model" in note, note


def test_a_rate_limit_is_explained_with_when_to_try_again(
    page: webdriver.Chrome, pipeline: Pipeline, tmp_path: Path
) -> None:
    configure(page, apiKey=THROTTLED_KEY, maxTokens="8", temperature="0")
    first = send(page, "Hello?")
    assert wait_ended(first) == "done", first.text  # the minute's one request
    message = send(page, "And again?")
    assert wait_ended(message, timeout_s=30) == "failed"
    note = message.find_element(By.CLASS_NAME, "note").text
    # What happened, ingress's own words (which limit), and when to try again, said once.
    assert note.startswith("Too many requests (429): Rate limit reached") and "1 requests per minute" in note, note
    assert len(re.findall(r"(?:Retry after|Try again in) \d+(?:\.\d+)? s\.", note)) == 1, note
    assert message.get_attribute("data-request-id") is None, "nothing was queued"
    assert page.find_element(By.ID, "send").is_enabled() and not page.find_element(By.ID, "stop").is_enabled()
    screenshot(page, tmp_path, "error-rate-limited.png")


def test_a_used_up_quota_and_max_tokens_past_the_context_are_explained(
    page: webdriver.Chrome, pipeline: Pipeline
) -> None:
    """A quota is not a rate limit that passes in seconds: the page says it is used up, with ingress's reset time,
    once. Max tokens past the context is the setting to change, not the conversation to shorten: the page says so,
    opens Settings, and sends nothing more."""
    configure(page, apiKey=QUOTA_KEY, maxTokens="8", temperature="0")
    message = send(page, "Hello?")
    assert wait_ended(message, timeout_s=30) == "failed"
    note = message.find_element(By.CLASS_NAME, "note").text
    assert note.startswith("Token quota used up (429):") and "Try again in" not in note, note

    context = max(b.max_model_len or 0 for b in pipeline.heartbeats().values())
    configure(page, apiKey=pipeline.api_key, maxTokens=str(context + 1))
    page.execute_script(
        """window.posts = 0;
        const original = window.fetch;
        window.fetch = (url, init) => {
          if (init && init.method === "POST") window.posts += 1;
          return original(url, init);
        };"""
    )
    assert not page.find_element(By.ID, "settings").is_displayed()
    message = send(page, "Hello?")
    assert wait_ended(message, timeout_s=30) == "failed"
    note = message.find_element(By.CLASS_NAME, "note").text
    assert "Lower Max tokens in Settings" in note, note
    assert page.find_element(By.ID, "settings").is_displayed()
    assert page.execute_script("return window.posts") == 1, "no turn left out: it could not help"


def test_a_stream_that_ends_in_an_error_event_is_explained(
    page: webdriver.Chrome, pipeline: Pipeline, tmp_path: Path
) -> None:
    """The worker refuses a request whose prompt + max_tokens pass the model's context (ingress, with its exact
    count off here, checks max_tokens alone): the request was accepted and its stream ends with ``error``, which the
    page shows. (With the count on, the default, ingress refuses it at once: test_context_and_tokenize.py.)"""
    context = max(b.max_model_len or 0 for b in pipeline.heartbeats().values())
    assert context > 0, "the worker reports its context length"
    configure(page, apiKey=pipeline.api_key, maxTokens=str(context - 2), temperature="0")
    message = send(page, PROMPT)
    assert wait_ended(message, timeout_s=60) == "failed", message.text
    events = pipeline.wait_stream_end(message.get_attribute("data-request-id"))
    error = events[-1]
    assert error.type == "error" and error.code == "context_length_exceeded", error
    note = message.find_element(By.CLASS_NAME, "note").text
    assert note == f"Generation failed ({error.code}): {error.message}", note
    assert page.find_element(By.ID, "send").is_enabled()
    screenshot(page, tmp_path, "error-in-stream.png")


@pytest.mark.slow
def test_the_real_model_answers_a_question_on_the_page(
    browser: webdriver.Chrome, real_pipeline: Pipeline, tmp_path: Path
) -> None:
    """The default model of ``sluicegate up``, greedy (temperature 0 in Settings), knows the capital of France."""
    page = open_page(browser, real_pipeline)
    configure(page, apiKey=real_pipeline.api_key, maxTokens="48", temperature="0")
    message = send(page, "What is the capital of France?")
    assert wait_ended(message, timeout_s=180) == "done", message.text
    reply = reply_text(page, message)
    assert "Paris" in reply, reply
    assert "Paris" in message.find_element(By.CLASS_NAME, "text").text  # and shown
    assert TTFT_AND_RATE.match(message.find_element(By.CLASS_NAME, "metrics").text)
    screenshot(page, tmp_path, "real-model-reply.png")


@pytest.mark.slow
def test_a_conversation_past_the_context_leaves_out_its_oldest_turns(
    browser: webdriver.Chrome, real_pipeline: Pipeline
) -> None:
    """Ingress refuses a conversation whose prompt + max tokens pass the model's context (its exact count is on
    here); the page leaves out the oldest turns until the request fits, says so, and the turns left out are no
    longer sent. Max tokens is set near the context, so a reply still running is stopped rather than awaited."""
    page = open_page(browser, real_pipeline)
    earlier = []
    for n in range(4):
        earlier += [
            {"role": "user", "content": f"Tell me fact {n} about rivers. " + "Rivers flow downhill to the sea. " * 12},
            {"role": "assistant", "content": f"Fact {n}: rivers carry water and sediment to the sea."},
        ]
    page.execute_script(
        "sessionStorage.setItem('sluicegate.chat.session', JSON.stringify({conversation: arguments[0]}))", earlier
    )
    page.refresh()
    wait_for(lambda: len(page.find_elements(By.CSS_SELECTOR, ".message")) == len(earlier), "the restored conversation")
    # The page fills Settings from /config.json after it shows the conversation: typed before that, the values
    # were written over (or the form was not there to type in).
    wait_for(lambda: field(page, "model").get_attribute("value") == real_pipeline.model, "model from /config.json")
    context = max(b.max_model_len or 0 for b in real_pipeline.heartbeats().values())
    # Room for the newest message and about two of the four earlier turns (each about 110 tokens).
    configure(page, apiKey=real_pipeline.api_key, maxTokens=str(context - 300), temperature="0")
    message = send(page, "What is the capital of France?")
    wait_for(lambda: state(message) == "streaming" and reply_text(page, message), "the reply to stream")
    aside = message.find_element(By.CLASS_NAME, "aside").text
    found = re.fullmatch(r"(\d) earlier turns? left out to fit the model's context", aside)
    assert found and 1 <= int(found.group(1)) <= 3, aside
    left_out = int(found.group(1))
    # The model may already have ended its reply (EOS); Stop then does nothing, and a disabled button is no error.
    page.execute_script("document.getElementById('stop').click()")
    assert wait_ended(message) in ("stopped", "done"), message.text
    # The reply, stopped or not, is kept as context: what the next turn sends starts after the turns left out.
    session = json.loads(page.execute_script("return sessionStorage.getItem('sluicegate.chat.session')"))
    sent = session["conversation"]
    assert sent[:-2] == earlier[2 * left_out :], "the turns left out are not sent again"
    assert sent[-2] == {"role": "user", "content": "What is the capital of France?"}


MARKDOWN = """Here is **the plan**, with `sluice` in code:

1. open the gate
2. let the river through

| gate | state |
| --- | --- |
| north | open |

```python
print("flow")
```

<img src="nowhere" onerror="window.pwned = 'img'"> and [a link](javascript:window.pwned='link') and
[the docs](https://example.org/docs)."""


def test_a_reply_is_shown_as_markdown_and_nothing_in_it_runs(page: webdriver.Chrome) -> None:
    """The model's Markdown is rendered (emphasis, lists, tables, code); HTML it writes is shown as text, and a
    javascript: link or event handler never reaches the page."""
    shown = page.execute_script(
        """const view = addMessage("assistant", "");
        view.show(arguments[0]);
        const text = view.body;
        return {
          source: text.dataset.source,
          strong: [...text.querySelectorAll("strong")].map((e) => e.textContent),
          code: [...text.querySelectorAll(":not(pre) > code")].map((e) => e.textContent),
          items: [...text.querySelectorAll("ol > li")].map((e) => e.textContent),
          cells: [...text.querySelectorAll("td")].map((e) => e.textContent),
          block: text.querySelector("pre > code")?.textContent,
          images: text.querySelectorAll("img").length,
          links: [...text.querySelectorAll("a")].map((a) => [a.getAttribute("href"), a.target, a.rel]),
          handlers: text.querySelectorAll("[onerror]").length,
          rendered: text.textContent,
        };""",
        MARKDOWN,
    )
    assert shown["source"] == MARKDOWN
    assert shown["strong"] == ["the plan"] and shown["code"] == ["sluice"]
    assert shown["items"] == ["open the gate", "let the river through"]
    assert shown["cells"] == ["north", "open"]
    assert shown["block"] == 'print("flow")\n'
    assert shown["images"] == 0 and shown["handlers"] == 0
    assert '<img src="nowhere"' in shown["rendered"]  # the HTML the model wrote, shown as text
    hrefs = [href for href, _, _ in shown["links"]]
    assert hrefs[-1] == "https://example.org/docs"
    assert not any(href and href.startswith("javascript") for href in hrefs)
    assert shown["links"][-1][1:] == ["_blank", "noopener noreferrer"]
    time.sleep(0.3)  # an onerror would have fired by now
    assert page.execute_script("return window.pwned") is None
