"""kvd serving the second model family, Gemma 3 (270M, Q4_K_M; scripts/fetch-model.sh --model
gemma3-270m): a shared system prompt longer than the 512-token window of its windowed layers is
cached and continued exactly, through the chat format the file does not ship (kvd's Gemma
template), over ZeroMQ and HTTP."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvd_client
from conftest import LONG_SYSTEM, ROOT, Daemon, _stop_checked

GEMMA = Path(os.environ.get("KVD_GEMMA3_MODEL") or ROOT / "models" / "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    if not GEMMA.is_file():
        pytest.fail(f"{GEMMA} is missing: run scripts/fetch-model.sh --model gemma3-270m (or set KVD_GEMMA3_MODEL)")
    d = Daemon(tmp_path_factory.mktemp("kvd-gemma"), "--model", str(GEMMA), "--kv-memory", "512MiB", "-w", "1")
    d.measure_patience()
    yield d
    _stop_checked(d)


def test_shared_prompt_past_the_window_is_cached_exactly(gemma: Daemon) -> None:
    # some 1,700 tokens: more than three windows of 512, within the daemon's context of 2,048
    system = " ".join([LONG_SYSTEM] * 2) + " " + LONG_SYSTEM[: len(LONG_SYSTEM) // 2]
    with kvd_client.Client(gemma.endpoint, timeout=gemma.patience) as c:
        h = c.health()
        assert h.ok and "gemma" in h.model

        def ask(q: str, **kw: object) -> kvd_client.Result:
            return c.generate(messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                              max_tokens=24, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]

        first = ask("Topic 3, please.")
        assert first.usage.prompt_tokens >= 1500
        second = ask("And topic 5?")
        uncached = ask("And topic 5?", no_cache=True)
    print(f"gemma: prompt {second.usage.prompt_tokens} tokens, {second.usage.cached_prompt_tokens} cached")
    assert first.usage.cached_prompt_tokens == 0
    assert second.usage.cached_prompt_tokens >= 1472
    assert uncached.usage.cached_prompt_tokens == 0
    # the continuation of a cached prefix is the uncached run's, token for token
    assert second.token_ids == uncached.token_ids
    assert second.text == uncached.text


def test_tokenize_and_chat_format(gemma: Daemon) -> None:
    with kvd_client.Client(gemma.endpoint, timeout=gemma.patience) as c:
        ids = c.tokenize(messages=[{"role": "system", "content": " Be brief. "},
                                   {"role": "user", "content": "Hi"}])
        text = c.detokenize(ids)
    # BOS, then the system text trimmed into the first user turn (llama.cpp's Gemma rendering)
    assert ids[0] == 2
    assert text.endswith("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n")


def test_a_prompt_the_pool_holds_only_by_its_window(gemma: Daemon, tmp_path: Path) -> None:
    # A pool of about 440 blocks of 3 layers (21 MiB): one 1,700-token prompt held in every part
    # at once would take about 650, but its windowed parts keep only their window (and a few
    # steps ahead, handed out as the prefill goes: --step-tokens 64), so it runs, with the output
    # of the large pool.
    system = " ".join([LONG_SYSTEM] * 2) + " " + LONG_SYSTEM[: len(LONG_SYSTEM) // 2]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Topic 4?"}]
    small = Daemon(tmp_path, "--model", str(GEMMA), "--kv-memory", "21MiB", "--step-tokens", "64", "-w", "1")
    try:
        small.measure_patience()
        with kvd_client.Client(small.endpoint, timeout=small.patience) as c:
            st = c.stats()
            with c.stream(messages=messages, max_tokens=16, temperature=0, ignore_eos=True) as s:
                it = iter(s)
                next(it)    # the prompt is written: the windows have slid
                during = c.stats()
                for _ in it:
                    pass
            got = s.result
            assert got is not None
            # everything goes back to the cache or the free list once the worker lets go
            deadline = time.monotonic() + small.patience
            while (after := c.stats()).blocks_in_use or after.blocks_pending:
                assert time.monotonic() < deadline, f"blocks still held: {after}"
                time.sleep(0.05)
    finally:
        _stop_checked(small)
    with kvd_client.Client(gemma.endpoint, timeout=gemma.patience) as c:
        # the system prompt is cached there (cached == uncached is the first test's)
        want = c.generate(messages=messages, max_tokens=16, temperature=0, ignore_eos=True)
    assert (st.kv_parts, st.kv_part_layers, st.kv_window) == (6, 3, 512)
    assert st.blocks_total * st.block_tokens < got.usage.prompt_tokens * st.kv_parts
    # while it decodes, each of the 5 windowed parts holds about its window (512 / 16 blocks),
    # not the prompt's 107 blocks
    print(f"gemma: {during.blocks_in_use_windowed} windowed blocks held, {during.blocks_in_use} in all")
    assert 5 * 32 <= during.blocks_in_use_windowed <= 5 * 40
    assert got.usage.prompt_tokens >= 1500
    assert got.token_ids == want.token_ids
    assert after.blocks_cached > 0
