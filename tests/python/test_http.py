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

import jinja2
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
    # an unknown field is refused, naming it (nothing is silently ignored)
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "frequency_penalty_x": 1})
    assert "frequency_penalty_x" in error_of(s, b, 400, "frequency_penalty_x")["message"]
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
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\"" if i % 2
                  else b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
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
    s, _, e = api.post("/tokenize", {})
    error_of(s, e, 400, "prompt")
    # vLLM's fields: add_special_tokens (a prompt's BOS, where the model adds one), the neutral values
    # of the rest; any other field is refused by name
    s, _, n = api.post("/tokenize", {"prompt": text, "add_special_tokens": False, "model": MODEL_ID,
                                     "return_token_strs": False, "mm_processor_kwargs": None})
    assert s == 200 and n["tokens"] == b["tokens"] and n["token_strs"] is None    # SmolLM2 adds no BOS
    s, _, n = api.post("/tokenize", {"messages": CHAT, "add_generation_prompt": True, "add_special_tokens": False,
                                     "continue_final_message": False})
    assert s == 200 and n["tokens"] == c["tokens"]
    for body, param in [({"nothing": 1, "prompt": "x"}, "nothing"),
                        ({"prompt": "x", "return_token_strs": True}, "return_token_strs"),
                        ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
                        ({"prompt": "x", "messages": CHAT}, "prompt"),
                        ({"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
                        ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
                        ({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
                        ({"messages": CHAT, "chat_template": "{{ x }}"}, "chat_template")]:
        s, _, e = api.post("/tokenize", body)
        error_of(s, e, 400, param)
    s, _, e = api.post("/detokenize", {"tokens": [1], "prompt": "x"})
    error_of(s, e, 400, "prompt")
    s, _, e = api.post("/tokenize", {"prompt": "x", "model": "other"})
    error_of(s, e, 404, "model")


def test_tokenizer_info(api: HttpDaemon) -> None:
    s, _, body = api.request("GET", "/tokenizer_info")
    info = json.loads(body)
    assert s == 200, info
    # SmolLM2's GGUF: a GPT-2 BPE of 49,152 tokens, ChatML's specials, no BOS put before a prompt
    assert info["tokenizer_class"] == "GPT2TokenizerFast" and info["vocab_size"] == 49152
    s, _, t = api.post("/tokenize", {"prompt": "x"})
    assert info["model_max_length"] == t["max_model_len"] > 0       # kvd's context
    assert info["add_bos_token"] is False and info["add_eos_token"] is False
    for name in ("bos", "eos", "pad", "unk"):
        tok, tid = info[f"{name}_token"], info[f"{name}_token_id"]
        assert isinstance(tok, str) and info["added_tokens_decoder"][str(tid)]["content"] == tok
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    s, _, d = api.post("/detokenize", {"tokens": [info["eos_token_id"]]})
    assert s == 200 and d["prompt"] == "<|im_end|>"
    # the GGUF's Jinja template, which renders the chat as kvd does
    assert "<|im_start|>" in info["chat_template"] and "add_generation_prompt" in info["chat_template"]
    text = jinja2.Environment().from_string(info["chat_template"]).render(messages=CHAT, add_generation_prompt=True)
    s, _, want = api.post("/tokenize", {"messages": CHAT})
    s, _, got = api.post("/detokenize", {"tokens": want["tokens"]})
    assert got["prompt"] == text
    assert all(v["special"] for v in info["added_tokens_decoder"].values())
    s, _, _ = api.request("POST", "/tokenizer_info", "{}")
    assert s == 405


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


def test_fields_kvd_does_not_serve_are_refused_by_name(api: HttpDaemon) -> None:
    # a value that asks for something kvd does not do: a 400 naming the field
    refused: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),
        ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "regex", "regex": "a+"}},
         "response_format"),
        ("/v1/chat/completions", {"messages": CHAT, "store": True}, "store"),
        ("/v1/chat/completions", {"messages": CHAT, "service_tier": "flex"}, "service_tier"),
        ("/v1/chat/completions", {"messages": CHAT, "prompt": "x"}, "prompt"),     # completions' field
        ("/v1/completions", {"prompt": "x", "messages": CHAT}, "messages"),        # chat's field
        ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),       # completions' only
        ("/v1/chat/completions", {"messages": CHAT, "stream": True,
                                  "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ]
    for path, body, field in refused:
        s, _, b = api.post(path, body)
        err = error_of(s, b, 400, field)
        assert field in err["message"], (body, err)
    # a message's field kvd does not render
    s, _, b = api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]})
    assert "'name'" in error_of(s, b, 400, "messages")["message"]
    s, _, b = api.post("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "citations": [{"url": "x"}]}]}]})
    assert "'citations'" in error_of(s, b, 400, "messages")["message"]     # (cache_control: test_cache_http.py)
    # the values that ask for nothing are what clients send by default: served
    for body in ({"echo": False, "best_of": 1, "suffix": None, "logit_bias": {}},
                 {"presence_penalty": 0, "frequency_penalty": 0.0}):
        s, _, b = api.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, **body})
        assert s == 200, b
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "tools": [],
                                                "tool_choice": "none", "response_format": {"type": "text"},
                                                "service_tier": "auto", "store": False, "user": "u1",
                                                "parallel_tool_calls": False})
    assert s == 200, b


