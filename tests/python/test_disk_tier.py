"""The disk tier (kvd --cache-dir): blocks written behind to files survive a
kvd killed with SIGKILL mid-load; the restarted kvd reads them back (pool 0,
disk > 0) with the uncached run's output, bit for bit (the real model,
greedy); damaged, truncated and foreign files are never used."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from conftest import BIN_DIR, Daemon, _stop_checked

import kvd_client

N_PROMPTS = 3


def system_prompt(i: int) -> str:
    return " ".join(
        f"Clause {i}.{j}: the archive of wing {i} lends volume {j * 5 + i} for {j % 4 + 2} weeks "
        f"and charges {(j * 13 + i) % 9} coins a day when late."
        for j in range(12)
    )


def ask(c: kvd_client.Client, i: int, ns: str = "disk") -> kvd_client.Result:
    return c.generate(
        messages=[{"role": "system", "content": system_prompt(i)},
                  {"role": "user", "content": "How long may I keep volume 7?"}],
        max_tokens=10, temperature=0, ignore_eos=True, namespace=ns,
    )


def start(workdir: Path, cache: Path, pool: str, *extra: str) -> Daemon:
    return Daemon(workdir, "--kv-memory", "24MiB", "--pool", pool, "--cache-dir", str(cache),
                  "--disk-cache", "512MiB", "-w", "1", *extra)


def idle_disk(c: kvd_client.Client, timeout: float) -> kvd_client.Stats:
    """Stats once no write is queued (or after timeout: the test then fails on what it finds)."""
    deadline = time.monotonic() + timeout
    while True:
        s = c.stats()
        if s.disk_cache_pending == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def unlink_pool(name: str) -> None:
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


def files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.kvb"))


def test_disk_tier_survives_sigkill_and_rejects_damage(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    pools = [f"kvd-test-disk-{os.getpid()}-{i}" for i in range(6)]
    try:
        # 1. an empty directory starts clean; three prompts computed and written behind
        d = start(tmp_path / "k1", cache, pools[0])
        d.measure_patience()
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            first = [ask(c, i) for i in range(N_PROMPTS)]
            assert all(r.usage.cached_prompt_tokens == 0 for r in first)
            s = idle_disk(c, d.patience)
            full_blocks = sum((r.usage.prompt_tokens - 1) // 16 for r in first)
            assert s.disk_cache_pending == 0 and s.disk_cache_written >= full_blocks
            # 2. a load that writes more, killed mid-stream
            stream = c.stream(messages=[{"role": "system", "content": system_prompt(9)},
                                        {"role": "user", "content": "Count to fifty."}],
                              max_tokens=400, temperature=0, ignore_eos=True, namespace="disk")
            next(iter(stream))          # it is running: its prompt's blocks are being written
            d.proc.kill()
            d.proc.wait()
        d._log.close()
        unlink_pool(pools[0])

        # 3. restarted on the same directory with a new pool: everything comes from disk
        d = start(tmp_path / "k2", cache, pools[1])
        assert not list(cache.glob(".tmp-*"))
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            s0 = c.stats()
            assert s0.disk_cache_blocks >= full_blocks
            again = [ask(c, i) for i in range(N_PROMPTS)]
            for i, (a, b) in enumerate(zip(first, again)):
                full = (b.usage.prompt_tokens - 1) // 16 * 16
                assert b.usage.cached_prompt_tokens == full, (i, b.usage)
                assert b.usage.disk_cached_prompt_tokens == full, (i, b.usage)  # pool 0
                assert b.token_ids == a.token_ids, f"prompt {i}: K/V read from disk changed the output"
            s1 = idle_disk(c, d.patience)
            assert s1.disk_cached_prompt_tokens == sum(b.usage.disk_cached_prompt_tokens for b in again)
        _stop_checked(d)

        # 4. one file's data damaged, another truncated: misses, counted, output unchanged
        kvb = files(cache)
        assert len(kvb) >= 2
        with open(kvb[0], "r+b") as f:
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))
        with open(kvb[1], "r+b") as f:
            f.truncate(os.path.getsize(kvb[1]) // 2)
        d = start(tmp_path / "k3", cache, pools[2])
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            s0 = c.stats()
            assert s0.disk_cache_corrupt == 1  # the truncated file, found at start
            third = [ask(c, i, "disk") for i in range(N_PROMPTS)]
            for a, b in zip(first, third):
                assert b.token_ids == a.token_ids
            s1 = c.stats()
            assert 1 <= s1.disk_cache_corrupt <= 2  # ...and the damaged one, if a prompt reached it
        _stop_checked(d)
        assert d.log_path.read_text().count("damaged or truncated: removed") == 1

        # 5. a directory of another model: every file ignored, one line each, none used
        other = tmp_path / "other.gguf"
        subprocess.run([str(BIN_DIR / "kvd-mkmodel"), "-o", str(other), "--layers", "2", "--embd", "64",
                        "--heads", "2", "--kv-heads", "1", "--ff", "128", "--vocab", "600", "--ctx", "512"],
                       check=True, capture_output=True)
        n_files = len(files(cache))
        d = Daemon(tmp_path / "k4", "--model", str(other), "--kv-memory", "8MiB", "--pool", pools[3],
                   "--cache-dir", str(cache), "-w", "1", "--ctx", "512")
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            s0 = c.stats()
            assert s0.disk_cache_blocks == 0 and s0.disk_cache_ignored == n_files
        _stop_checked(d)
        log = d.log_path.read_text()
        assert log.count("made for another model, layout or secret") == 1
        assert f"{n_files} files in {cache} were made for another model, layout or secret" in log
        # ...and its own files do not disturb the first model's
        d = start(tmp_path / "k5", cache, pools[4])
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            s0 = c.stats()
            assert s0.disk_cache_blocks == n_files
            assert s0.disk_cache_ignored == len(files(cache)) - n_files
        _stop_checked(d)

        # 6. the same model in other KV types (as after a change of the default, auto): its
        # blocks ignored, and the log line names both kvds' types
        d = start(tmp_path / "k6", cache, pools[5], "--kv-type", "q8_0")
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            s0 = c.stats()
            assert s0.disk_cache_blocks == 0 and s0.disk_cache_ignored == len(files(cache))
        _stop_checked(d)
        log = d.log_path.read_text()
        assert re.search(r"\.kvb holds K (f16|bf16) / V (f16|bf16) blocks, this kvd keeps K q8_0 / V q8_0 "
                         r"\(--kv-type\)", log), log
    finally:
        for p in pools:
            unlink_pool(p)
