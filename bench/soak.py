#!/usr/bin/env python3
"""A soak of kvd under mixed and hostile load, run by hand (best under
ASan+UBSan): does everything kvd holds come back to where it was?

    python3 bench/soak.py --bin-dir build-asan --minutes 30

One kvd with two workers, the HTTP API with three API-key tenants (one of them
pressing against --tenant-max-blocks), the host and disk tiers, and at once:

  - chat requests over HTTP, whole and streamed, sharing system prompts;
  - streams dropped after a few chunks, whole requests whose client leaves
    after 0.2 s (kvd must cancel both);
  - requests over ZeroMQ (the Python client), streams broken off;
  - bad input: malformed JSON, a wrong API key, unknown fields, a 4 MiB body
    of junk, connections that send half a head and stop, idle connections;
  - every 40 s a worker SIGKILLed (kvd restarts it) or SIGSTOPped past
    --worker-timeout and continued.

After a warm-up (a tenth of the run, at most 3 minutes) the load pauses until
kvd is idle and the baseline is taken: kvd's RSS, descriptors, threads, the
pool's referenced and pending blocks. At the end the load stops, kvd goes
idle again, and the same figures are taken. The report prints both, the
requests by outcome, and the sanitizer reports found in kvd's log (kvd's and
its workers' standard error). Exit status 1 when descriptors, threads or
held blocks did not come back, RssAnon less the host tier's bytes grew by more than --rss-slack, kvd died,
or a sanitizer reported anything.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import kvd_client  # pip install ./clients/python

ROOT = Path(__file__).resolve().parents[1]

TENANTS = {"key-alice-0001": "alice", "key-bob-0002": "bob", "key-carol-0003": "carol"}
OPERATOR = "key-operator-0000"
SYSTEMS = [
    " ".join(f"Rule {i} of house {h}: answer topic {i} briefly and cite section {i * 7 % 50}."
             for i in range(1, 30))
    for h in range(4)
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fd_targets(pid: int) -> Counter[str]:
    """What kvd's descriptors point at, sockets and pipes by kind only."""
    out: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        out[re.sub(r"\[\d+\]", "", t)] += 1
    return out


