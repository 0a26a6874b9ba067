"""Client against a real kvd: whole and streamed generates, the same as
kvcli's, the prefix cache showing in the usage, cancelling."""

from __future__ import annotations

import json
import math
import subprocess
import time

import pytest

from conftest import BIN_DIR, LONG_SYSTEM, Daemon, _stop_checked

import kvd_client
from kvd_client import Client, FinishReason

QUESTION = "Name three primary colors."


def greedy(namespace: str) -> dict[str, object]:
    return dict(
        messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0,
        namespace=namespace,
    )


def kvcli_json(d: Daemon, *args: str) -> dict[str, object]:
    out = subprocess.run(
        [str(BIN_DIR / "kvcli"), "-e", d.endpoint, "--timeout", str(int(d.patience * 1000)),
         "generate", *args],
        check=True, capture_output=True, timeout=2 * d.patience,
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_health_and_stats(client: Client) -> None:
    h = client.health()
    assert h.ok and h.workers_alive == 1 and h.model.endswith(".gguf")
    s = client.stats()
    assert s.blocks_total > 0 and s.block_tokens == 16 and s.block_bytes > 0
    assert s.blocks_free + s.blocks_cached + s.blocks_in_use + s.blocks_pending <= s.blocks_total
    assert len(s.workers) == 1 and s.workers[0].alive and s.workers[0].pid > 0


def test_generate_equals_stream_equals_kvcli(kvd: Daemon, client: Client, namespace: str) -> None:
    whole = client.generate(**greedy(namespace))  # type: ignore[arg-type]
    assert whole.text and whole.token_ids
    assert whole.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert whole.usage.completion_tokens == len(whole.token_ids)
    assert whole.usage.prompt_tokens > 0
    assert whole.chunks >= 1

    with client.stream(**greedy(namespace)) as s:  # type: ignore[arg-type]
        chunks = list(s)
    r = s.result
    assert r is not None
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text for c in chunks) == r.text
    assert [t for c in chunks for t in c.token_ids] == r.token_ids
    assert r.chunks == len(chunks)
    assert (r.text, r.token_ids, r.finish_reason) == (
        whole.text, whole.token_ids, whole.finish_reason)
    assert r.usage.prompt_tokens == whole.usage.prompt_tokens
    assert r.request_id == s.request_id != whole.request_id

    ref = kvcli_json(kvd, "--chat", "-n", "24", "--temp", "0", "--namespace", namespace,
                     "--json", QUESTION)
    assert ref["text"] == whole.text
    assert ref["tokens"] == whole.token_ids
    assert ref["finish_reason"] == whole.finish_reason.value
    usage = ref["usage"]
    assert isinstance(usage, dict)
    assert usage["prompt_tokens"] == whole.usage.prompt_tokens
    assert usage["completion_tokens"] == whole.usage.completion_tokens
    # the same fields as kvcli --json, in the same order
    assert list(whole.to_dict()) == list(ref)
    assert list(whole.to_dict()["usage"]) == list(usage)
    assert isinstance(ref["timings"], dict)
    assert list(whole.to_dict()["timings"]) == list(ref["timings"])


def test_logprobs_client_and_kvcli(kvd: Daemon, client: Client, namespace: str) -> None:
    r = client.generate(**greedy(namespace), logprobs=3)  # type: ignore[arg-type]
    assert len(r.logprobs) == len(r.token_ids) > 0
    for t, lp in zip(r.token_ids, r.logprobs):
        assert [x.token_id for x in lp.top][0] == t and lp.top[0].logprob == lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0].token == lp.token
        assert sum(math.exp(x.logprob) for x in lp.top) <= 1 + 1e-5
    # text of the tokens: the output's bytes (an end-of-generation token's own text after them)
    assert b"".join(lp.token for lp in r.logprobs).decode("utf-8", "replace").startswith(r.text)
    # without logprobs, none
    assert client.generate(**greedy(namespace)).logprobs == []  # type: ignore[arg-type]
    ref = kvcli_json(kvd, "--chat", "-n", "24", "--temp", "0", "--namespace", namespace,
                     "--logprobs", "3", "--json", QUESTION)
    assert ref["tokens"] == r.token_ids
    assert ref["logprobs"] == r.to_dict()["logprobs"]
    with pytest.raises(kvd_client.BadRequest):
        client.generate("x", logprobs=21)


