"""Workers on other hosts (kvd-worker --host NAME): each host computes into a
pool of its own, which kvd indexes; kvd sends a request to the host whose pool
holds the longest cached prefix of it, and a request whose host is lost
resumes on another with the output of an uncached run.

Here the "hosts" are worker processes with pools of their own names on this
machine, reaching kvd over tcp:// on loopback with CURVE (test_netns.py runs
the same across network namespaces). A host's pool is created by its first
worker and joined by the others; a worker that kvd declared lost (stopped,
then continued) fences itself, and kvd holds its blocks until it has."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import BIN_DIR, CTX, LONG_SYSTEM, MODEL, Daemon, _stop_checked

import kvd_client

SECOND_SYSTEM = " ".join(f"Fact {i}: the number {i} is written {i:b} in base two." for i in range(1, 60))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Hosts:
    """kvd with no worker of its own, and workers that join it from "other hosts"."""

    tmp: Path
    connect: str                                   #: the worker endpoint, as the workers dial it
    #: the workers' --fence-ms: their default, so that a long step on a slow, busy machine is
    #: never taken for kvd's silence (only test_fenced_worker wants it short)
    fence_ms: int = 10000
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    host_of: dict[int, str] = field(default_factory=dict)
    pools: set[str] = field(default_factory=set)

    def keys(self) -> tuple[Path, Path]:
        keys, allow = self.tmp / "keys", self.tmp / "allow"
        keys.mkdir(exist_ok=True)
        allow.mkdir(exist_ok=True)
        for name in ("kvd", "hosts", "stranger"):
            subprocess.run([str(BIN_DIR / "kvd-keygen"), "--dir", str(keys), "--force", name], check=True,
                           capture_output=True)
        (allow / "hosts.key").write_bytes((keys / "hosts.key").read_bytes())
        return keys, allow

    def kvd(self, bind: str, timeout_ms: int, *extra: str, wrap: Sequence[str] = ()) -> Daemon:
        """kvd with no worker of its own, its CURVE worker endpoint bound at bind."""
        keys, allow = self.keys()
        return Daemon(self.tmp / "kvd", "-w", "0", "--kv-memory", "16MiB", "--worker-endpoint", bind,
                      "--curve-secret", str(keys / "kvd.key_secret"), "--workers-allow", str(allow),
                      "--worker-timeout", str(timeout_ms), *extra, ready="stats", wrap=wrap)

    def start(self, wid: int, host: str, wrap: Sequence[str] = (), connect: str | None = None,
              cert: str | None = "hosts") -> None:
        """Worker wid of host `host`, with key pair `cert` (None: no CURVE)."""
        pool = f"kvdtest-{self.tag}-{host}"
        self.pools.add(pool)
        keys = self.tmp / "keys"
        log = open(self.tmp / f"worker{wid}.log", "ab")
        self.workers[wid] = subprocess.Popen(
            [*wrap, str(BIN_DIR / "kvd-worker"), "--model", str(MODEL), "--pool", pool, "--connect", connect or self.connect,
             "--id", str(wid), "--host", host, "--kv-memory", "40MiB", "--threads", "1", "--ctx", str(CTX),
             "--fence-ms", str(self.fence_ms),
             *(("--curve-server-key", str(keys / "kvd.key"), "--curve-cert", str(keys / f"{cert}.key_secret"))
               if cert else ())],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        self.host_of[wid] = host

    def log(self, wid: int) -> str:
        return (self.tmp / f"worker{wid}.log").read_text(errors="replace")

    def stop(self) -> None:
        for p in self.workers.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
        for p in self.workers.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pool in self.pools:     # a killed creator leaves its pool's name behind
            Path(f"/dev/shm/{pool}").unlink(missing_ok=True)


def hosts_of(c: kvd_client.Client) -> dict[str, kvd_client.HostStats]:
    return {h.name: h for h in c.stats().hosts}


def wait_hosts(c: kvd_client.Client, want: dict[str, int], patience: float) -> None:
    """Until the named hosts have these many live workers."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        got = {n: h.workers for n, h in hosts_of(c).items() if n}
        if got == want:
            return
        time.sleep(0.1)
    pytest.fail(f"hosts never became {want}: {hosts_of(c)}")


