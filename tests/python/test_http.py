"""kvd's OpenAI-compatible HTTP API (kvd --http), driven by the official `openai` package and by
plain HTTP for what that package hides (statuses, headers, malformed bodies), against a real kvd
with the default model."""

from __future__ import annotations

import http.client
import json
import math
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvd_client
from conftest import BIN_DIR, LONG_SYSTEM, MODEL, Daemon, _stop_checked

MODEL_ID = MODEL.name.removesuffix(".gguf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpDaemon:
    def __init__(self, workdir: Path, *args: str, ready: str = "health") -> None:
        self.port = free_port()
        self.d = Daemon(workdir, "--http", f"127.0.0.1:{self.port}", *args, ready=ready)
        self.base = f"http://127.0.0.1:{self.port}"
        self.oai = openai.OpenAI(base_url=self.base + "/v1", api_key="none", timeout=self.d.patience,
                                 max_retries=0)

    def request(self, method: str, path: str, body: bytes | str | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.d.patience)
        try:
            h = {"Content-Type": "application/json"} if body is not None else {}
            h.update(headers or {})
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def post(self, path: str, obj: object) -> tuple[int, dict[str, str], dict[str, Any]]:
        status, headers, body = self.request("POST", path, json.dumps(obj))
        out: dict[str, Any] = json.loads(body)
        return status, headers, out


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    h = HttpDaemon(tmp_path_factory.mktemp("kvd-http"), "--kv-memory", "64MiB", "-w", "1",
                   "--max-body", "1MiB")
    h.d.measure_patience()
    yield h
    _stop_checked(h.d)


CHAT: list[Any] = [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "Name three colours."}]


def test_models_and_probes(api: HttpDaemon) -> None:
    models = api.oai.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    for path in ("/health", "/ready"):
        status, _, body = api.request("GET", path)
        assert status == 200, body
        assert json.loads(body)["status"] == "ok"


def test_chat_greedy_matches_zeromq_and_stream(api: HttpDaemon) -> None:
    r = api.oai.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == MODEL_ID
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u is not None
    assert u.completion_tokens > 0 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None
    assert u.prompt_tokens_details.cached_tokens is not None
    with kvd_client.Client(api.d.endpoint, timeout=api.d.patience) as c:
        z = c.generate(messages=CHAT, max_tokens=16, temperature=0)
    assert text == z.text
    # streamed: the same text, a role first, a final usage chunk with no choices, then [DONE]
    pieces, roles, finish, usage = [], [], None, None
    stream = api.oai.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=16, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        d = chunk.choices[0].delta
        if d.role:
            roles.append(d.role)
        if d.content:
            pieces.append(d.content)
        if chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert roles == ["assistant"]
    assert "".join(pieces) == text
    assert finish == r.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == u.completion_tokens


