"""demo.py: the page in headless Chromium (a typed problem gets both streamed answers and a
verdict; bad input refused on the page), the event stream read directly, each refusal by name.

The browser tests need selenium (requirements-dev.txt) and Debian's chromium and chromium-driver
(`apt-get install chromium chromium-driver`, as .ci/run does); it skips, saying so, without them."""

import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import demo  # noqa: E402
from test_train import digit_checkpoint  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny digit models: 'trained' and 'base' (different random weights)."""
    folder = tmp_path_factory.mktemp("demo")
    return digit_checkpoint(folder / "trained", seed=1), digit_checkpoint(folder / "base", seed=2)


def test_each_bad_field_is_refused_by_name():
    answerers = {"trained": object(), "base": object()}
    good = {"model": ["trained"], "question": ["What is 2 + 3 ?"], "temperature": ["0.5"],
            "max_new_tokens": ["8"], "reference": ["5"]}
    assert demo.read_request(good, answerers)[1:] == ("What is 2 + 3 ?", "5", 0.5, 8)
    for field, value, said in [("model", "other", "model must be one of trained, base"),
                               ("question", "  ", "type a problem first"),
                               ("question", "1" * 2001, "2001 characters; at most 2000"),
                               ("reference", "9" * 201, "at most 200"),
                               ("temperature", "hot", "temperature must be a number"),
                               ("temperature", "nan", "between 0 and 2"),
                               ("temperature", "-1", "between 0 and 2"),
                               ("max_new_tokens", "1.5", "a whole number"),
                               ("max_new_tokens", "100000", "between 1 and 1024")]:
        with pytest.raises(demo.Refused, match=said.replace("(", r"\(")):
            demo.read_request({**good, field: [value]}, answerers)


def serve_in_thread(answerers, problems):
    server = demo.ThreadingHTTPServer(("127.0.0.1", 0), demo.Handler)
    server.answerers, server.problems, server.daemon_threads = answerers, problems, True
    server.hosts = {"127.0.0.1"}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def events(url):
    """The (event, data) pairs of a server-sent event stream, to its end."""
    with urllib.request.urlopen(url, timeout=60) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        blocks = response.read().decode().strip().split("\n\n")
    return [(block.split("\n")[0].removeprefix("event: "), json.loads(block.split("\n")[1][6:]))
            for block in blocks]


def test_an_answer_streams_token_by_token_then_its_verdict(models):
    from run import checkpoints
    model, tokenizer = checkpoints.load_model(models[0], dtype=torch.float32, device="cpu")
    answerer = demo.Answerer("tiny", model.eval(), tokenizer, "none")
    answerer.stop_ids = []  # never stops early: every step of the budget is streamed
    server = serve_in_thread({"trained": answerer, "base": answerer}, [])
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/answer?model=trained&question=What+is+2+%2B+3+%3F"
        stream = events(base + "&reference=5&temperature=0&max_new_tokens=5")
        texts = [payload["text"] for kind, payload in stream if kind == "text"]
        kind, done = stream[-1]
        assert kind == "done" and len(texts) == 4  # steps 1..4 while sampling; the 5th is in "done"
        assert all(done["text"].startswith(text) for text in texts)  # each a prefix of the answer
        assert done["verdict"] in ("correct", "wrong")
        refused = events(base.replace("trained", "nobody"))
        assert refused == [("refused", {"error": "model must be one of trained, base"})]
        too_long = events(base + "&max_new_tokens=1000")  # the tiny model's context is 64 tokens
        assert too_long[0][0] == "refused" and "context of 64" in too_long[0][1]["error"]
    finally:
        server.shutdown()


@pytest.mark.slow
def test_bad_flags_name_the_flag(tmp_path):
    for argv, said in [(["--model", str(tmp_path / "nowhere"), "--base", str(tmp_path)], "--model"),
                       (["--model", "x", "--port", "70000"], "--port"),
                       (["--model", "x", "--data", "memory"], "--data")]:
        proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "demo.py"), *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# ---- in a real browser ---------------------------------------------------------------------------

def chromium():
    """Headless Chromium through selenium, or a skip saying what to install."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("the browser test needs selenium: pip install selenium")
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip("the browser test needs Debian's chromium and chromium-driver: "
                    "apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1280,900"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def browser():
    """chromium(), shared by the browser tests; named before `page` in a test's arguments, so a
    reader without selenium gets the skip before any model is built or any server starts."""
    driver = chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(models):
    """demo.py serving the two tiny models, as a user starts it: -> its address."""
    trained, base = models
    proc = subprocess.Popen([sys.executable, str(ROOT / "recipes" / "demo.py"), "--model", trained, "--base", base,
                             "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = proc.stdout.readline()  # "serving http://127.0.0.1:PORT/ (Ctrl-C stops)"
    assert line.startswith("serving http://127.0.0.1:"), line + proc.stderr.read()
    yield line.split()[1]
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.slow
def test_a_typed_problem_gets_both_answers_and_a_verdict_in_the_browser(browser, page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    browser.get(page)
    WebDriverWait(browser, 30).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#problems option")) > 1)
    assert "trained: " in browser.find_element(By.CSS_SELECTOR, "#trained h3").text
    browser.find_element(By.ID, "question").send_keys("What is 2 + 3 ?")
    browser.find_element(By.ID, "reference").send_keys("5")
    budget = browser.find_element(By.ID, "max_new_tokens")
    budget.clear()
    budget.send_keys("6")
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 120).until(lambda b: all(
        b.find_element(By.ID, which).get_attribute("data-state") == "done" for which in ("trained", "base")))
    for which in ("trained", "base"):
        assert browser.find_element(By.CSS_SELECTOR, f"#{which} .verdict").text in ("correct", "wrong")
        assert browser.find_element(By.CSS_SELECTOR, f"#{which} .extracted").text != ""
    # Picking a held-out problem fills the question and its answer.
    browser.find_element(By.CSS_SELECTOR, "#problems option:nth-child(2)").click()
    assert browser.find_element(By.ID, "question").get_attribute("value").strip()
    assert browser.find_element(By.ID, "reference").get_attribute("value").strip()
    # Bad input is refused on the page, by name.
    question = browser.find_element(By.ID, "question")
    question.clear()
    browser.execute_script("arguments[0].value = '7'.repeat(2500)", question)
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 30).until(lambda b: "at most 2000" in b.find_element(By.ID, "refused").text)
    question.clear()
    question.send_keys("What is 1 + 1 ?")
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("hot")
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 30).until(lambda b: "temperature must be" in b.find_element(By.ID, "refused").text)


def test_the_server_answers_while_the_page_waits(page):
    """Two answers at once (the page opens both streams together) each end."""
    query = "question=What+is+1+%2B+1+%3F&temperature=0.7&max_new_tokens=4"
    results = {}

    def fetch(which):
        results[which] = events(f"{page}answer?model={which}&{query}")[-1][0]
    threads = [threading.Thread(target=fetch, args=(which,)) for which in ("trained", "base")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {"trained": "done", "base": "done"}


class MarkupAnswerer:
    """A stand-in model whose answer is markup: the page must show it as text."""
    name = "<b>stub</b>"
    text = '<img src=x onerror="document.title=1">**5**'

    def answer(self, question, temperature, max_new_tokens, on_text):
        on_text(self.text[:10])
        return self.text


def test_a_page_from_elsewhere_is_refused():
    server = serve_in_thread({"trained": MarkupAnswerer(), "base": MarkupAnswerer()}, [])
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}/problems",
                                         headers={"Host": "attacker.example"})
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(request, timeout=30)
    finally:
        server.shutdown()


