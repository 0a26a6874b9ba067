"""Prompt-cache control over HTTP and kvcli (issue 40): usage that adds up to
the prompt for chat, completions (n > 1, streamed) and responses; cache_control
marks, pin_ttl and prefill_only; /v1/cache with two API-key tenants that never
see or touch each other's pins; per-tenant rows in /metrics; a kvcli cache
round trip."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import BIN_DIR, _stop_checked
from test_http import HttpDaemon

BT = 16  # kvd's default block tokens
ALICE = {"Authorization": "Bearer key-of-alice-0001"}
BOB = {"Authorization": "Bearer key-of-bob-00002"}


def text(tag: str, n: int) -> str:
    return " ".join(f"{tag} rule {i}: the {tag} answer to item {i} cites page {i * 7 % 97}." for i in range(n))


def sums(u: dict[str, Any], prompt_key: str = "prompt_tokens", prompts: int = 1) -> tuple[int, int]:
    """(read, written): they add up with the prompt tokens computed without
    caching (here at most a partial last block per prompt) to the prompt."""
    prompt = u[prompt_key]
    read, written = u["cache_read_input_tokens"], u["cache_creation_input_tokens"]
    details = u.get("prompt_tokens_details") or u.get("input_tokens_details")
    assert details is not None and details["cached_tokens"] == read, u
    assert read % BT == 0 and written % BT == 0, u
    assert 0 <= prompt - read - written < BT * prompts, u
    return read, written


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    d = tmp_path_factory.mktemp("kvd-cache-http")
    keys = d / "keys"
    keys.write_text("key-of-alice-0001 alice\nkey-of-bob-00002 bob\n")
    h = HttpDaemon(d / "kvd", "--kv-memory", "96MiB", "-w", "1", "--api-keys", str(keys))
    h.d.measure_patience()
    yield h
    _stop_checked(h.d)


def call(h: HttpDaemon, method: str, path: str, obj: object | None = None,
         who: dict[str, str] = ALICE) -> tuple[int, Any]:
    status, _, body = h.request(method, path, None if obj is None else json.dumps(obj), headers=who)
    return status, json.loads(body)


def sse(raw: bytes) -> list[Any]:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_usage_adds_up_over_http(keyed: HttpDaemon) -> None:
    chat = [{"role": "system", "content": text("Usage", 20)}, {"role": "user", "content": "Hi."}]
    s, r1 = call(keyed, "POST", "/v1/chat/completions", {"messages": chat, "max_tokens": 2, "temperature": 0,
                                                         "namespace": "usage"})
    assert s == 200, r1
    read, written = sums(r1["usage"])
    assert read == 0 and written == r1["usage"]["prompt_tokens"] // BT * BT and written > 0
    s, r2 = call(keyed, "POST", "/v1/chat/completions", {"messages": chat, "max_tokens": 2, "temperature": 0,
                                                         "namespace": "usage"})
    read, written = sums(r2["usage"])
    assert read == (r2["usage"]["prompt_tokens"] - 1) // BT * BT and read > 0
    assert "cache" not in r2        # only pins and warm-ups report it
    # completions, two prompts and n = 2: each prompt counts once
    prompts = [text("CompA", 6), text("CompB", 7)]
    s, c = call(keyed, "POST", "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 2, "temperature": 0,
                                                   "namespace": "usage"})
    assert s == 200 and len(c["choices"]) == 4, c
    read, written = sums(c["usage"], prompts=2)
    assert read == 0 and written > 0
    s, c2 = call(keyed, "POST", "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 2,
                                                    "temperature": 0, "namespace": "usage"})
    assert c2["usage"]["prompt_tokens"] == c["usage"]["prompt_tokens"]
    read, _ = sums(c2["usage"], prompts=2)
    assert read > 0
    # streamed, with the usage chunk
    s, _, raw = keyed.request("POST", "/v1/chat/completions", json.dumps({
        "messages": chat, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
        "namespace": "usage-stream"}), headers=ALICE)
    assert s == 200
    usage = [e["usage"] for e in sse(raw) if e.get("usage")]
    assert len(usage) == 1
    read, written = sums(usage[0])
    assert read == 0 and written > 0
    # the Responses API
    s, resp = call(keyed, "POST", "/v1/responses", {"input": "Hi.", "instructions": text("Resp", 10),
                                                    "max_output_tokens": 2})
    assert s == 200, resp
    sums(resp["usage"], "input_tokens")
    s, resp = call(keyed, "POST", "/v1/responses", {"input": "Hi.", "instructions": text("Resp", 10),
                                                    "max_output_tokens": 2})
    read, _ = sums(resp["usage"], "input_tokens")
    assert read > 0


def test_fields_refused_by_name(keyed: HttpDaemon) -> None:
    msgs: list[Any] = [{"role": "system", "content": "S", "cache_control": {"type": "persistent"}},
                       {"role": "user", "content": "Hi."}]
    bad: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"messages": msgs}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x",
                                                "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "scope": "all"}}]}]}, "messages"),
        ("/v1/chat/completions", {"messages": [
            {"role": "system", "content": "a", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            {"role": "user", "content": "b", "cache_control": {"type": "ephemeral"}}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x",
                                                "cache_control": {"type": "ephemeral"}}], "pin_ttl": "5m"},
         "pin_ttl"),
        ("/v1/completions", {"prompt": "x", "pin_ttl": "2h"}, "pin_ttl"),
        ("/v1/completions", {"prompt": "x", "pin_ttl": 0}, "pin_ttl"),
        ("/v1/completions", {"prompt": "x", "prefill_only": "yes"}, "prefill_only"),
        ("/v1/responses", {"input": "x", "pin_ttl": "5m"}, "pin_ttl"),
        ("/v1/cache", {"prompt": "x", "max_tokens": 3}, "max_tokens"),
        ("/v1/cache", {"prompt": "x", "ttl": "1d"}, "ttl"),
    ]
    for path, body, param in bad:
        s, e = call(keyed, "POST", path, body)
        assert s == 400 and e["error"]["param"] == param, (path, body, e)
    # kvd's own limit (--pin-max-ttl, default an hour) answers by name too
    s, e = call(keyed, "POST", "/v1/completions", {"prompt": text("Long", 5), "pin_ttl": 7200})
    assert s == 400 and "pin-max-ttl" in e["error"]["message"], e
    assert call(keyed, "DELETE", "/v1/cache")[0] == 405
    assert call(keyed, "GET", "/v1/cache/pin_00/evict")[0] == 405


def test_cache_api_two_tenants(keyed: HttpDaemon) -> None:
    system = text("Tenant", 30)
    msgs: list[Any] = [{"role": "system", "content": [
                            {"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
                       {"role": "user", "content": "What is rule 2?"}]
    # a warm-up over chat: prefill_only, the mark on a content part pins the system prompt
    s, w = call(keyed, "POST", "/v1/chat/completions", {"messages": msgs, "prefill_only": True, "namespace": "t"})
    assert s == 200, w
    assert w["choices"][0]["message"]["content"] == "" and w["usage"]["completion_tokens"] == 0
    entry = w["cache"][0]
    pin = entry["pin"]
    assert pin is not None and pin["ttl_s"] == 3600 and pin["namespace"] == "t", entry
    assert entry["blocks"] * BT == entry["tokens"] == w["usage"]["prompt_tokens"] // BT * BT
    assert pin["tokens"] < w["usage"]["prompt_tokens"] and pin["blocks"] == pin["tokens"] // BT
    sums(w["usage"])
    s, listed = call(keyed, "GET", "/v1/cache")
    assert s == 200 and [p["id"] for p in listed["data"]] == [pin["id"]]
    # bob sees none of it and touches none of it
    s, theirs = call(keyed, "GET", "/v1/cache", who=BOB)
    assert s == 200 and theirs["data"] == []
    assert call(keyed, "DELETE", f"/v1/cache/{pin['id']}", who=BOB)[0] == 404
    assert call(keyed, "POST", f"/v1/cache/{pin['id']}/evict", who=BOB)[0] == 404
    # bob's own pin of the same text is his, under another id
    s, bp = call(keyed, "POST", "/v1/cache", {"messages": msgs, "namespace": "t"}, who=BOB)
    assert s == 200 and bp["pin"]["id"] != pin["id"] and bp["usage"]["cache_read_input_tokens"] == 0, bp
    assert bp["pin"]["ttl_s"] == 3600
    s, listed = call(keyed, "GET", "/v1/cache")
    assert [p["id"] for p in listed["data"]] == [pin["id"]]
    # alice's chat with the same mark renews her pin and reads it from the cache
    s, r = call(keyed, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "namespace": "t"})
    assert s == 200 and r["cache"][0]["pin"]["id"] == pin["id"]
    read, _ = sums(r["usage"])
    assert read >= pin["tokens"]
    s, listed = call(keyed, "GET", "/v1/cache")
    assert listed["data"][0]["hits"] >= 1
    # unpin, then pin the prompt through the endpoint (seconds) and evict it
    s, gone = call(keyed, "DELETE", f"/v1/cache/{pin['id']}")
    assert s == 200 and gone["id"] == pin["id"] and gone["deleted"] is True
    assert call(keyed, "GET", "/v1/cache")[1]["data"] == []
    assert call(keyed, "DELETE", f"/v1/cache/{pin['id']}")[0] == 404
    s, p2 = call(keyed, "POST", "/v1/cache", {"prompt": text("Evict", 12), "ttl": 120, "namespace": "t"})
    assert s == 200 and p2["pin"]["ttl_s"] == 120 and p2["blocks"] * BT >= p2["pin"]["tokens"]
    s, ev = call(keyed, "POST", f"/v1/cache/{p2['pin']['id']}/evict")
    assert s == 200 and ev["evicted_blocks"] == p2["pin"]["blocks"], ev
    s, after = call(keyed, "POST", "/v1/completions", {"prompt": text("Evict", 12), "max_tokens": 1,
                                                       "namespace": "t"})
    assert after["usage"]["cache_read_input_tokens"] == 0
    # the pin_ttl field on completions pins the whole prompt
    s, c = call(keyed, "POST", "/v1/completions", {"prompt": text("Whole", 8), "max_tokens": 0, "pin_ttl": "5m"})
    assert s == 200 and c["cache"][0]["pin"]["ttl_s"] == 300, c
    assert c["cache"][0]["pin"]["tokens"] == (c["usage"]["prompt_tokens"] - 1) // BT * BT
    # /metrics: a tenant's key shows its own rows only
    _, _, raw = keyed.request("GET", "/metrics", headers=BOB)
    rows = {(s.name, s.labels.get("tenant")): s.value for f in text_string_to_metric_families(raw.decode())
            for s in f.samples}
    assert rows[("kvd_tenant_pins", "bob")] == 1
    assert rows[("kvd_tenant_cache_creation_tokens_total", "bob")] >= bp["usage"]["cache_creation_input_tokens"] > 0
    assert not any(t == "alice" for _, t in rows)
    _, _, raw = keyed.request("GET", "/metrics")
    assert "kvd_tenant_pins{" not in raw.decode()
    assert call(keyed, "DELETE", f"/v1/cache/{bp['pin']['id']}", who=BOB)[0] == 200
    assert call(keyed, "DELETE", f"/v1/cache/{c['cache'][0]['pin']['id']}")[0] == 200


def test_kvcli_cache_round_trip(keyed: HttpDaemon, tmp_path: Path) -> None:
    def kvcli(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([str(BIN_DIR / "kvcli"), "-e", keyed.d.endpoint, "--timeout",
                            str(int(keyed.d.patience * 1000)), "cache", *args],
                           capture_output=True, text=True, timeout=keyed.d.patience)
        assert (p.returncode == 0) == ok, (args, p.returncode, p.stdout, p.stderr)
        return p

    msgs = tmp_path / "msgs.json"
    msgs.write_text(json.dumps([{"role": "system", "content": text("Cli", 20)},
                                {"role": "user", "content": "Hi."}]))
    ns = "tenant:carol/cli"
    made = json.loads(kvcli("pin", "--messages-file", str(msgs), "--pin-messages", "1", "--ttl", "1h",
                            "--namespace", ns, "--json").stdout)
    pin = made["pin"]
    assert pin["id"].startswith("pin_") and pin["tenant"] == "carol" and pin["ttl_s"] == 3600
    assert made["usage"]["cached_blocks"] * BT >= pin["tokens"] > 0
    listed = json.loads(kvcli("list", "--namespace", ns, "--json").stdout)
    assert [p["id"] for p in listed] == [pin["id"]]
    assert json.loads(kvcli("list", "--namespace", "tenant:dave", "--json").stdout) == []
    assert pin["id"] in kvcli("list").stdout          # the ipc:// socket naming none sees every pin
    p = kvcli("unpin", "--namespace", "tenant:dave", pin["id"], ok=False)
    assert p.returncode == 1 and "no pin" in p.stderr
    assert pin["id"] in kvcli("unpin", "--namespace", ns, pin["id"]).stdout
    assert json.loads(kvcli("list", "--namespace", ns, "--json").stdout) == []
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text("CliPrompt", 10))
    made = json.loads(kvcli("pin", "--prompt-file", str(prompt), "--ttl", "90", "--namespace", ns,
                            "--json").stdout)
    ev = json.loads(kvcli("evict", "--namespace", ns, "--json", made["pin"]["id"]).stdout)
    assert ev["id"] == made["pin"]["id"] and ev["blocks_evicted"] == made["pin"]["blocks"] > 0
    p = kvcli("pin", "--ttl", "7200", text("TooLong", 5), ok=False)
    assert p.returncode == 1 and "pin-max-ttl" in p.stderr                   # kvd's limit
    assert kvcli("pin", "--ttl", "soon", "x", ok=False).returncode == 2     # a usage error


def test_public_prefix_pins_stay_apart(tmp_path: Path) -> None:
    """Two tenants pinning the operator's shared system prompt (--public-prefix: its blocks are keyed
    alike for everyone) hold two pins: bob's short TTL neither renews nor ends alice's, neither sees
    the other's id, and a pin's hits count its own tenant's requests alone."""
    keys = tmp_path / "keys"
    keys.write_text("key-of-alice-0001 alice\nkey-of-bob-00002 bob\n")
    system = text("Shared", 12)
    (tmp_path / "public").write_text(system)
    h = HttpDaemon(tmp_path / "kvd", "--kv-memory", "64MiB", "-w", "1", "--api-keys", str(keys),
                   "--public-prefix", str(tmp_path / "public"))
    try:
        msgs: list[Any] = [{"role": "system", "content": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                           {"role": "user", "content": "Hello."}]
        s, a = call(h, "POST", "/v1/cache", {"messages": msgs})
        assert s == 200 and a["pin"] is not None, a
        # bob pins the same blocks: the system prompt alone, whole, for a second
        s, b = call(h, "POST", "/v1/cache", {"messages": [{"role": "system", "content": system}], "ttl": 1},
                    who=BOB)
        assert s == 200 and b["pin"] is not None, b
        assert b["pin"]["blocks"] == a["pin"]["blocks"], (a, b)
        assert b["pin"]["id"] != a["pin"]["id"] and b["pin"]["ttl_s"] == 1
        time.sleep(2.5)
        s, listed = call(h, "GET", "/v1/cache")
        assert [(p["id"], p["ttl_s"]) for p in listed["data"]] == [(a["pin"]["id"], 3600)], listed
        s, theirs = call(h, "GET", "/v1/cache", who=BOB)
        assert all(p["id"] != a["pin"]["id"] for p in theirs["data"])
        # bob's chat on the shared prompt is no hit of alice's pin
        s, _ = call(h, "POST", "/v1/chat/completions", {"messages": msgs[:1] + [{"role": "user", "content": "Hi."}],
                                                         "max_tokens": 1}, who=BOB)
        assert s == 200
        s, listed = call(h, "GET", "/v1/cache")
        assert listed["data"][0]["hits"] == 0, listed
    finally:
        _stop_checked(h.d)