def test_completions_prompt_forms(api: HttpDaemon) -> None:
    r = api.oai.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=8,
                                   temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    with kvd_client.Client(api.d.endpoint, timeout=api.d.patience) as c:
        z = c.generate("The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text == z.text
    # a list of prompts: one choice each, in order
    r2 = api.oai.completions.create(model=MODEL_ID, prompt=["One, two,", "The capital of France is"],
                                    max_tokens=8, temperature=0)
    assert [c.index for c in r2.choices] == [0, 1]
    assert r2.choices[1].text == z.text
    # token ids
    status, _, body = api.post("/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 4
    # streamed completions give the same text
    text = "".join(c.choices[0].text for c in api.oai.completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
    assert text == z.text


def test_shared_system_prompt_is_cached(api: HttpDaemon) -> None:
    msgs: list[Any] = [{"role": "system", "content": LONG_SYSTEM * 2},
                       {"role": "user", "content": "Topic 3, please."}]
    api.oai.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=2, temperature=0)
    msgs[1]["content"] = "And topic 5?"
    r = api.oai.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=2, temperature=0)
    u = r.usage
    assert u is not None and u.prompt_tokens_details is not None
    cached = u.prompt_tokens_details.cached_tokens
    assert u.prompt_tokens > 1000
    assert cached is not None and cached >= u.prompt_tokens - 48


def test_n_with_seed_is_reproducible_and_stop(api: HttpDaemon) -> None:
    a, b = (api.oai.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=12, temperature=1.0,
                                            seed=7, n=3) for _ in range(2))
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    greedy = api.oai.completions.create(model=MODEL_ID, prompt="One, two, three, four,", max_tokens=12,
                                        temperature=0).choices[0].text
    assert "," in greedy
    cut = api.oai.completions.create(model=MODEL_ID, prompt="One, two, three, four,", max_tokens=12,
                                     temperature=0, stop=[","])
    assert cut.choices[0].text == greedy[:greedy.index(",")]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(api: HttpDaemon) -> None:
    """Chat and completions logprobs: each a probability (their alternatives' mass <= 1), the
    greedy choice the likeliest, the same numbers streamed and not, over HTTP and ZeroMQ."""
    r = api.oai.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0,
                                        logprobs=True, top_logprobs=5)
    ch = r.choices[0]
    assert ch.logprobs is not None and ch.logprobs.content is not None
    content = ch.logprobs.content
    assert r.usage is not None and len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 5
        assert e.logprob <= 0
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-5
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
        assert e.bytes is not None and bytes(e.bytes).decode("utf-8", "replace") == e.token
    joined = b"".join(bytes(e.bytes or []) for e in content).decode("utf-8", "replace")
    assert (ch.message.content or "") in joined     # an end-of-turn token may end it
    # the same over ZeroMQ, token by token
    with kvd_client.Client(api.d.endpoint, timeout=api.d.patience) as c:
        z = c.generate(messages=CHAT, max_tokens=8, temperature=0, logprobs=5)
    assert [lp.logprob for lp in z.logprobs] == [e.logprob for e in content]
    assert [[t.token_id for t in lp.top] for lp in z.logprobs][0][0] == z.token_ids[0]
    assert [lp.token for lp in z.logprobs] == [bytes(e.bytes or []) for e in content]
    # streamed: the same entries, spread over the chunks
    streamed: list[Any] = []
    for chunk in api.oai.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=5, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # without top_logprobs: the chosen token's alone
    r0 = api.oai.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    assert r0.choices[0].logprobs is not None and r0.choices[0].logprobs.content is not None
    assert all(e.top_logprobs == [] for e in r0.choices[0].logprobs.content)
    # completions: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset
    cr = api.oai.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=6,
                                    temperature=0, logprobs=3)
    lp = cr.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert "".join(lp.tokens) == cr.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == x and top[tok] == x
    # sampled: the chosen token's logprob is its own, not necessarily the top one
    rs = api.oai.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=12, temperature=1.5,
                                    seed=3, logprobs=20)
    lps = rs.choices[0].logprobs
    assert lps is not None and lps.token_logprobs is not None and lps.top_logprobs is not None
    assert all(x <= max(top.values()) for x, top in zip(lps.token_logprobs, lps.top_logprobs))
    # out of range and inconsistent
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21})
    error_of(s, b, 400, "top_logprobs")
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2})
    error_of(s, b, 400, "top_logprobs")
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "logprobs": 3})
    error_of(s, b, 400, "logprobs")
    s, _, b = api.post("/v1/completions", {"prompt": "x", "logprobs": 21})
    error_of(s, b, 400, "logprobs")


def error_of(status: int, body: dict[str, Any], want_status: int, param: str | None = None) -> dict[str, Any]:
    assert status == want_status, body
    err: dict[str, Any] = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    return err


def test_bad_requests(api: HttpDaemon) -> None:
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"})
    error_of(s, b, 400, "temperature")
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3})
    error_of(s, b, 400, "max_tokens")
    s, _, b = api.post("/v1/chat/completions", {"messages": "hello"})
    error_of(s, b, 400, "messages")
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "n": 99})
    error_of(s, b, 400, "n")
    s, _, b = api.post("/v1/completions", {"prompt": {"text": "x"}})
    error_of(s, b, 400, "prompt")
    s, _, b = api.post("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT})
    assert error_of(s, b, 404, "model")["code"] == "model_not_found"
    s, _, b = api.post("/v1/nothing", {})
    error_of(s, b, 404)
    s, _, raw = api.request("POST", "/v1/chat/completions", "{not json")
    error_of(s, json.loads(raw), 400)
    s, _, raw = api.request("POST", "/v1/chat/completions", "x" * (2 << 20))
    error_of(s, json.loads(raw), 413)
    s, _, raw = api.request("POST", "/v1/chat/completions", json.dumps({"messages": CHAT}),
                            {"Content-Type": "text/plain"})
    error_of(s, json.loads(raw), 415)
    # a prompt past the context
    s, _, b = api.post("/v1/completions", {"prompt": "word " * 5000, "max_tokens": 4})
    assert error_of(s, b, 400)["code"] == "context_length_exceeded"
    # unknown fields are ignored, as the peers do
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "frequency_penalty_x": 1})
    assert s == 200, b
    # the openai package sees the same as exceptions
    with pytest.raises(openai.BadRequestError):
        api.oai.chat.completions.create(model=MODEL_ID, messages=CHAT, top_p=3)
    # and the server still answers
    assert api.request("GET", "/health")[0] == 200


