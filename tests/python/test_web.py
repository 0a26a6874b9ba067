"""kvd --http's page (web/, served at /) and its data endpoint GET /pool.

The page is driven in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`) through selenium, against a real kvd. It must load with no
console error, stream a chat answer, and show the pool change after a
shared-prompt request; a screenshot is saved as an artifact under
$KVD_TEST_ARTIFACTS (default build-test/artifacts/). /pool's rules are those of
/metrics: the operator sees every tenant, a tenant its own blocks and prefixes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import LONG_SYSTEM, ROOT, _stop_checked
from test_http import HttpDaemon

ARTIFACTS = Path(os.environ.get("KVD_TEST_ARTIFACTS") or ROOT / "build-test" / "artifacts")
CHROMIUM = os.environ.get("KVD_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = os.environ.get("KVD_CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"


def get_json(h: HttpDaemon, path: str, key: str | None = None) -> tuple[int, Any]:
    status, _, body = h.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else None)
    return status, json.loads(body)


# Said after each question, so that questions that differ fill blocks of their own (a partial last
# block is never cached): the system prompt's chain then branches.
TAIL = " Please answer in a single word, without any explanation, any punctuation or any other remark."


def chat(h: HttpDaemon, question: str, key: str | None = None) -> dict[str, Any]:
    question += TAIL
    status, _, body = h.request(
        "POST", "/v1/chat/completions",
        json.dumps({"messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}],
                    "max_tokens": 2, "temperature": 0}),
        headers={"Authorization": f"Bearer {key}"} if key else None)
    out: dict[str, Any] = json.loads(body)
    assert status == 200, out
    return out


def blocks_by_state(view: dict[str, Any]) -> dict[str, int]:
    n = dict.fromkeys(view["states"], 0)
    for host in view["hosts"]:
        for state, _, cells in host["runs"]:
            n[view["states"][state]] += cells * host["cell_blocks"]
    return n


def test_pool_endpoint_and_assets(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("key-of-alice-0001 alice\nkey-of-bob-00002 bob\n")
    operator = tmp_path / "operator"
    operator.write_text("the-operators-key-0001\n")
    h = HttpDaemon(tmp_path / "keyed", "--kv-memory", "64MiB", "-w", "1", "--api-keys", str(keys),
                   "--operator-key", str(operator))
    try:
        # the page's files are public, with a policy that allows this server only
        for path, ctype in (("/", "text/html"), ("/web/app.js", "text/javascript"), ("/web/app.css", "text/css")):
            status, headers, body = h.request("GET", path)
            assert status == 200 and headers["content-type"].startswith(ctype) and body
            csp = headers["content-security-policy"]
            assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert b'src="/web/app.js"' in h.request("GET", "/")[2]
        assert h.request("POST", "/web/app.js", "{}")[0] == 405
        assert h.request("GET", "/web/nothing.js")[0] == 404
        # the data needs a key: a tenant's or the operator's
        assert get_json(h, "/pool")[0] == 401
        assert get_json(h, "/pool", "key-of-nobody-001")[0] == 401
        for q in ("Name a colour.", "Name a fruit."):
            chat(h, q, "key-of-alice-0001")
        chat(h, "Name a tree.", "key-of-bob-00002")
        # alice: her tree (the system prompt shared by her two requests, hit once), bob's blocks by state alone
        s, a = get_json(h, "/pool", "key-of-alice-0001")
        assert s == 200 and a["viewer"] == "tenant" and a["tenant"] == "alice"
        names = a["tenants"]
        assert names == ["alice"] and a["hidden_tenant"] == 2          # nothing tells how many others
        alice = names.index("alice") + 1
        assert a["prefixes"], a
        roots = [p for p in a["prefixes"] if p["parent"] == -1]
        assert len(roots) == 1 and roots[0]["tenant"] == alice and roots[0]["hits"] >= 1
        assert roots[0]["subtree_blocks"] >= 30 and "Rule 1" in roots[0]["text"]
        # her two questions branch off it
        assert sum(p["parent"] == 0 for p in a["prefixes"]) == 2, a["prefixes"]
        assert all(p["tenant"] == alice for p in a["prefixes"])
        tenants_drawn = {r[1] for host in a["hosts"] for r in host["runs"] if r[0] != 0}
        assert tenants_drawn == {alice, a["hidden_tenant"]}          # bob's blocks: shown, not named
        assert [r["name"] for r in a["tenant_rows"]] == ["alice"]
        # the operator: both tenants' trees
        s, o = get_json(h, "/pool", "the-operators-key-0001")
        assert s == 200 and o["viewer"] == "operator" and {"alice", "bob"} <= set(o["tenants"])
        assert len([p for p in o["prefixes"] if p["parent"] == -1]) == 2
        assert {r["name"] for r in o["tenant_rows"]} == {"alice", "bob"}
        n = blocks_by_state(o)
        assert sum(n.values()) == o["totals"]["blocks_total"] and n["cached"] == o["totals"]["blocks_cached"] > 0
        # the samples: a second each, the last five minutes at most, prompt tokens counted
        time.sleep(1.5)
        s, o = get_json(h, "/pool", "the-operators-key-0001")
        assert 0 < len(o["samples"]) <= 300
        assert sum(x["prompt_tokens"] for x in o["samples"]) == o["totals"]["prompt_tokens"]
        assert sum(x["cached_prompt_tokens"] for x in o["samples"]) == o["totals"]["cached_prompt_tokens"] > 0
    finally:
        _stop_checked(h.d)


def test_pool_bounded(tmp_path: Path) -> None:
    """A pool of more blocks than /pool draws (16,384 cells a host): a cell stands for several
    blocks, and the answer stays small."""
    h = HttpDaemon(tmp_path / "big", "--kv-memory", "160MiB", "--block-tokens", "1", "--kv-type", "q4_0",
                   "-w", "0", ready="stats")
    try:
        status, _, body = h.request("GET", "/pool")
        assert status == 200
        v = json.loads(body)
        host = v["hosts"][0]
        assert host["blocks"] == v["totals"]["blocks_total"] > 16384
        assert host["cell_blocks"] == -(-host["blocks"] // 16384)
        assert sum(r[2] for r in host["runs"]) == -(-host["blocks"] // host["cell_blocks"]) <= 16384
        assert host["runs"] == [[0, 0, sum(r[2] for r in host["runs"])]]     # all free: one run
        assert len(body) < 64 * 1024
    finally:
        _stop_checked(h.d)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium through chromedriver; fails (never skips) where either is missing."""
    for exe in (CHROMIUM, CHROMEDRIVER):
        if not Path(exe).is_file():
            pytest.fail(f"{exe} is missing: install Debian's chromium and chromium-driver "
                        "(scripts/install-deps.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1400,1500", "--no-first-run", "--disable-extensions"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield drv
    finally:
        drv.quit()


def wait_for(what: str, cond: Callable[[], Any], limit: float) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    pytest.fail(f"not within {limit:g} s: {what}")


def console_errors(drv: Any) -> list[str]:
    return [e["message"] for e in drv.get_log("browser") if e["level"] == "SEVERE"]


def test_page_in_browser(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    h = HttpDaemon(tmp_path / "kvd", "--kv-memory", "64MiB", "-w", "1")
    try:
        h.d.measure_patience()
        drv = browser

        def attr(css: str, name: str) -> str | None:
            els = drv.find_elements(By.CSS_SELECTOR, css)
            return els[0].get_attribute(name) if els else None

        def polls() -> int:
            return int(attr("body", "data-polls") or 0)

        drv.get(h.base + "/")
        wait_for("the page drew the pool", lambda: polls() >= 1, h.d.patience)
        assert drv.title == "kvd"
        assert drv.find_element(By.ID, "status").text == "live"
        assert attr("#hosts .host", "data-cached") == "0"
        assert "nothing cached yet" in drv.find_element(By.ID, "prefix-tree").text
        canvas_before = drv.execute_script("return document.querySelector('#hosts canvas').toDataURL()")

        def ask(question: str) -> Any:
            n = len(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
            drv.find_element(By.ID, "chat-new").click()
            system = drv.find_element(By.ID, "chat-system")
            if not system.get_attribute("value"):
                drv.execute_script("arguments[0].value = arguments[1]", system, LONG_SYSTEM)
            drv.find_element(By.ID, "chat-input").send_keys(question + TAIL)
            drv.find_element(By.ID, "chat-send").click()
            msg = wait_for("an answer", lambda: [m for m in drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")
                                                 if m.get_attribute("data-done")], h.d.patience)
            assert n == 0 or len(msg) == 1, "New chat clears the log"
            return msg[-1]

        # a chat message streams its answer: chunk after chunk, then the usage
        first = ask("Name a colour.")
        assert int(first.get_attribute("data-chunks")) >= 2 and first.text.strip()
        usage = drv.find_element(By.ID, "usage")
        assert int(usage.get_attribute("data-prompt")) > 500 and usage.get_attribute("data-cached") == "0"
        assert int(usage.get_attribute("data-completion")) >= 2
        # the same system prompt again: served from the cache, and the page says so
        ask("Name a fruit.")
        assert int(usage.get_attribute("data-cached")) > 500
        assert "from the cache" in usage.text

        # the pool picture changes: cached blocks appear, and the system prompt's tree is shared (hit)
        def shared_tree() -> bool:
            cached = int(attr("#hosts .host", "data-cached") or 0)
            roots = drv.find_elements(By.CSS_SELECTOR, "#prefix-tree > li.prefix")
            return cached >= 30 and bool(roots) and int(roots[0].get_attribute("data-hits")) >= 1 and \
                len(roots[0].find_elements(By.CSS_SELECTOR, "li.prefix")) == 2
        wait_for("cached, shared blocks in the picture", shared_tree, h.d.patience)
        root = drv.find_element(By.CSS_SELECTOR, "#prefix-tree > li.prefix")
        assert "Rule 1" in root.text and "1 hits" in root.text
        assert drv.execute_script("return document.querySelector('#hosts canvas').toDataURL()") != canvas_before
        hit_curve = drv.execute_script(
            "const c = document.getElementById('curve-hit').getContext('2d');"
            "return Array.from(c.getImageData(0, 0, 480, 90).data).some((v, i) => i % 4 == 3 && v > 0)")
        assert hit_curve, "the hit rate's curve is drawn"

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "web-page.png"
        assert drv.save_screenshot(str(shot)) and shot.stat().st_size > 10000
        errors = console_errors(drv)
        assert not errors, errors
    finally:
        _stop_checked(h.d)
