"""The host tier below the pool (kvd --host-cache): with a pool too small for
the distinct system prompts it serves, every prompt that the pool evicted
comes back from the tier, copied instead of computed, with the output of its
uncached run bit for bit (the real model, greedy)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from conftest import Daemon, _stop_checked

import kvd_client

# Eight distinct system prompts of some 330 tokens (21 blocks of 16) each: 168
# blocks, against a pool of 24 MiB (64 blocks of the default model's f16 K/V).
N_PROMPTS = 8


def system_prompt(i: int) -> str:
    return " ".join(
        f"Policy {i}.{j}: the assistant for desk {i} answers questions about shelf {j * 3 + i} "
        f"and never mentions drawer {(j * 11 + i) % 17}."
        for j in range(12)
    )


def ask(c: kvd_client.Client, i: int, ns: str) -> kvd_client.Result:
    return c.generate(
        messages=[{"role": "system", "content": system_prompt(i)},
                  {"role": "user", "content": "Which shelf holds the atlas?"}],
        max_tokens=12, temperature=0, ignore_eos=True, namespace=ns,
    )


def test_host_tier_restores_evicted_prompts(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "kvd", "--kv-memory", "24MiB", "--host-cache", "256MiB", "-w", "1")
    try:
        d.measure_patience()
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            s0 = c.stats()
            assert s0.host_cache_max_bytes == 256 << 20
            pool_tokens = s0.blocks_total * s0.block_tokens
            first = [ask(c, i, "tiers") for i in range(N_PROMPTS)]
            for r in first:
                assert r.usage.cached_prompt_tokens == 0
            total = sum(r.usage.prompt_tokens for r in first)
            assert total > 2 * pool_tokens, "the prompts must not fit in the pool together"
            s1 = c.stats()
            assert s1.evictions > 0 and s1.host_cache_stored > 0
            # again, oldest first: each was evicted by the ones after it
            again = [ask(c, i, "tiers") for i in range(N_PROMPTS)]
            for i, (a, b) in enumerate(zip(first, again)):
                full = (b.usage.prompt_tokens - 1) // 16 * 16
                assert b.usage.cached_prompt_tokens == full, (i, b.usage)
                assert b.usage.host_cached_prompt_tokens > 0, (i, b.usage)
                assert b.token_ids == a.token_ids, f"prompt {i}: restored K/V changed the output"
            s2 = c.stats()
            restored = sum(b.usage.host_cached_prompt_tokens for b in again)
            assert s2.host_cached_prompt_tokens - s1.host_cached_prompt_tokens == restored
            assert s2.host_cache_corrupt == 0
            assert s2.host_cache_bytes <= s2.host_cache_max_bytes
            # another namespace finds none of it, in the pool or the tier
            other = ask(c, 0, "another-tenant")
            assert other.usage.cached_prompt_tokens == 0
            assert other.token_ids == first[0].token_ids
    finally:
        _stop_checked(d)


def test_restores_shared_and_cancelled(tmp_path: Path) -> None:
    """Blocks come back on kvd's restore thread: two requests for the same
    evicted prompt at once copy it back once (the second waits for the first's
    pending blocks and finds them in the pool), both with the uncached
    output; requests whose clients leave while their copies run end without
    leaking a block, and kvd serves on."""
    import threading

    d = Daemon(tmp_path / "kvd", "--kv-memory", "24MiB", "--host-cache", "256MiB", "-w", "2", "-v")
    try:
        d.measure_patience()
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            first = [ask(c, i, "shared") for i in range(N_PROMPTS)]
            # prompt 0 was evicted by the others; ask it twice at once
            out: list[kvd_client.Result] = []

            def run() -> None:
                with kvd_client.Client(d.endpoint, timeout=d.patience) as c2:
                    out.append(ask(c2, 0, "shared"))

            ts = [threading.Thread(target=run) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert len(out) == 2
            for r in out:
                assert r.token_ids == first[0].token_ids
                assert r.usage.cached_prompt_tokens == (r.usage.prompt_tokens - 1) // 16 * 16, r.usage
            host = sorted(r.usage.host_cached_prompt_tokens for r in out)
            assert host[1] > 0, out[0].usage
            assert host[0] == 0, "the second request copied the same blocks again"
            # clients that leave while their prefixes come back: each closes
            # its socket right after sending (the request is cancelled as gone)
            for i in range(1, N_PROMPTS):
                c3 = kvd_client.Client(d.endpoint, timeout=d.patience)
                st = c3.stream(messages=[{"role": "system", "content": system_prompt(i)},
                                         {"role": "user", "content": "Which shelf holds the atlas?"}],
                               max_tokens=8, temperature=0, namespace="shared")
                st.__enter__()
                c3.close()
            deadline = time.monotonic() + d.patience
            while True:
                s = c.stats()
                if (s.requests_running == 0 and s.requests_queued == 0 and s.blocks_pending == 0
                        and s.blocks_in_use == 0):
                    break
                assert time.monotonic() < deadline, s
                time.sleep(0.05)
            stopped = d.log().count("stopped while its prefix came back from the tiers")
            print(f"{stopped} of {N_PROMPTS - 1} left while their copies ran")
            # and kvd serves on, with the same outputs
            for i in (1, 2):
                assert ask(c, i, "shared").token_ids == first[i].token_ids
    finally:
        _stop_checked(d)


def test_host_tier_refused_for_a_pool_in_parts_or_too_small(tmp_path: Path) -> None:
    import subprocess

    from conftest import BIN_DIR, MODEL

    out = subprocess.run(
        [str(BIN_DIR / "kvd"), "--model", str(MODEL), "--listen", f"ipc://{tmp_path}/k.sock",
         "--kv-memory", "16MiB", "--host-cache", "1KiB", "-w", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "--host-cache" in out.stderr and "one block" in out.stderr


def test_host_and_disk_tiers_for_a_pool_in_parts(tmp_path: Path) -> None:
    """A model with sliding-window layers (a random gemma3 model of kvd-mkmodel:
    five layers in six in a window of 32 positions, so a pool in 6 parts): its
    prompts come back from the tiers, part 0's blocks and each windowed part's
    last window, with the uncached output; then after a restart from disk."""
    import subprocess

    from conftest import BIN_DIR

    model = tmp_path / "gemma3-random.gguf"
    subprocess.run([str(BIN_DIR / "kvd-mkmodel"), "-o", str(model), "--gemma3", "--layers", "6", "--embd", "128",
                    "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--window", "32", "--ff", "256",
                    "--vocab", "600", "--ctx", "1024", "--type", "Q8_0", "--seed", "3"],
                   check=True, capture_output=True)
    cache = tmp_path / "cache"
    prompts = [[3 + (i * 37 + j * 11) % 590 for j in range(150 + 10 * i)] for i in range(N_PROMPTS)]

    def gen(c: kvd_client.Client, i: int) -> kvd_client.Result:
        return c.generate(token_ids=prompts[i], max_tokens=8, temperature=0, ignore_eos=True)

    pool = f"kvd-test-tiers-parts-{os.getpid()}"
    args = ("--model", str(model), "--ctx", "1024", "--kv-memory", "640KiB", "--host-cache", "64MiB",
            "--cache-dir", str(cache), "-w", "1")
    d = Daemon(tmp_path / "k1", *args, "--pool", pool + "-1")
    try:
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            s0 = c.stats()
            assert s0.kv_parts == 6 and s0.kv_window == 32
            first = [gen(c, i) for i in range(N_PROMPTS)]
            assert all(r.usage.cached_prompt_tokens == 0 for r in first)
            again = [gen(c, i) for i in range(N_PROMPTS)]
            for i, (a, b) in enumerate(zip(first, again)):
                full = (b.usage.prompt_tokens - 1) // 16 * 16
                assert b.usage.cached_prompt_tokens == full, (i, b.usage)
                assert b.token_ids == a.token_ids, f"prompt {i}: restored K/V changed the output"
            assert sum(b.usage.host_cached_prompt_tokens for b in again) > 0
            while c.stats().disk_cache_pending:
                time.sleep(0.05)
            assert c.stats().disk_cache_dropped_writes == 0
    finally:
        _stop_checked(d)
    d = Daemon(tmp_path / "k2", *args, "--pool", pool + "-2")
    try:
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            third = [gen(c, i) for i in range(N_PROMPTS)]
            for i, (a, b) in enumerate(zip(first, third)):
                full = (b.usage.prompt_tokens - 1) // 16 * 16
                assert b.usage.cached_prompt_tokens == full, (i, b.usage)
                assert b.usage.disk_cached_prompt_tokens > 0, (i, b.usage)
                assert b.token_ids == a.token_ids, f"prompt {i}: K/V read from disk changed the output"
    finally:
        _stop_checked(d)
        for n in (1, 2):    # named pools outlive their kvd, by design: not the test's
            Path(f"/dev/shm/{pool}-{n}").unlink(missing_ok=True)