def test_dropped_stream_frees_its_blocks(api: HttpDaemon) -> None:
    c = http.client.HTTPConnection("127.0.0.1", api.port, timeout=api.d.patience)
    c.request("POST", "/v1/chat/completions", body=json.dumps(
        {"messages": CHAT, "max_tokens": 2000, "temperature": 0, "stream": True,
         "ignore_eos": True}), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    assert r.getheader("Content-Type") == "text/event-stream"
    first = r.readline()
    assert first.startswith(b"data: ")
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    with kvd_client.Client(api.d.endpoint, timeout=api.d.patience) as z:
        deadline = time.monotonic() + api.d.patience
        while time.monotonic() < deadline:
            st = z.stats()
            if st.requests_running == 0 and st.blocks_in_use == 0:
                break
            time.sleep(0.1)
        assert st.requests_running == 0 and st.blocks_in_use == 0


def test_metrics(api: HttpDaemon) -> None:
    def read() -> dict[str, float]:
        s, _, raw = api.request("GET", "/metrics")
        assert s == 200
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(raw.decode()):
            for sample in fam.samples:
                out[sample.name] = sample.value
                if sample.labels.get("code"):
                    out[f'{sample.name}{{code="{sample.labels["code"]}"}}'] = sample.value
        return out
    before = read()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:cache_config_info", "kvd_blocks_free", "kvd_evictions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:request_success_total"):
        assert name in before, name
    api.oai.completions.create(model=MODEL_ID, prompt="Counting: one, two,", max_tokens=5, temperature=0)
    after = read()
    assert after["vllm:generation_tokens_total"] >= before["vllm:generation_tokens_total"] + 5
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert 0.0 <= after["vllm:kv_cache_usage_perc"] <= 1.0
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] >= before["vllm:inter_token_latency_seconds_count"] + 4
    assert after["vllm:e2e_request_latency_seconds_sum"] > before["vllm:e2e_request_latency_seconds_sum"]
    assert after['kvd_http_requests_total{code="200"}'] > before['kvd_http_requests_total{code="200"}']
    # kvcli stats --prometheus prints the same families (kvd's own, without the HTTP layer's)
    out = subprocess.run([str(BIN_DIR / "kvcli"), "-e", api.d.endpoint, "stats", "--prometheus"], check=True,
                         capture_output=True, text=True).stdout
    names = {f.name for f in text_string_to_metric_families(out)}
    _, _, raw = api.request("GET", "/metrics")
    http_layer = {"kvd_http_requests", "kvd_http_connections", "kvd_http_requests_active", "kvd_http_memory_bytes",
                  "kvd_http_timeouts", "kvd_http_clients_gone", "kvd_http_memory_refused", "kvd_http_busy_refused"}
    assert names == {f.name for f in text_string_to_metric_families(raw.decode())} - http_layer


def test_overloaded_is_429_with_retry_after(tmp_path: Path) -> None:
    h = HttpDaemon(tmp_path / "full", "--kv-memory", "16MiB", "-w", "0", "--max-queue", "0", ready="stats")
    try:
        s, headers, b = h.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
        error_of(s, b, 429)
        assert int(headers["retry-after"]) >= 1
        assert h.request("GET", "/ready")[0] == 503     # no worker
        assert h.request("GET", "/health")[0] == 200    # but the loop runs
    finally:
        _stop_checked(h.d)


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def test_bad_http_keeps_serving(api: HttpDaemon) -> None:
    pid = api.d.proc.pid
    api.oai.models.list()
    fds = open_fds(pid)
    # a 100 MB body: 413, read and dropped
    s, _, raw = api.request("POST", "/v1/completions", b"{" + b" " * (100 << 20) + b"}")
    error_of(s, json.loads(raw), 413)
    # invalid UTF-8 in a prompt
    s, _, raw = api.request("POST", "/v1/completions", b'{"prompt": "caf\xe9 \xff", "max_tokens": 2}')
    error_of(s, json.loads(raw), 400)
    # half requests that never finish (slowloris) while a whole one is served
    slow = []
    for i in range(40):
        c = socket.create_connection(("127.0.0.1", api.port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"prompt\"" if i % 2
                  else b"GET /health HTTP/1.1\r\nHost: x\r\n")
        slow.append(c)
    r = api.oai.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].text
    for c in slow:
        c.close()
    # 1,000 connections opened and dropped, some with a partial request
    for i in range(1000):
        c = socket.create_connection(("127.0.0.1", api.port))
        if i % 3 == 0:
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\n")
        c.close()
    assert api.request("GET", "/health")[0] == 200
    # the descriptors come back, and no block is held
    deadline = time.monotonic() + 30
    while open_fds(pid) > fds + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert open_fds(pid) <= fds + 4, f"{open_fds(pid)} descriptors, {fds} before"
    with kvd_client.Client(api.d.endpoint, timeout=api.d.patience) as z:
        st = z.stats()
    assert st.blocks_in_use == 0 and st.requests_running == 0


