"""The disk tier's files against whoever can write its directory (issue 38, items
12-13): forged blocks, FIFOs, links and other users' files named like blocks, a
planted .tmp-secret link, the directory's owner and mode, other files and the
budget.

A block file (shm/disktier.c, format version 2): a header of H_TOKENS bytes of
fixed fields, the block's token ids, and the keyed BLAKE2b-256 MAC of all that;
then the block's K/V, whose MAC is in the header at H_DMAC. The MAC key is
derived from the directory's key secret (disk_tier_mac_key)."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest

import kvd_client
from conftest import NOBODY, Kvd, run_kvd, wait_for

BLOCK = 16
H_SIZE, H_KEY, H_PARENT, H_DMAC, H_TOKENS = 12, 96, 112, 168, 200
MAC = 32


def system_prompt(i: int) -> str:
    return " ".join(f"Clause {i}.{j}: the archive of wing {i} lends volume {j * 5 + i} for {j % 4 + 2} weeks "
                    f"and charges {(j * 13 + i) % 9} coins a day when late." for j in range(6))


def ask(c: kvd_client.Client, i: int) -> kvd_client.Result:
    return c.generate(system_prompt(i) + " Question: how long may I keep volume 7? Answer:", max_tokens=10,
                      temperature=0, ignore_eos=True)


def disk_idle(k: Kvd) -> kvd_client.Stats:
    """kvd's stats once no write to the disk tier is queued."""
    def idle() -> kvd_client.Stats | None:
        s: kvd_client.Stats = k.stats()
        return s if s.disk_cache_pending == 0 else None
    st: kvd_client.Stats = wait_for("the disk tier's writes done", idle)
    return st


class BlockFile:
    """One block file: its header and data, its tokens and chain."""

    def __init__(self, path: Path) -> None:
        self.path = path
        raw = path.read_bytes()
        self.hb = struct.unpack_from("<I", raw, H_SIZE)[0]
        self.header, self.data = bytearray(raw[:self.hb]), bytearray(raw[self.hb:])
        self.tokens = list(struct.unpack_from(f"<{BLOCK}i", raw, H_TOKENS))
        self.key, self.parent = bytes(raw[H_KEY:H_KEY + 16]), bytes(raw[H_PARENT:H_PARENT + 16])

    def write(self, data: bytes, mac_key: bytes | None, unkeyed: bool) -> None:
        """The file with data for its K/V: MACs recomputed under mac_key, unkeyed (as a forger without
        the secret would), or left as they were (neither)."""
        h = bytearray(self.header)
        if mac_key is not None or unkeyed:
            def mac(b: bytes) -> bytes:
                return hashlib.blake2b(b, digest_size=MAC, key=mac_key or b"").digest()
            h[H_DMAC:H_DMAC + MAC] = mac(data)
            h[self.hb - MAC:] = mac(bytes(h[:self.hb - MAC]))
        self.path.write_bytes(bytes(h) + data)


def block_files(cache: Path) -> list[BlockFile]:
    return [BlockFile(p) for p in sorted(cache.glob("*.kvb"))]