def test_logit_bias_and_penalties_take_effect(api: HttpDaemon) -> None:
    def greedy(prompt: str, **kw: Any) -> dict[str, Any]:
        s, _, b = api.post("/v1/completions", {"prompt": prompt, "temperature": 0, "logprobs": 0, **kw})
        assert s == 200, b
        choice: dict[str, Any] = b["choices"][0]
        return choice
    paris = greedy("The capital of France is", max_tokens=1)
    s, _, tok = api.post("/tokenize", {"prompt": paris["text"]})
    assert s == 200 and len(tok["tokens"]) == 1, tok
    pid = tok["tokens"][0]
    # -100 on the greedy token: another one; +100 on a token: that one
    other = greedy("The capital of France is", max_tokens=1, logit_bias={str(pid): -100})
    assert other["text"] != paris["text"]
    s, _, tok = api.post("/tokenize", {"prompt": " banana"})
    forced = greedy("The capital of France is", max_tokens=1, logit_bias={str(tok["tokens"][-1]): 100})
    assert forced["text"] == " banana"
    # the openai package's own argument (the same through the SDK)
    r = api.oai.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=1,
                                   temperature=0, logit_bias={str(pid): -100})
    assert r.choices[0].text == other["text"]
    # frequency and presence penalties: a repetitive greedy continuation repeats less
    base = greedy("one one one one one one", max_tokens=24)
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        pen = greedy("one one one one one one", max_tokens=24, **kw)
        assert pen["text"] != base["text"], kw
        toks = pen["logprobs"]["tokens"]
        assert len(set(toks)) > len(set(base["logprobs"]["tokens"])), (kw, toks)
    # negative values encourage repeats: no fewer repeated tokens than without
    neg = greedy("one one one one one one", max_tokens=24, frequency_penalty=-2.0)
    assert len(set(neg["logprobs"]["tokens"])) <= len(set(base["logprobs"]["tokens"]))
    # refused: out of range, ids past the vocabulary, keys that are not ids
    for bad_body, field in (({"presence_penalty": 2.5}, "presence_penalty"),
                            ({"frequency_penalty": -3}, "frequency_penalty"),
                            ({"logit_bias": {"abc": 1}}, "logit_bias"),
                            ({"logit_bias": {"5": 101}}, "logit_bias"),
                            ({"logit_bias": {"7": 1, "07": 2}}, "logit_bias")):
        s, _, b = api.post("/v1/completions", {"prompt": "x", "max_tokens": 1, **bad_body})
        error_of(s, b, 400, field)
    s, _, b = api.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "logit_bias": {"999999": 1}})
    assert "999999" in error_of(s, b, 400)["message"]