def test_prompt_and_token_ids_forms(client: Client, namespace: str) -> None:
    a = client.generate("The capital of France is", max_tokens=8, temperature=0,
                        namespace=namespace)
    assert a.finish_reason == FinishReason.LENGTH and len(a.token_ids) == 8
    # the same output, continuing the prompt's own tokens given as ids
    b = client.generate(token_ids=a.token_ids[:4], max_tokens=4, temperature=0,
                        namespace=namespace)
    assert b.usage.prompt_tokens == 4
    stopped = client.generate("The capital of France is", max_tokens=8, temperature=0,
                              namespace=namespace, stop=a.text[3:6])
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.text == a.text[:3]


def test_cached_prompt_tokens_grow(client: Client, namespace: str) -> None:
    def ask(question: str) -> kvd_client.Result:
        return client.generate(
            messages=[{"role": "system", "content": LONG_SYSTEM},
                      {"role": "user", "content": question}],
            max_tokens=4, temperature=0, namespace=namespace,
        )

    before = client.stats()
    first = ask("What is topic 3 about?")
    assert first.usage.prompt_tokens >= 600, "the system prompt should be long"
    assert first.usage.cached_prompt_tokens == 0  # a namespace of its own: nothing cached yet
    second = ask("And topic 17?")
    assert second.usage.cached_prompt_tokens > first.usage.cached_prompt_tokens
    # every full block of the shared system prompt came from the cache
    assert second.usage.cached_prompt_tokens >= first.usage.prompt_tokens - 32
    after = client.stats()
    assert after.cached_prompt_tokens - before.cached_prompt_tokens >= (
        second.usage.cached_prompt_tokens)


def _wait_idle(client: Client) -> kvd_client.Stats:
    """The stats once kvd holds nothing for any request (or after the
    client's timeout: an upper bound)."""
    deadline = time.monotonic() + client.timeout
    while True:
        s = client.stats()
        if (s.requests_running, s.blocks_in_use, s.blocks_pending) == (0, 0, 0):
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def long_stream(client: Client) -> kvd_client.Stream:
    return client.stream("Count from one to a thousand: one, two, three,", max_tokens=400,
                         temperature=0, ignore_eos=True, no_cache=True)


def test_cancel_mid_stream_frees_the_request(client: Client) -> None:
    s = long_stream(client)
    got = []
    for chunk in s:
        got.append(chunk)
        if len(got) == 3:
            running = client.stats()
            assert running.requests_running == 1
            assert running.blocks_in_use + running.blocks_pending > 0
            client.cancel(s.request_id)
    r = s.result
    assert r is not None
    assert r.finish_reason == FinishReason.CANCELLED
    assert 3 <= r.usage.completion_tokens < 400
    assert r.text == "".join(c.text for c in got)
    # the Final comes after kvd let go of the sequence: nothing is left running
    st = client.stats()
    assert (st.requests_running, st.requests_queued) == (0, 0)
    assert st.blocks_in_use == 0 and st.blocks_pending == 0
    assert all(w.running == 0 for w in st.workers)
    # it is gone: a second cancel finds nothing
    try:
        client.cancel(s.request_id)
    except kvd_client.NotFound as e:
        assert e.code == kvd_client.kvd_pb2.ERR_NOT_FOUND
    else:
        raise AssertionError("cancelling a finished request should raise NotFound")


def test_leaving_a_stream_cancels_it(client: Client) -> None:
    with long_stream(client) as s:
        next(s)
        next(s)
    assert s.result is not None and s.result.finish_reason == FinishReason.CANCELLED
    st = client.stats()
    assert (st.requests_running, st.blocks_in_use, st.blocks_pending) == (0, 0, 0)

    # breaking out of a for loop over a stream nobody holds cancels it too
    for _ in long_stream(client):
        break
    st = _wait_idle(client)
    assert (st.requests_running, st.blocks_in_use, st.blocks_pending) == (0, 0, 0)

    # and so does close()
    s = long_stream(client)
    next(s)
    s.close()
    assert s.result is not None and s.result.finish_reason == FinishReason.CANCELLED
    assert list(s) == []


