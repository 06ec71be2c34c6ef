"""The chat page (GET /) in a real headless Chromium, driven by Selenium, against a real `astrai serve` on loopback:
the tiny chat model and the server of test_serve_api.py (its fixtures; this module gets its own server).

Needs selenium (the dev extra) and the system's chromium and chromedriver (`apt-get install chromium
chromium-driver`; Selenium is pointed at that chromedriver, so its driver download is never tried). Without them
the test skips, saying what is missing; with ASTRAI_REQUIRE_BROWSER=1 (as .ci/run sets) it fails instead.
"""

from __future__ import annotations

import os
import shutil

import openai
import pytest

from test_serve_api import (CONTEXT, KEY, MODEL_ID, USER, _start_server, _stop_server,  # noqa: F401 (fixtures)
                            served, server)


def _missing(reason: str) -> None:
    if os.environ.get("ASTRAI_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason}, and ASTRAI_REQUIRE_BROWSER=1 requires the browser test")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
    except ImportError:
        _missing("selenium is not installed (pip install -e '.[dev]')")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if not (chromium and chromedriver):
        _missing("chromium or chromedriver is not on PATH (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=chromedriver))
    yield driver
    driver.quit()


def test_chat_page_streams_the_greedy_reply_and_shows_errors(browser, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    def field(name: str, value: str) -> None:
        box = browser.find_element(By.ID, name)
        box.clear()
        box.send_keys(value)

    def send(prompt: str) -> tuple[str, str, str]:
        """Type a prompt, click Send, wait for the reply: (its status, its text, its classes)."""
        before = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
        field("prompt", prompt)
        browser.find_element(By.ID, "send").click()
        reply = WebDriverWait(browser, 60).until(
            lambda d: (r := d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[before:])
            and r[0].get_attribute("data-status") not in (None, "streaming") and r[0])
        return reply.get_attribute("data-status"), reply.get_attribute("textContent"), reply.get_attribute("class")

    browser.get(f"{server}/")
    model = browser.find_element(By.ID, "model")
    # The server wants a key: without one the page names the server's 401, with it the served model.
    WebDriverWait(browser, 30).until(lambda d: "API key" in model.text)
    field("key", KEY + Keys.TAB)  # leaving the field reloads the model list
    WebDriverWait(browser, 30).until(lambda d: model.text == MODEL_ID)
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0.7"  # the page's default

    field("temperature", "0")
    field("max-tokens", "40")
    status, text, _ = send(USER[0]["content"])
    api = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    expected = api.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=40, temperature=0)
    assert (status, text) == ("done", expected.choices[0].message.content) and text

    # An error response shows the server's own message.
    field("temperature", "5")
    status, text, classes = send("the queen")
    assert status == "error" and "error" in classes.split()
    assert "temperature: Input should be less than or equal to 2" in text, text
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "the queen"  # kept, to send again


def test_chat_page_keeps_recent_turns_past_the_context_and_names_a_server_gone(browser, served, tmp_path):
    """A conversation that outgrows the context keeps its most recent turns and says so, instead of failing every
    later message; when the server is gone the page says "server not reachable" and the message stays typed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    proc, url = _start_server(["--model", str(served["ckpt"]), "--kv-blocks", "64"], tmp_path)
    try:
        browser.get(f"{url}/")
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").text == MODEL_ID)
        for name, value in (("temperature", "0"), ("max-tokens", "16")):
            box = browser.find_element(By.ID, name)
            box.clear()
            box.send_keys(value)

        def send(prompt: str) -> tuple[str, str]:
            before = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
            box = browser.find_element(By.ID, "prompt")
            browser.execute_script("arguments[0].value = arguments[1]", box, prompt)  # faster than typing it
            browser.find_element(By.ID, "send").click()
            reply = WebDriverWait(browser, 60).until(
                lambda d: (r := d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[before:])
                and r[0].get_attribute("data-status") not in (None, "streaming") and r[0])
            return reply.get_attribute("data-status"), reply.get_attribute("textContent")

        words = "the king speaks to the queen of the castle and the lord follows the fool in the rain ".split()
        message = " ".join(words * 3)  # ~50 tokens: a few turns fill the context of CONTEXT (192) tokens
        statuses = [send(f"{i} {message}") for i in range(6)]
        assert [status for status, _ in statuses] == ["done"] * 6, statuses
        notes = [n.text for n in browser.find_elements(By.CSS_SELECTOR, ".msg.note")]
        assert notes and all("left out" in n and "New chat starts afresh" in n for n in notes), notes
        sent = browser.execute_script("return turns.map((t) => t.content)")  # what the model sees now
        assert sent[0].startswith(tuple(f"{i} " for i in range(1, 6))) and sent[-2].startswith("5 "), sent
        alone = " ".join(words * 20)  # more than the context alone: an error naming it, the message kept
        status, text = send(alone)
        assert status == "error" and f"the context is {CONTEXT}" in text, text
        assert browser.find_element(By.ID, "prompt").get_attribute("value") == alone
        assert browser.execute_script("return turns.map((t) => t.content)") == sent  # the recent turns stay
    finally:
        _stop_server(proc)
    status, text = send("are you there")
    assert status == "error" and "server not reachable" in text and "Failed to fetch" not in text, text
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "are you there"