def test_model_by_id(api: HttpDaemon) -> None:
    m = api.oai.models.retrieve(MODEL_ID)
    assert m.id == MODEL_ID and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        api.oai.models.retrieve("gpt-4")
    s, _, raw = api.request("GET", "/v1/models/gpt-4")
    assert json.loads(raw)["error"]["code"] == "model_not_found" and s == 404


def test_max_tokens_inside_a_character_ends_with_whole_characters(api: HttpDaemon) -> None:
    # "猫" is three byte tokens in this vocabulary; forcing its first one as
    # the only output token cuts the character short: the text leaves it out
    # (it ended in U+FFFD before), the token ids keep it
    s, _, tok = api.post("/tokenize", {"prompt": "猫"})
    assert s == 200 and len(tok["tokens"]) == 3, tok
    lead = tok["tokens"][0]
    body = {"prompt": "Cat:", "max_tokens": 1, "temperature": 0, "logit_bias": {str(lead): 100}}
    s, _, b = api.post("/v1/completions", body)
    assert s == 200, b
    assert b["choices"][0]["text"] == "" and b["usage"]["completion_tokens"] == 1, b
    s, _, raw = api.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
    assert s == 200
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in raw.decode().splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert text == "" and "\ufffd" not in raw.decode()


def test_echo_and_prompt_logprobs_score_the_prompt(api: HttpDaemon) -> None:
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    s, _, tok = api.post("/tokenize", {"prompt": text})
    ids = tok["tokens"]
    # echo with max_tokens 0: the prompt alone, scored (the first token has none)
    r = api.oai.completions.create(model=MODEL_ID, prompt=text, max_tokens=0, echo=True, logprobs=2)
    ch = r.choices[0]
    assert r.usage is not None
    assert ch.text == text and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = ch.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None
    assert "".join(lp.tokens) == text and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scores = lp.token_logprobs[1:]
    assert all(x is not None and x <= 0 for x in scores)
    assert all(t is not None and len(t) >= 1 for t in lp.top_logprobs[1:])
    # each score is the logprob kvd gives that token when it generates it
    # after the tokens before it (forced by a +100 bias; logprobs are of the
    # raw logits), bit for bit: a prefill's logits do not depend on its chunking
    for i in (1, 4, len(ids) - 1):
        s, _, b = api.post("/v1/completions", {"prompt": ids[:i], "max_tokens": 1, "logprobs": 0,
                                               "logit_bias": {str(ids[i]): 100}, "temperature": 0})
        assert s == 200, b
        assert b["choices"][0]["logprobs"]["token_logprobs"][0] == scores[i - 1], i
    # echo with generation: the prompt, then the output, and their logprobs in order
    s, _, b = api.post("/v1/completions", {"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 0,
                                           "temperature": 0})
    assert s == 200, b
    c = b["choices"][0]
    assert c["text"].startswith(text) and len(c["logprobs"]["tokens"]) == len(ids) + 3
    assert c["logprobs"]["token_logprobs"][1:len(ids)] == scores
    # echo alone (no logprobs), streamed too: the prompt comes first
    s, _, b = api.post("/v1/completions", {"prompt": text, "max_tokens": 2, "echo": True, "temperature": 0})
    assert s == 200 and b["choices"][0]["text"].startswith(text) and b["choices"][0]["logprobs"] is None
    st, _, raw = api.request("POST", "/v1/completions", json.dumps({"prompt": text, "max_tokens": 2, "echo": True,
                                                                     "temperature": 0, "stream": True}))
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert st == 200 and events[0]["choices"][0]["text"] == text
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == b["choices"][0]["text"]
    # vLLM's prompt_logprobs: per position, the prompt's token with its rank and the likeliest ones
    s, _, b = api.post("/v1/completions", {"prompt": text, "max_tokens": 1, "prompt_logprobs": 3})
    assert s == 200, b
    plp = b["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        entry = plp[i][str(ids[i])]
        assert entry["logprob"] == scores[i - 1] and entry["rank"] >= 1
        assert {1, 2, 3} <= {v["rank"] for v in plp[i].values()} and len(plp[i]) <= 4
    # streaming cannot carry the prompt's scores: refused by name
    for body, field in (({"prompt_logprobs": 1}, "prompt_logprobs"), ({"echo": True, "logprobs": 1}, "echo")):
        s, _, b = api.post("/v1/completions", {"prompt": text, "stream": True, **body})
        error_of(s, b, 400, field)


def test_scored_prompts_are_computed_and_fill_the_cache(api: HttpDaemon) -> None:
    # a long prompt (whole KV blocks) scored twice: the second time the cache
    # holds it, yet its positions are computed again and score the same; what
    # a scored request computes serves a later plain request from the cache
    text = LONG_SYSTEM + " Scored once, then twice."
    body = {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0, "namespace": "scoring"}
    s, _, a = api.post("/v1/completions", body)
    assert s == 200, a
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    s, _, plain = api.post("/v1/completions", {"prompt": text, "max_tokens": 1, "namespace": "scoring"})
    assert s == 200 and plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 500, plain
    s, _, b2 = api.post("/v1/completions", body)
    assert s == 200 and b2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b2["choices"][0]["logprobs"]["token_logprobs"] == a["choices"][0]["logprobs"]["token_logprobs"]
    # max_tokens 0 alone: the prompt is computed into the cache (a warm-up), nothing generated
    warm = LONG_SYSTEM + " Warmed up ahead of time."
    s, _, w = api.post("/v1/completions", {"prompt": warm, "max_tokens": 0, "namespace": "scoring"})
    assert s == 200 and w["choices"][0]["text"] == "" and w["usage"]["completion_tokens"] == 0
    s, _, after = api.post("/v1/completions", {"prompt": warm, "max_tokens": 1, "namespace": "scoring"})
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] > 500, after