def system_prompt(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def two_hosts_scenario(d: Daemon, h: Hosts) -> None:
    """A prefix cached on one host sends its follow-up there; killing that
    host's worker mid-stream resumes the stream on the other host with the
    output of an uncached run."""
    with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
        wait_hosts(c, {"A": 1, "B": 1}, d.patience)
        d.measure_patience()
        first = system_prompt(LONG_SYSTEM, "What does rule 3 say?")
        follow = system_prompt(LONG_SYSTEM, "And rule 12?")
        want = c.generate(messages=follow, max_tokens=40, temperature=0, no_cache=True).token_ids

        before = hosts_of(c)
        r1 = c.generate(messages=first, max_tokens=4, temperature=0)
        mid = hosts_of(c)
        went = [n for n in ("A", "B") if mid[n].requests > before[n].requests]
        assert len(went) == 1, (before, mid)
        home = went[0]
        other = "B" if home == "A" else "A"
        assert mid[home].blocks_cached > 0 and mid[other].blocks_cached == before[other].blocks_cached

        # the follow-up goes where its system prompt is cached, every time
        for _ in range(3):
            r = c.generate(messages=follow, max_tokens=2, temperature=0)
            assert r.usage.cached_prompt_tokens >= r1.usage.prompt_tokens - 2 * 16 - 16, r.usage
        after = hosts_of(c)
        assert after[home].requests == mid[home].requests + 3
        assert after[other].requests == mid[other].requests

        # and a different prompt, with home no busier, is free to go anywhere;
        # its own follow-up then goes to wherever that one went
        c.generate(messages=system_prompt(SECOND_SYSTEM, "What is fact 5?"), max_tokens=2, temperature=0)
        s2 = hosts_of(c)
        second = home if s2[home].requests > after[home].requests else other
        r = c.generate(messages=system_prompt(SECOND_SYSTEM, "And fact 9?"), max_tokens=2, temperature=0)
        assert r.usage.cached_prompt_tokens > 0
        assert hosts_of(c)[second].requests == s2[second].requests + 1

        # kill home's worker mid-stream: the stream resumes on the other host
        victim = next(w for w, n in h.host_of.items() if n == home)
        got: list[int] = []
        for chunk in c.stream(messages=follow, max_tokens=40, temperature=0):
            got += chunk.token_ids
            if len(got) >= 3 and h.workers[victim].poll() is None:
                h.workers[victim].kill()
        assert got == want
        s = c.stats()
        assert s.hosts_lost == 1
        rows = {x.name: x for x in s.hosts}
        assert home not in rows and rows[other].workers == 1
        assert rows[other].requests > after[other].requests
        # nothing leaked on the host that is left
        assert rows[other].blocks_in_use == 0 and rows[other].blocks_free + rows[other].blocks_cached == \
            rows[other].blocks_total


def test_two_hosts(tmp_path: Path) -> None:
    h = Hosts(tmp_path, f"tcp://127.0.0.1:{free_port()}")
    d = h.kvd(h.connect, 3000)
    try:
        h.start(1, "A")
        h.start(2, "B")
        two_hosts_scenario(d, h)
        assert "created pool" in h.log(1) and "created pool" in h.log(2)
    finally:
        h.stop()
        _stop_checked(d)


def test_workers_refused(tmp_path: Path) -> None:
    """A worker whose key is not allowed, one without CURVE, and one whose key
    was revoked (removed, then SIGHUP) are refused, each counted; a worker
    admitted before the revocation serves on."""
    h = Hosts(tmp_path, f"tcp://127.0.0.1:{free_port()}")
    d = h.kvd(h.connect, 3000)

    def until(what: str, pred: Callable[[kvd_client.Stats], bool]) -> kvd_client.Stats:
        deadline = time.monotonic() + d.patience
        while time.monotonic() < deadline:
            s = c.stats()
            if pred(s):
                return s
            time.sleep(0.1)
        pytest.fail(f"never {what}: {c.stats()}")

    try:
        h.start(1, "A")
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            wait_hosts(c, {"A": 1}, d.patience)
            h.start(2, "B", cert="stranger")
            until("refused the stranger", lambda s: s.auth_workers_refused >= 1)
            h.start(3, "C", cert=None)
            until("failed the plain worker's handshake", lambda s: s.auth_handshakes_failed >= 1)
            (tmp_path / "allow" / "hosts.key").unlink()
            d.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + d.patience
            while "0 worker keys allowed" not in d.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = c.stats().auth_workers_refused
            h.start(4, "D")
            until("refused the revoked key", lambda s: s.auth_workers_refused > refused)
            assert {x.name for x in c.stats().hosts} == {"", "A"}
            r = c.generate("The lighthouse keeper", max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4
            assert all(h.workers[w].poll() is None for w in (2, 3, 4))    # refused, not crashed
    finally:
        h.stop()
        _stop_checked(d)


def test_fenced_worker(tmp_path: Path) -> None:
    """Two workers share host A's pool. One is stopped mid-stream: kvd declares
    it lost, resumes its request on the other, and holds the lost one's blocks
    (fenced) for a while. Continued, the lost worker hears nothing from kvd,
    drops its sequence, says Ready again and is taken back; no block leaks."""
    h = Hosts(tmp_path, f"tcp://127.0.0.1:{free_port()}", fence_ms=3000)
    d = h.kvd(h.connect, 2000)
    try:
        h.start(1, "A")
        with kvd_client.Client(d.endpoint, timeout=60) as c:
            wait_hosts(c, {"A": 1}, d.patience)
        h.start(2, "A")
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            wait_hosts(c, {"A": 2}, d.patience)
            assert len(c.stats().hosts) == 2    # one record: both workers map the same pool
            assert "joined pool" in h.log(2)
            d.measure_patience()
            msgs = system_prompt(LONG_SYSTEM, "Tell me about rule 7.")
            want = c.generate(messages=msgs, max_tokens=48, temperature=0, no_cache=True).token_ids
            got: list[int] = []
            stopped = None
            fenced_seen = 0
            for chunk in c.stream(messages=msgs, max_tokens=48, temperature=0):
                got += chunk.token_ids
                if stopped is None and len(got) >= 3:
                    busy = [w for w in c.stats().workers if w.running > 0]
                    assert len(busy) == 1
                    stopped = busy[0].id
                    os.kill(h.workers[stopped].pid, signal.SIGSTOP)
            assert got == want
            assert stopped is not None
            s = c.stats()
            fenced_seen = s.hosts[1].blocks_fenced
            assert s.blocks_fenced_total > 0, s
            os.kill(h.workers[stopped].pid, signal.SIGCONT)
            # it fences itself and comes back
            deadline = time.monotonic() + d.patience
            while "nothing from kvd" not in h.log(stopped) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "nothing from kvd" in h.log(stopped)
            wait_hosts(c, {"A": 2}, d.patience)
            # once the fence time has passed nothing is held
            deadline = time.monotonic() + d.patience
            while time.monotonic() < deadline:
                row = hosts_of(c)["A"]
                if row.blocks_fenced == 0 and row.blocks_in_use == 0:
                    break
                time.sleep(0.1)
            assert row.blocks_fenced == 0 and row.blocks_in_use == 0, (row, fenced_seen)
            assert row.blocks_free + row.blocks_cached == row.blocks_total
            r = c.generate(messages=msgs, max_tokens=8, temperature=0)
            assert r.token_ids == want[:8]
    finally:
        h.stop()
        _stop_checked(d)