def proc_figures(pid: int) -> dict[str, int]:
    """kvd's private resident memory (RssAnon: the pool's shared pages, which
    kvd touches as blocks are used, are not its growth), descriptors, threads."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                rss = int(line.split()[1]) * 1024
    return {
        "rss": rss,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
    }


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix="kvd-soak-"))
        self.dir.chmod(0o700)
        self.port = free_port()
        self.endpoint = f"ipc://{self.dir}/kvd.sock"
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.go = threading.Event()      # set: load runs; clear: load pauses
        self.paused: set[str] = set()
        self.rng = random.Random(args.seed)
        self.fds_at: dict[int, Counter[str]] = {}
        self.model = "?"
        self.examples: dict[str, str] = {}

    # ---- kvd -------------------------------------------------------------------------------

    def start(self) -> None:
        keys = self.dir / "keys"
        keys.write_text("".join(f"{k} {t}\n" for k, t in TENANTS.items()))
        op = self.dir / "operator"
        op.write_text(OPERATOR + "\n")
        cache = self.dir / "disk"
        cache.mkdir(mode=0o700)
        env = dict(os.environ)
        env.setdefault("ASAN_OPTIONS", "detect_leaks=1:quarantine_size_mb=64")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")
        cmd = [
            str(self.args.bin_dir / "kvd"), "--model", str(self.args.model), "--listen", self.endpoint,
            "--workers", "2", "--threads", "1", "--ctx", "2048", "--kv-memory", "192MiB",
            "--http", f"127.0.0.1:{self.port}", "--api-keys", str(keys), "--operator-key", str(op),
            "--tenant-max-blocks", "25%", "--max-restarts", "-1", "--worker-timeout", "3000",
            "--host-cache", "64MiB", "--cache-dir", str(cache), "--disk-cache", "64MiB",
            "--http-timeout", "10", "--max-body", "8MiB",
        ]
        self.log = open(self.dir / "kvd.log", "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while True:
            assert self.proc.poll() is None, f"kvd exited at start: see {self.dir}/kvd.log"
            try:
                with kvd_client.Client(self.endpoint, timeout=2) as c:
                    h = c.health()
                    if h.workers_alive >= 2:
                        break
            except kvd_client.KvdError:
                pass
            assert time.monotonic() < deadline, "kvd not ready after 600 s"
            time.sleep(0.5)
        st, body = self.http("GET", "/v1/models", None, "key-alice-0001")
        assert st == 200, (st, body)
        self.model = json.loads(body)["data"][0]["id"]

    def stats(self) -> kvd_client.Stats:
        with kvd_client.Client(self.endpoint, timeout=60) as c:
            return c.stats()

    def quiet_figures(self) -> dict[str, int]:
        """Pauses the load, waits until kvd runs and queues nothing and every
        worker is alive, then takes the figures."""
        self.go.clear()
        deadline = time.monotonic() + 900
        while True:
            s = self.stats()
            alive = sum(1 for w in s.workers if w.alive)
            if (len(self.paused) == self.n_threads and s.requests_running == 0
                    and s.requests_queued == 0 and alive == 2 and s.disk_cache_pending == 0):
                break
            assert time.monotonic() < deadline, f"kvd not idle after 900 s: {s}"
            time.sleep(1)
        time.sleep(self.args.settle)     # idle connections time out, pooled threads park
        s = self.stats()
        fig = proc_figures(self.proc.pid)
        self.fds_at[len(self.fds_at)] = fd_targets(self.proc.pid)
        fig["blocks_held"] = s.blocks_in_use + s.blocks_pending
        fig["blocks_cached"] = s.blocks_cached
        fig["host_cache_bytes"] = s.host_cache_bytes
        fig["rss_less_host_cache"] = fig["rss"] - s.host_cache_bytes
        fig["requests_done"] = s.requests_done
        fig["requests_failed"] = s.requests_failed
        return fig

    # ---- load ------------------------------------------------------------------------------

    def count(self, what: str, body: bytes | None = None) -> None:
        with self.lock:
            self.outcomes[what] += 1
            if body is not None and what not in self.examples:
                self.examples[what] = body[:300].decode(errors="replace")

    def gate(self, name: str) -> bool:
        """False when the run is over; blocks while the load is paused."""
        while not self.go.is_set():
            self.paused.add(name)
            if self.stop.is_set():
                return False
            time.sleep(0.2)
        self.paused.discard(name)
        return not self.stop.is_set()

    def http(self, method: str, path: str, body: object | None, key: str | None,
             timeout: float = 600) -> tuple[int, bytes]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"}
            if key:
                headers["Authorization"] = f"Bearer {key}"
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            c.request(method, path, body=data, headers=headers)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def chat_body(self, rng: random.Random, stream: bool) -> dict[str, object]:
        return {
            "model": self.model, "stream": stream, "temperature": rng.choice([0, 0.8]),
            "max_tokens": rng.randint(1, 24), "seed": rng.randint(0, 1 << 40),
            "messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                         {"role": "user", "content": f"Question {rng.randint(0, 999)}: what now?"}],
        }

    def http_whole(self, name: str) -> None:
        rng = random.Random(hash(name))
        while self.gate(name):
            key = rng.choice(list(TENANTS))
            try:
                st, body = self.http("POST", "/v1/chat/completions", self.chat_body(rng, False), key)
                self.count(f"http whole {st}", body if st != 200 else None)
            except OSError as e:
                self.count(f"http whole {type(e).__name__}")

    def http_leavers(self, name: str) -> None:
        """Streams dropped after a few chunks; whole requests left after 0.2 s."""
        rng = random.Random(hash(name))
        while self.gate(name):
            key = rng.choice(list(TENANTS))
            body = self.chat_body(rng, rng.random() < 0.5)
            body["max_tokens"] = 200
            s = socket.create_connection(("127.0.0.1", self.port), timeout=600)
            try:
                data = json.dumps(body).encode()
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          + f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
                if body["stream"]:
                    got = b""
                    while got.count(b"data:") < rng.randint(1, 4):
                        more = s.recv(4096)
                        if not more:
                            break
                        got += more
                    self.count("http stream dropped")
                else:
                    time.sleep(0.2)
                    self.count("http whole left")
            except OSError as e:
                self.count(f"http leaver {type(e).__name__}")
            finally:
                s.close()

    def zmq_load(self, name: str) -> None:
        rng = random.Random(hash(name))
        with kvd_client.Client(self.endpoint, timeout=600) as c:
            while self.gate(name):
                try:
                    if rng.random() < 0.5:
                        r = c.generate(messages=[{"role": "system", "content": rng.choice(SYSTEMS)},
                                                 {"role": "user", "content": "Tell me one rule."}],
                                       max_tokens=rng.randint(1, 16), temperature=0.7,
                                       seed=rng.randint(0, 1 << 30))
                        self.count(f"zmq whole {r.finish_reason}")
                    else:
                        with c.stream(prompt=rng.choice(SYSTEMS), max_tokens=64) as s:
                            for i, _ in enumerate(s):
                                if i >= 2:
                                    break
                        self.count("zmq stream broken off")
                except kvd_client.KvdError as e:
                    self.count(f"zmq {type(e).__name__}")

    def tenant_at_limit(self, name: str) -> None:
        """carol: long prompts none other shares, against --tenant-max-blocks."""
        rng = random.Random(hash(name))
        while self.gate(name):
            words = " ".join(str(rng.randint(0, 10**6)) for _ in range(150))
            try:
                st, body = self.http("POST", "/v1/completions",
                                     {"model": self.model, "prompt": words, "max_tokens": 1}, "key-carol-0003")
                self.count(f"tenant limit {st}", body if st != 200 else None)
            except OSError as e:
                self.count(f"tenant limit {type(e).__name__}")

    def hostile(self, name: str) -> None:
        rng = random.Random(hash(name))
        idle: list[socket.socket] = []
        while self.gate(name):
            kind = rng.randrange(6)
            try:
                if kind == 0:
                    st, _ = self.http("POST", "/v1/chat/completions", b"{not json", "key-bob-0002")
                elif kind == 1:
                    st, _ = self.http("POST", "/v1/chat/completions", self.chat_body(rng, False), "wrong-key")
                elif kind == 2:
                    body = self.chat_body(rng, False)
                    body["no_such_field"] = 1
                    st, _ = self.http("POST", "/v1/chat/completions", body, "key-bob-0002")
                elif kind == 3:
                    st, _ = self.http("POST", "/v1/completions",
                                      b'{"prompt":[' + b"1," * (2 << 20) + b"1]}", None)
                elif kind == 4:     # half a head, then nothing (kvd closes it after --http-timeout)
                    s = socket.create_connection(("127.0.0.1", self.port))
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
                    idle.append(s)
                    st = "half-head"
                else:               # connected, silent
                    idle.append(socket.create_connection(("127.0.0.1", self.port)))
                    st = "idle"
                self.count(f"hostile {kind} {st}")
            except OSError as e:
                self.count(f"hostile {kind} {type(e).__name__}")
            while len(idle) > 64:
                idle.pop(0).close()
            time.sleep(0.05)
        for s in idle:
            s.close()

    def chaos(self, name: str) -> None:
        rng = random.Random(hash(name))
        while self.gate(name):
            t_end = time.monotonic() + self.args.chaos_every
            while time.monotonic() < t_end and self.go.is_set() and not self.stop.is_set():
                time.sleep(0.2)
            if not self.go.is_set() or self.stop.is_set():
                continue
            try:
                live = [w.pid for w in self.stats().workers if w.alive and w.pid > 0]
            except kvd_client.KvdError:
                continue
            if not live:
                continue
            pid = rng.choice(live)
            try:
                if rng.random() < 0.5:
                    os.kill(pid, signal.SIGKILL)
                    self.count("chaos SIGKILL")
                else:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(5)
                    os.kill(pid, signal.SIGCONT)
                    self.count("chaos SIGSTOP 5 s")
            except ProcessLookupError:
                pass

    # ---- the run -----------------------------------------------------------------------------

    def run(self) -> int:
        self.start()
        plan = [(self.http_whole, 3), (self.http_leavers, 2), (self.zmq_load, 2),
                (self.tenant_at_limit, 1), (self.hostile, 1), (self.chaos, 1)]
        threads = []
        for fn, n in plan:
            for i in range(n):
                name = f"{fn.__name__}-{i}"
                threads.append(threading.Thread(target=fn, args=(name,), name=name, daemon=True))
        self.n_threads = len(threads)
        total = self.args.minutes * 60
        warm = min(total / 10, 180)
        t0 = time.monotonic()
        self.go.set()
        for t in threads:
            t.start()
        time.sleep(warm)
        base = self.quiet_figures()
        print(f"baseline after {warm:.0f} s: {base}", flush=True)
        self.go.set()
        while time.monotonic() - t0 < total:
            time.sleep(10)
            if self.proc.poll() is not None:
                break
            f = proc_figures(self.proc.pid)
            print(f"t={time.monotonic() - t0:6.0f} s  rss {f['rss'] / 2**20:7.1f} MiB  fds {f['fds']:4d}  "
                  f"threads {f['threads']:3d}  outcomes {sum(self.outcomes.values())}", flush=True)
        died = self.proc.poll() is not None
        end = {} if died else self.quiet_figures()
        self.stop.set()
        self.go.set()
        for t in threads:
            t.join(timeout=700)
        if not died:
            self.proc.send_signal(signal.SIGTERM)
            rc = self.proc.wait(timeout=120)
        else:
            rc = self.proc.returncode
        log = (self.dir / "kvd.log").read_text(errors="replace")
        reports = re.findall(r"ERROR: (?:Address|Leak)Sanitizer[^\n]*|runtime error:[^\n]*", log)
        return self.report(base, end, died, rc, reports, time.monotonic() - t0)

    def report(self, base: dict[str, int], end: dict[str, int], died: bool, rc: int,
               reports: list[str], secs: float) -> int:
        print(f"\nkvd soak: {secs / 60:.1f} minutes, {self.args.bin_dir}, log {self.dir}/kvd.log")
        print("requests by outcome:")
        for k, v in sorted(self.outcomes.items()):
            print(f"  {v:7d}  {k}" + (f"   e.g. {self.examples[k]}" if k in self.examples else ""))
        bad = []
        if died:
            bad.append(f"kvd died (status {rc})")
        else:
            print("\n| figure | baseline | end |")
            print("|---|---|---|")
            for k in base:
                print(f"| {k} | {base[k]:,} | {end[k]:,} |")
            for k in ("fds", "threads"):
                if end[k] != base[k]:
                    bad.append(f"{k}: {base[k]} -> {end[k]}")
            if end["fds"] != base["fds"]:
                a, b = self.fds_at[0], self.fds_at[1]
                print("descriptors that changed:", {t: b[t] - a[t] for t in a | b if a[t] != b[t]})
            if end["blocks_held"] != 0:
                bad.append(f"{end['blocks_held']} blocks held with nothing running")
            r0, r1 = base["rss_less_host_cache"], end["rss_less_host_cache"]
            if r1 - r0 > max(r0 * self.args.rss_slack, 4 << 20):
                bad.append(f"RssAnon less the host tier {r0 / 2**20:.1f} -> {r1 / 2**20:.1f} MiB")
            if rc != 0:
                bad.append(f"kvd exited with status {rc} on SIGTERM")
        print(f"\nsanitizer reports: {len(reports)}")
        for r in reports[:20]:
            print("  " + r)
        if reports:
            bad.append(f"{len(reports)} sanitizer reports")
        print("result: " + ("PASS" if not bad else "FAIL: " + "; ".join(bad)))
        return 0 if not bad else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build-asan")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--chaos-every", type=float, default=40, help="seconds between worker kills/stops")
    ap.add_argument("--settle", type=float, default=12, help="seconds idle before figures (> --http-timeout)")
    ap.add_argument("--rss-slack", type=float, default=0.10, help="RssAnon growth allowed, a fraction (at least 4 MiB)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    args.bin_dir = args.bin_dir.resolve()
    soak = Soak(args)
    try:
        return soak.run()
    finally:
        p = getattr(soak, "proc", None)
        if p is not None and p.poll() is None:
            p.kill()


if __name__ == "__main__":
    sys.exit(main())