def prompt_files(files: list[BlockFile], ids: list[int]) -> list[BlockFile]:
    """The files of a prompt's full blocks, in order."""
    by_tokens = {tuple(f.tokens): f for f in files}
    out = []
    for i in range((len(ids) - 1) // BLOCK):
        f = by_tokens.get(tuple(ids[i * BLOCK:(i + 1) * BLOCK]))
        assert f is not None, f"block {i} of the prompt is not on disk"
        out.append(f)
    return out


def mac_key(cache: Path) -> bytes:
    """disk_tier_mac_key: BLAKE2b-256 of the label (its NUL included) and the key secret."""
    return hashlib.blake2b(b"kvd disk tier MAC key 1\0" + (cache / "secret").read_bytes(), digest_size=32).digest()


def test_forged_blocks_refused(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 12: K/V replaced in block files, with checksums an attacker without the key secret can
    compute (unkeyed BLAKE2b over the data and the header), or with the header left as it was, are
    damaged files: refused at start or at read, never used, the output unchanged (forged blocks with
    recomputed unkeyed XXH3 checksums changed a cached prompt's output). The control: the same forgery
    under the real key is read and changes the output, so the MAC is what stopped it."""
    cache = tmp_path / "cache"
    args = ("--kv-memory", "32MiB", "--cache-dir", str(cache), "--disk-cache", "256MiB")
    a = Kvd(tmp_path / "a", *args)
    kvds.append(a)
    with a.client() as c:
        want = [ask(c, i) for i in range(2)]
        ids = [c.tokenize(system_prompt(i) + " Question: how long may I keep volume 7? Answer:") for i in range(2)]
    assert [r.usage.prompt_tokens for r in want] == [len(x) for x in ids]
    disk_idle(a)
    a.stop()
    files = block_files(cache)
    x, y = prompt_files(files, ids[0]), prompt_files(files, ids[1])
    n = min(len(x), len(y))
    assert n >= 4
    # prompt 0's files: K/V of prompt 1's blocks, MACs recomputed unkeyed; prompt 1's: K/V of prompt
    # 0's, headers untouched
    for i, f in enumerate(x):
        f.write(bytes(y[i % n].data), None, unkeyed=True)
    for i, f in enumerate(y):
        f.write(bytes(x[i % n].data), None, unkeyed=False)
    b = Kvd(tmp_path / "b", *args)
    kvds.append(b)
    s0 = b.stats()
    assert s0.disk_cache_corrupt == len(x), "the forged headers should be refused at start"
    assert s0.disk_cache_blocks == len(files) - len(x)
    with b.client() as c:
        got = [ask(c, i) for i in range(2)]
    for r, w in zip(got, want):
        assert r.usage.disk_cached_prompt_tokens == 0, r.usage
        assert r.token_ids == w.token_ids, "a forged block changed the output"
    assert b.stats().disk_cache_corrupt >= len(x) + 1      # prompt 1's first block, refused on read
    assert b.log().count("damaged or truncated: removed") == len(x)
    disk_idle(b)
    b.stop()
    # the control: forged under the real key, prompt 0's blocks are read and the output changes
    files = block_files(cache)
    x, y = prompt_files(files, ids[0]), prompt_files(files, ids[1])
    key = mac_key(cache)
    for i, f in enumerate(x):
        f.write(bytes(y[i % n].data), key, unkeyed=False)
    k = Kvd(tmp_path / "control", *args)
    kvds.append(k)
    with k.client() as c:
        r = ask(c, 0)
    assert r.usage.disk_cached_prompt_tokens == len(x) * BLOCK, r.usage
    assert r.token_ids != want[0].token_ids, "K/V of other tokens should change the output"
    k.stop()


def test_fifo_links_and_others_files(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 13: a FIFO named like a block file (start-up hung on it forever), a link named like one
    and another user's block file are refused and left alone; a planted .tmp-secret link (kvd wrote
    the key secret through it, world-readable) and a .tmp- link of a block are removed, not followed;
    kvd starts and serves."""
    cache = tmp_path / "cache"
    args = ("--kv-memory", "32MiB", "--cache-dir", str(cache))
    victim, victim2 = tmp_path / "victim", tmp_path / "victim2"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    victim2.write_text("precious too\n")
    cache.mkdir(mode=0o700)
    os.symlink(victim, cache / ".tmp-secret")
    a = Kvd(tmp_path / "a", *args)
    kvds.append(a)
    assert victim.read_text() == "precious\n" and (victim.stat().st_mode & 0o777) == 0o644
    st = os.lstat(cache / "secret")
    assert st.st_size > 0 and (st.st_mode & 0o777) == 0o600 and not (cache / "secret").is_symlink()
    assert not os.path.lexists(cache / ".tmp-secret")
    with a.client() as c:
        want = ask(c, 0)
    disk_idle(a)
    a.stop()
    genuine = sorted(cache.glob("*.kvb"))
    assert len(genuine) >= 2
    fifo = cache / ("a" * 32 + ".kvb")
    os.mkfifo(fifo)
    link = cache / ("b" * 32 + ".kvb")
    os.rename(genuine[0], tmp_path / "moved.kvb")
    os.symlink(tmp_path / "moved.kvb", link)
    theirs = genuine[1]
    if os.geteuid() == 0:
        os.chown(theirs, NOBODY, NOBODY)
    tmp_link = cache / (".tmp-" + "c" * 32 + ".kvb")
    os.symlink(victim2, tmp_link)
    b = Kvd(tmp_path / "b", *args, ready=False)
    kvds.append(b)
    b.wait_ready()      # start-up does not wait on the FIFO
    refused = 3 if os.geteuid() == 0 else 2
    assert f"{refused} refused)" in b.log(), b.log()
    assert "is not a regular file of this user's" in b.log()
    with b.client() as c:
        r = ask(c, 0)
    assert r.token_ids == want.token_ids
    assert fifo.is_fifo() and link.is_symlink() and theirs.exists()
    assert not os.path.lexists(tmp_link) and victim2.read_text() == "precious too\n"
    b.stop()
    if os.geteuid() != 0:
        pytest.skip("another user's file needs root to make (CI runs the tests as root)")


def test_secret_and_directory_checked(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 13: a secret that is a link, or readable by others, is refused (not followed or fixed);
    a directory of another user's, or one others may write in, is refused."""
    victim = tmp_path / "victim"
    victim.write_bytes(os.urandom(32))
    victim.chmod(0o600)
    d = tmp_path / "linked"
    d.mkdir(mode=0o700)
    os.symlink(victim, d / "secret")
    r = run_kvd("-w", "0", "--kv-memory", "16MiB", "--listen", f"ipc://{tmp_path}/k1/kvd.sock", "--cache-dir", str(d))
    assert r.returncode == 1 and f"{d}/secret: a symbolic link: refused" in r.stderr, r.stderr
    d = tmp_path / "readable"
    d.mkdir(mode=0o700)
    (d / "secret").write_bytes(os.urandom(32))
    (d / "secret").chmod(0o644)
    r = run_kvd("-w", "0", "--kv-memory", "16MiB", "--listen", f"ipc://{tmp_path}/k2/kvd.sock", "--cache-dir", str(d))
    assert r.returncode == 1 and "secret is not a file only this user may read (mode 0644)" in r.stderr, r.stderr
    assert ((d / "secret").stat().st_mode & 0o777) == 0o644
    for mode in (0o777, 0o720, 0o702):
        d = tmp_path / f"mode-{mode:o}"
        d.mkdir()
        d.chmod(mode)
        r = run_kvd("-w", "0", "--kv-memory", "16MiB", "--listen", f"ipc://{tmp_path}/k3/kvd.sock",
                    "--cache-dir", str(d))
        assert r.returncode == 1 and f"others may write in {d} (mode 0{mode:o}" in r.stderr, r.stderr
        assert not (d / "secret").exists()
    if os.geteuid() != 0:
        pytest.skip("a directory of another user's needs root to make (CI runs the tests as root)")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    r = run_kvd("-w", "0", "--kv-memory", "16MiB", "--listen", f"ipc://{tmp_path}/k4/kvd.sock", "--cache-dir", str(d))
    assert r.returncode == 1 and f"another user owns {d}" in r.stderr, r.stderr
    assert not (d / "secret").exists()
    # the control: a directory of ours that others may read but not write is taken
    d = tmp_path / "ours"
    d.mkdir(mode=0o755)
    k = Kvd(tmp_path / "k5", "--kv-memory", "16MiB", "--cache-dir", str(d), workers=0)
    kvds.append(k)
    k.stop()


def test_other_files_count_against_budget(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 13: files named like blocks but of another layout (another version of the format here)
    are never used, never removed, and take their room from --disk-cache: with them over the budget
    no block of ours is kept (they were not counted at all)."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    other = cache / ("d" * 32 + ".kvb")
    with open(other, "wb") as f:
        f.write(b"KVDTIER\x01" + struct.pack("<II", 1, 296))
        f.truncate(12 << 20)
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", "--cache-dir", str(cache), "--disk-cache", "8MiB")
    kvds.append(k)
    s = k.stats()
    assert s.disk_cache_ignored == 1 and s.disk_cache_bytes >= 12 << 20, s
    assert "other files fill the budget" in k.log()
    with k.client() as c:
        ask(c, 0)
    s = disk_idle(k)
    assert s.disk_cache_written > 0 and s.disk_cache_blocks == 0, s
    assert other.stat().st_size == 12 << 20
    k.stop()