def test_responses_api(api: HttpDaemon) -> None:
    # whole: a chat turn, instructions as its system message, usage with cached tokens
    r = api.oai.responses.create(model=MODEL_ID, input="Name three colours.", instructions="Answer briefly.",
                                 max_output_tokens=12, temperature=0)
    chat = api.oai.chat.completions.create(model=MODEL_ID, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colours."}])
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    # streamed: the Responses events, the same text as whole
    with api.oai.responses.stream(model=MODEL_ID, input="Name three colours.", instructions="Answer briefly.",
                                  max_output_tokens=12, temperature=0) as s:
        types = [e.type for e in s]
        final = s.get_final_response()
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert "response.output_text.delta" in types and types[-1] == "response.completed"
    assert final.output_text == r.output_text
    # previous_response_id: the stored turns come first, and hit the prefix cache
    first = api.oai.responses.create(model=MODEL_ID, max_output_tokens=8, temperature=0, input=[
        {"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "What is rule 3?"}])
    second = api.oai.responses.create(model=MODEL_ID, previous_response_id=first.id, input="And rule 4?",
                                      max_output_tokens=8, temperature=0)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 500
    # store=false: nothing to continue from
    gone = api.oai.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        api.oai.responses.create(model=MODEL_ID, input="Hi", previous_response_id=gone.id, max_output_tokens=2)
    # what kvd does not do is refused by name
    for kw, field in (({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
                      ({"reasoning": {"effort": "high"}}, "reasoning"),
                      ({"text": {"format": {"type": "grammar"}}}, "text"),
                      ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input")):
        body: dict[str, Any] = {"model": MODEL_ID, "input": "x", **kw}
        s2, _, b = api.post("/v1/responses", body)
        error_of(s2, b, 400, field)
    s2, _, b = api.post("/v1/responses", {"input": "x", "frequency_penalty_x": 1})
    error_of(s2, b, 400, "frequency_penalty_x")


def test_responses_are_each_tenants_own(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("key-alice-0001 alice\nkey-bob-0002 bob\n")
    h = HttpDaemon(tmp_path / "kvd", "--kv-memory", "64MiB", "-w", "1", "--api-keys", str(keys))
    try:
        alice = openai.OpenAI(base_url=h.base + "/v1", api_key="key-alice-0001", max_retries=0)
        bob = openai.OpenAI(base_url=h.base + "/v1", api_key="key-bob-0002", max_retries=0)
        r = alice.responses.create(model=MODEL_ID, input="ALICE-SECRET: the merger.", max_output_tokens=2)
        assert alice.responses.create(model=MODEL_ID, input="Go on.", previous_response_id=r.id,
                                      max_output_tokens=2).status in ("completed", "incomplete")
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model=MODEL_ID, input="Go on.", previous_response_id=r.id, max_output_tokens=2)
    finally:
        _stop_checked(h.d)



def test_structured_output(api: HttpDaemon) -> None:
    from typing import Annotated, Literal

    import jsonschema  # type: ignore[import-untyped]
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: Annotated[str, Field(max_length=24)]
        population: int

    class Country(BaseModel):
        name: Annotated[str, Field(max_length=24)]
        continent: Literal["Europe", "Asia", "Africa", "Americas", "Oceania"]
        cities: Annotated[list[City], Field(max_length=2)]

    class Atlas(BaseModel):
        title: Annotated[str, Field(max_length=24)]
        countries: Annotated[list[Country], Field(min_length=1, max_length=2)]
        capital: City | None = None

    # the openai package's parse(): the schema of a pydantic model, the output parsed back into it
    for model, ask in ((City, "Describe Paris."), (Country, "Describe France."), (Atlas, "An atlas of Europe.")):
        p = api.oai.with_options(timeout=900).chat.completions.parse(
            model=MODEL_ID, messages=[{"role": "user", "content": ask + " As JSON."}], response_format=model,
            max_tokens=400, temperature=0)
        assert p.choices[0].finish_reason == "stop", p.choices[0].message.content
        assert isinstance(p.choices[0].message.parsed, model)
    # 50 sampled generations against a nested schema: every one parses and validates (a
    # bounded wait far above what they take, for slow paths on busy machines)
    schema = Country.model_json_schema()
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "Country", "schema": schema, "strict": True}}
    outputs = []
    slow = api.oai.with_options(timeout=1800)
    for seed in range(5):
        r = slow.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "A country, as JSON."}],
                                         response_format=fmt, max_tokens=300, temperature=1.0, seed=seed, n=10)
        outputs += [(c.finish_reason, c.message.content) for c in r.choices]
    assert len(outputs) == 50
    for finish, text in outputs:
        assert finish == "stop" and text is not None, text
        jsonschema.validate(json.loads(text), schema)
    # json_object: any JSON object; streamed the same as whole
    body = {"messages": [{"role": "user", "content": "Some facts about cats as JSON."}], "max_tokens": 200,
            "temperature": 0, "response_format": {"type": "json_object"}}
    s, _, b = api.post("/v1/chat/completions", body)
    assert s == 200, b
    # a JSON object however it ends (an object's strings have no bound: max_tokens may cut one)
    content, finish = b["choices"][0]["message"]["content"], b["choices"][0]["finish_reason"]
    assert content.startswith("{"), content
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    st, _, raw = api.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}))
    streamed = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in raw.decode().splitlines() if line.startswith("data: {")
                       and json.loads(line[6:])["choices"])
    assert st == 200 and streamed == b["choices"][0]["message"]["content"]
    # the Responses API's text.format, through the package's parse()
    rr = api.oai.responses.parse(model=MODEL_ID, input="Describe Japan.", text_format=Country,
                                 max_output_tokens=400, temperature=0)
    assert isinstance(rr.output_parsed, Country)
    # a schema outside the subset: a 400 naming the construct
    bad_fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "patternProperties": {"^a": {"type": "string"}}}}}
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "response_format": bad_fmt})
    assert "patternProperties" in error_of(s, b, 400)["message"]
    s, _, b = api.post("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"},
                                                "ignore_eos": True})
    error_of(s, b, 400)