def test_tokenize_and_detokenize(api: HttpDaemon) -> None:
    text = "The capital of France is Paris. Ünïcödé, too."
    s, _, b = api.post("/tokenize", {"prompt": text})
    assert s == 200, b
    assert b["count"] == len(b["tokens"]) > 5 and b["max_model_len"] == 2048
    r = api.oai.completions.create(model=MODEL_ID, prompt=text, max_tokens=1, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == b["count"]
    s, _, d = api.post("/detokenize", {"tokens": b["tokens"]})
    assert s == 200 and d["prompt"].endswith(text)
    # a chat counts as the chat completion's prompt does
    s, _, c = api.post("/tokenize", {"messages": CHAT})
    chat = api.oai.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=1, temperature=0)
    assert s == 200 and chat.usage is not None and c["count"] == chat.usage.prompt_tokens
    # bad input
    s, _, e = api.post("/detokenize", {"tokens": [1, 10 ** 9]})
    error_of(s, e, 400)
    s, _, e = api.post("/detokenize", {"tokens": "abc"})
    error_of(s, e, 400, "tokens")
    s, _, e = api.post("/tokenize", {"nothing": 1})
    error_of(s, e, 400, "prompt")


def test_api_keys_and_tenants(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nkey-of-alice-0001 alice\nkey-of-bob-00002 bob\n")
    operator = tmp_path / "operator"
    operator.write_text("the-operators-key-0001\n")
    h = HttpDaemon(tmp_path / "keyed", "--kv-memory", "64MiB", "-w", "1", "--api-keys", str(keys),
                   "--operator-key", str(operator))
    try:
        # no key, a wrong key: 401 with the error shape; the probes and /metrics stay open
        s, _, b = h.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
        assert error_of(s, b, 401)["code"] == "invalid_api_key"
        s, _, raw = h.request("GET", "/v1/models", headers={"Authorization": "Bearer key-of-alice-0002"})
        error_of(s, json.loads(raw), 401)
        for path in ("/health", "/ready", "/metrics"):
            assert h.request("GET", path)[0] == 200
        alice = openai.OpenAI(base_url=h.base + "/v1", api_key="key-of-alice-0001", max_retries=0,
                              timeout=h.d.patience)
        bob = openai.OpenAI(base_url=h.base + "/v1", api_key="key-of-bob-00002", max_retries=0,
                            timeout=h.d.patience)
        msgs: list[Any] = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Hi."}]

        def cached(c: openai.OpenAI) -> int:
            r = c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=1, temperature=0)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            return r.usage.prompt_tokens_details.cached_tokens or 0
        assert cached(alice) == 0
        assert cached(alice) > 500          # alice's own prefix
        assert cached(bob) == 0             # never alice's blocks
        assert cached(bob) > 500
        # each key's tenant is counted as kvd's own tenants are, in /metrics too: every row for the
        # operator's key, a tenant's own for its key, none without a key
        _, _, raw = h.request("GET", "/metrics", headers={"Authorization": "Bearer the-operators-key-0001"})
        text = raw.decode()
        for who in ("alice", "bob"):
            assert f'kvd_tenant_requests_total{{tenant="{who}"}} 2' in text, text[-2000:]
            assert f'kvd_tenant_cached_prompt_tokens_total{{tenant="{who}"}} 0' not in text
        _, _, raw = h.request("GET", "/metrics", headers={"Authorization": "Bearer key-of-alice-0001"})
        assert 'tenant="alice"' in raw.decode() and 'tenant="bob"' not in raw.decode()
        _, _, raw = h.request("GET", "/metrics")
        assert "kvd_tenant_" not in raw.decode() and "vllm:num_requests_running" in raw.decode()
    finally:
        _stop_checked(h.d)