def test_model_text_is_shown_as_text_never_as_markup(browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    server = serve_in_thread({"trained": MarkupAnswerer(), "base": MarkupAnswerer()}, [])
    try:
        browser.get(f"http://127.0.0.1:{server.server_address[1]}/")
        WebDriverWait(browser, 30).until(
            lambda b: b.find_element(By.CSS_SELECTOR, "#trained h3").text == "trained: <b>stub</b>")
        browser.find_element(By.ID, "question").send_keys("anything")
        browser.find_element(By.ID, "go").click()
        WebDriverWait(browser, 30).until(lambda b: all(
            b.find_element(By.ID, which).get_attribute("data-state") == "done" for which in ("trained", "base")))
        assert browser.find_element(By.CSS_SELECTOR, "#trained .text").text == MarkupAnswerer.text
        assert not browser.find_elements(By.CSS_SELECTOR, "img, b") and browser.title != "1"
        assert browser.find_element(By.CSS_SELECTOR, "#base .verdict").text == "(no reference to check)"
    finally:
        server.shutdown()


def test_the_browser_tests_skip_without_selenium(tmp_path):
    """A reader who installed requirements.txt alone (no selenium, no pytest-xdist) runs the
    browser tests: each is skipped, saying what to install, never an error. A selenium.py that
    raises ImportError, first on the path, stands in for the missing package."""
    (tmp_path / "selenium.py").write_text("raise ImportError('no module named selenium')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-rs", "-p", "no:cacheprovider",
                           "-k", "markup or typed_problem"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=path, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the browser test needs selenium: pip install selenium" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("2 skipped"), proc.stdout[-3000:]


@pytest.mark.slow
def test_an_address_it_cannot_listen_on_is_one_line(models):
    trained, base = models
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "demo.py"), "--model", trained, "--base", base,
                           "--host", "no-such-host.invalid"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "argument --host/--port: cannot listen on no-such-host.invalid" \
        in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def raw_request(port, data):
    """Sends raw bytes, closes the writing side, -> the reply's bytes."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def test_requests_it_cannot_parse_get_a_reply_and_no_traceback(capfd):
    """A malformed request line, an over-long one, an unknown HTTP version: each a 4xx/5xx reply;
    a client that leaves before its page is sent: nothing. The server's terminal shows no
    traceback, and it goes on answering."""
    import socket
    server = serve_in_thread({"trained": MarkupAnswerer(), "base": MarkupAnswerer()}, [])
    port = server.server_address[1]
    try:
        assert raw_request(port, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.0 400")
        assert raw_request(port, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n").startswith(
            b"HTTP/1.0 414")
        assert raw_request(port, b"GET / HTTP/2.7\r\nHost: 127.0.0.1\r\n\r\n").startswith(
            b"HTTP/1.0 505")
        for _ in range(20):  # ask for the page and leave at once, unread
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).read()
        assert b"<html" in page.lower()
    finally:
        server.shutdown()
    assert "Traceback" not in capfd.readouterr().err


def test_another_sites_page_cannot_make_a_browser_sample():
    """/answer refuses a browser's cross-site request (Sec-Fetch-Site) and a foreign Origin, so a
    page elsewhere cannot spend the machine; the page itself may be opened from any link."""
    server = serve_in_thread({"trained": MarkupAnswerer(), "base": MarkupAnswerer()}, [])
    base = f"http://127.0.0.1:{server.server_address[1]}"
    answer = base + "/answer?model=trained&question=1%2B1"
    try:
        for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                        {"Origin": "http://attacker.example"}, {"Origin": "null"}):
            with pytest.raises(urllib.error.HTTPError, match="403"):
                urllib.request.urlopen(urllib.request.Request(answer, headers=headers), timeout=30)
        ok = {"Sec-Fetch-Site": "same-origin", "Origin": base}
        assert events(urllib.request.Request(answer, headers=ok))[-1][0] == "done"
        page = urllib.request.Request(base + "/", headers={"Sec-Fetch-Site": "cross-site"})
        assert urllib.request.urlopen(page, timeout=30).status == 200
    finally:
        server.shutdown()