def test_other_requests_while_a_stream_is_open(client: Client, namespace: str) -> None:
    """Replies go to the request they answer, whatever the order of reading."""
    a = client.stream("One, two, three,", max_tokens=12, temperature=0, namespace=namespace)
    b = client.stream("Red, green,", max_tokens=12, temperature=0, namespace=namespace)
    first_a = next(a)
    assert client.health().ok
    got_b = list(b)
    got_a = [first_a, *a]
    assert a.result is not None and b.result is not None
    assert "".join(c.text for c in got_a) == a.result.text
    assert "".join(c.text for c in got_b) == b.result.text
    alone = client.generate("Red, green,", max_tokens=12, temperature=0, namespace=namespace)
    assert alone.token_ids == b.result.token_ids


def test_tokenize_and_detokenize(client: Client) -> None:
    text = "Tokens of a prompt, and back."
    ids = client.tokenize(text)
    r = client.generate(text, max_tokens=1, temperature=0)
    assert len(ids) == r.usage.prompt_tokens
    assert client.detokenize(ids).endswith(text)
    chat = [{"role": "user", "content": "Hello there."}]
    assert len(client.tokenize(messages=chat)) == client.generate(
        messages=chat, max_tokens=1, temperature=0).usage.prompt_tokens
    with pytest.raises(kvd_client.BadRequest):
        client.detokenize([10 ** 9])
    with pytest.raises(kvd_client.BadRequest):
        client.tokenize()


def test_output_text_is_always_valid_utf8(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A model that emits byte tokens at random (kvd-mkmodel's, random weights)
    makes byte sequences that are no UTF-8: kvd sends U+FFFD for each byte that
    starts no character, streamed and whole alike, and the ids stay exact."""
    model = tmp_path / "random.gguf"
    subprocess.run([str(BIN_DIR / "kvd-mkmodel"), "-o", str(model), "--layers", "2", "--embd", "64",
                    "--heads", "2", "--kv-heads", "1", "--ff", "128", "--vocab", "600", "--ctx", "512",
                    "--seed", "5"], check=True, capture_output=True)
    d = Daemon(tmp_path / "kvd", "--model", str(model), "--kv-memory", "8MiB", "-w", "1", "--ctx", "512")
    try:
        replaced = 0
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            for seed in range(6):
                kw = dict(max_tokens=40, temperature=1.5, top_k=0, seed=seed, ignore_eos=True)
                whole = c.generate("hello there", **kw)  # type: ignore[arg-type]
                streamed = "".join(ch.text for ch in c.stream("hello there", **kw))  # type: ignore[arg-type]
                assert streamed == whole.text
                whole.text.encode("utf-8")  # valid: no lone surrogates either
                replaced += whole.text.count("\ufffd")
                # the ids' text, but for a character the end cut short: left out of the
                # output (its bytes, as U+FFFD, are in the ids' text alone)
                back = c.detokenize(whole.token_ids)
                assert back.startswith(whole.text) and set(back[len(whole.text):]) <= {"\ufffd"}
                assert len(back) - len(whole.text) <= 3
        assert replaced > 0, "the random model should have emitted some invalid byte sequence"
    finally:
        _stop_checked(d)


def test_biases_penalties_and_structured_output(client: kvd_client.Client) -> None:
    """The client's OpenAI-style sampling fields and structured output reach the worker: a +100 bias
    forces a token, a frequency penalty changes a repetitive greedy output, and json_schema's output
    parses and follows the schema."""
    c = client
    ids = c.tokenize(" banana")
    r = c.generate("The capital of France is", max_tokens=1, temperature=0, logit_bias={ids[-1]: 100})
    assert r.token_ids == [ids[-1]]
    base = c.generate("one one one one one one", max_tokens=16, temperature=0)
    pen = c.generate("one one one one one one", max_tokens=16, temperature=0, frequency_penalty=2.0)
    assert pen.token_ids != base.token_ids and len(set(pen.token_ids)) >= len(set(base.token_ids))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"]}
    out = c.generate(messages=[{"role": "user", "content": "A number and a flag, as JSON."}],
                     max_tokens=64, temperature=0, json_schema=schema)
    doc = json.loads(out.text)
    assert set(doc) == {"n", "ok"} and isinstance(doc["n"], int) and isinstance(doc["ok"], bool)
    with pytest.raises(kvd_client.BadRequest):
        c.generate("x", max_tokens=1, json_schema={"type": "object", "patternProperties": {"a": {}}})
    with pytest.raises(kvd_client.BadRequest):
        c.generate("x", max_tokens=1, presence_penalty=3.0)
