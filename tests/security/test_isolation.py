"""Isolation (issue 38, items 6-11): another local user and a kept pool, block
events and tenants' prompts, /metrics rows, the namespaces an anonymous HTTP
client may name, the tenant table under a flood, binds off loopback."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]  # ships no type information
import pytest
import zmq
import zmq.auth
import zmq.utils.monitor

import kvd_client
from conftest import (BIN_DIR, MODEL, NOBODY, OTHERS_PYTHON, Kvd, as_user, for_others, free_port, keygen, run_kvd,
                      wait_for)

BLOCK = 16


# ---- 6. a kept pool and another local user ----------------------------------------------------

def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_pool_of_another_user(tmp_path: Path, kvds: list[Kvd], nobody_tmp: Path) -> None:
    """Item 6: a kept pool (--pool) made by us is 0600: another user can neither open it to map it
    nor have kvd adopt it or kvd-worker attach to it. Made readable to others (0666), our own kvd
    refuses it as well as theirs, and none of them changes a byte of it. A pool another user made
    is refused by ours. Our kvd adopts its own 0600 pool (the control)."""
    name, theirs = f"kvdsec-{uuid.uuid4().hex[:12]}", f"kvdsec-{uuid.uuid4().hex[:12]}"
    shm, shm_theirs = Path("/dev/shm") / name, Path("/dev/shm") / theirs
    secret = "ALICE-SECRET: the merger with Contoso closes on the ninth of March."
    try:
        a = Kvd(tmp_path / "a", "--kv-memory", "16MiB", "--pool", name)
        kvds.append(a)
        with a.client() as c:
            c.generate(secret, max_tokens=2, temperature=0)
        a.stop()
        st = shm.stat()
        assert st.st_uid == os.geteuid() and (st.st_mode & 0o777) == 0o600, oct(st.st_mode)
        # the control: our kvd adopts its own pool again
        b = Kvd(tmp_path / "b", "--kv-memory", "16MiB", "--pool", name, workers=0)
        kvds.append(b)
        b.stop()
        before = _digest(shm)
        kvd, worker, model = for_others(nobody_tmp)
        mine = {"kvd": [str(kvd), "--model", str(model), "-w", "0", "--kv-memory", "16MiB",
                        "--pool", name, "--listen", f"ipc://{nobody_tmp}/kvd.sock"],
                "kvd-worker": [str(worker), "--model", str(model), "--pool", name, "--id", "1",
                               "--connect", f"ipc://{nobody_tmp}/workers.sock"]}
        # another user: no mapping of their own, no kvd, no worker
        r = as_user([OTHERS_PYTHON, "-c", f"import mmap; f = open('/dev/shm/{name}', 'r+b'); "
                     "mmap.mmap(f.fileno(), 0)"])
        assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr
        for what, cmd in mine.items():
            r = as_user(cmd)
            assert r.returncode != 0 and f"pool /{name}" in r.stderr and "Permission denied" in r.stderr, \
                (what, r.stderr)
        assert _digest(shm) == before
        # the pool made readable and writable to others: refused by everyone, changed by no one
        shm.chmod(0o666)
        r = run_kvd("-w", "0", "--kv-memory", "16MiB", "--pool", name, "--listen", f"ipc://{tmp_path}/c/kvd.sock")
        assert r.returncode == 1 and f"pool /{name} has mode 0666: other users can map it" in r.stderr, r.stderr
        for what, cmd in mine.items():
            r = as_user(cmd)
            assert r.returncode != 0 and \
                f"pool /{name} belongs to uid {os.geteuid()}, not to this user (uid {NOBODY})" in r.stderr, \
                (what, r.stderr)
        assert _digest(shm) == before
        # a segment another user made (0600, theirs): our kvd and worker refuse it, though root could map it
        r = as_user([OTHERS_PYTHON, "-c", f"import os; fd = os.open('/dev/shm/{theirs}', "
                     "os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600); os.ftruncate(fd, 16 << 20)"])
        assert r.returncode == 0, r.stderr
        assert shm_theirs.stat().st_uid == NOBODY
        r = run_kvd("-w", "0", "--kv-memory", "16MiB", "--pool", theirs, "--listen",
                    f"ipc://{tmp_path}/d/kvd.sock")
        assert r.returncode == 1 and \
            f"pool /{theirs} belongs to uid {NOBODY}, not to this user (uid {os.geteuid()})" in r.stderr, r.stderr
        r = run_worker("--pool", theirs, "--id", "1", "--connect", f"ipc://{tmp_path}/d/workers.sock")
        assert r.returncode != 0 and f"pool /{theirs} belongs to uid {NOBODY}" in r.stderr, r.stderr
        assert shm_theirs.read_bytes() == bytes(16 << 20)
    finally:
        shm.unlink(missing_ok=True)
        shm_theirs.unlink(missing_ok=True)


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    """kvd-worker expected to stop at its checks: its exit status and output."""
    return subprocess.run([str(BIN_DIR / "kvd-worker"), "--model", str(MODEL), *args], capture_output=True,
                          text=True, timeout=120)


# ---- 7. block events ----------------------------------------------------------------------------

class Events:
    """A SUB of kvd's block events (vLLM's format: topic, sequence, msgpack [ts, events]), optionally
    with CURVE keys, and a monitor of its handshakes."""

    def __init__(self, endpoint: str, server_key: Path | None = None, cert: Path | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key is not None:
            self.sock.curve_serverkey = zmq.auth.load_certificate(str(server_key))[0]
        if cert is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.auth.load_certificate(str(cert))
        self.mon = self.sock.get_monitor_socket(zmq.EVENT_ALL)
        self.sock.connect(endpoint)
        self.stored: list[tuple[list[int], list[int]]] = []     # (hashes, token ids) of each BlockStored
        self.messages = 0
        self.handshakes_failed = 0
        self.handshakes_ok = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        failed = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                  zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        while not self._stop.is_set():
            for s, _ in poller.poll(50):
                if s is self.mon:
                    ev = zmq.utils.monitor.recv_monitor_message(self.mon)
                    with self._lock:
                        self.handshakes_failed += bool(ev["event"] & failed)
                        self.handshakes_ok += ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
                    continue
                frames = self.sock.recv_multipart()
                batch = msgpack.unpackb(frames[2], raw=False)
                with self._lock:
                    self.messages += 1
                    for ev in batch[1]:
                        if ev[0] == "BlockStored":
                            self.stored.append((list(ev[1]), list(ev[3])))

    def blocks(self) -> int:
        """Blocks stored so far."""
        with self._lock:
            return sum(len(h) for h, _ in self.stored)

    def snapshot(self) -> list[tuple[list[int], list[int]]]:
        with self._lock:
            return list(self.stored)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.mon.close(0)
        self.sock.close(0)
        self.ctx.term()


def _windows(ids: list[int]) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + BLOCK]) for i in range(len(ids) - BLOCK + 1)}


ALICE = ("ALICE-SECRET: the merger with Contoso closes on the ninth of March at a price of forty-one "
         "dollars a share, and nobody outside the board may know it before the announcement.")
PUBLIC = ("Lighthouses stand on rocky coasts and guide ships at night with a rotating lamp whose "
          "pattern of flashes tells sailors which light they are looking at, even on the darkest and "
          "stormiest nights of the long northern winter.")


def test_events_carry_no_tenant_tokens(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 7: a tenant's blocks go out in the block events without their token ids (a subscriber
    rebuilt alice's prompt from them), and so do the blocks of any named namespace; the default
    namespace's blocks still carry theirs (the control: the subscriber does see token ids)."""
    ep = f"ipc://{tmp_path}/events/events.sock"
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", "--kv-events", ep)
    kvds.append(k)
    sub = Events(ep)
    try:
        with k.client() as c:
            # a PUB drops what comes before the subscription takes hold: wait until events arrive
            wait_for("the subscriber receiving events", lambda: (
                c.generate(f"Warm-up {time.monotonic_ns()} " * 20, max_tokens=1, temperature=0)
                and sub.blocks() > 0), every=0.2)
            alice = c.tokenize(ALICE)
            public = c.tokenize(PUBLIC)
            assert len(alice) >= 2 * BLOCK and len(public) >= 2 * BLOCK
            n0 = sub.blocks()
            # alice's request as the HTTP API sends it for her key (and as a CURVE tenant's is kept)
            ra = c.generate(ALICE, max_tokens=2, temperature=0, namespace="tenant:alice/")
            rn = c.generate(ALICE, max_tokens=2, temperature=0, namespace="my-team")
            rp = c.generate(PUBLIC, max_tokens=2, temperature=0)
            want = sum((r.usage.prompt_tokens - 1) // BLOCK for r in (ra, rn, rp))
            wait_for("the three prompts' blocks in the events", lambda: sub.blocks() >= n0 + want)
        stored = sub.snapshot()
        secret = _windows(alice)
        shown = [t for _, t in stored if t]
        leaked = [t for t in shown for i in range(0, len(t), BLOCK) if tuple(t[i:i + BLOCK]) in secret]
        if leaked:
            with k.client() as c:
                pytest.fail(f"alice's token ids in the events: {c.detokenize(leaked[0])!r}")
        assert any(tuple(t[i:i + BLOCK]) in _windows(public) for t in shown for i in range(0, len(t), BLOCK)), \
            "the default namespace's blocks should carry their token ids"
        assert sum(len(h) for h, t in stored if not t) >= 2 * ((len(alice) - 1) // BLOCK)
    finally:
        sub.close()
    k.stop()



def test_tcp_events_need_keys(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 7: tcp:// --kv-events needs --curve-secret (subscribers admitted by key from
    --events-allow) or an explicit --insecure; under CURVE an allowed key reads the events while a
    key not allowed and a plain subscriber fail their handshakes and receive nothing."""
    port = free_port()
    r = run_kvd("-w", "0", "--kv-memory", "16MiB", "--listen", f"ipc://{tmp_path}/plain/kvd.sock",
                "--kv-events", f"tcp://127.0.0.1:{port}")
    assert r.returncode == 1 and "tcp:// needs --curve-secret" in r.stderr and "--insecure" in r.stderr, r.stderr
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    keygen(keys, "kvd", "router", "stranger")
    allow.mkdir()
    (allow / "router.key").write_bytes((keys / "router.key").read_bytes())
    ep = f"tcp://127.0.0.1:{port}"
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", "--kv-events", ep, "--curve-secret",
            str(keys / "kvd.key_secret"), "--events-allow", str(allow))
    kvds.append(k)
    router = Events(ep, keys / "kvd.key", keys / "router.key_secret")
    stranger = Events(ep, keys / "kvd.key", keys / "stranger.key_secret")
    plain = Events(ep)
    try:
        with k.client() as c:
            wait_for("the allowed subscriber receiving events", lambda: (
                c.generate(f"Warm-up {time.monotonic_ns()} " * 20, max_tokens=1, temperature=0)
                and router.blocks() > 0), every=0.2)
            wait_for("the other two refused", lambda: stranger.handshakes_failed and plain.handshakes_failed)
            n0 = router.blocks()
            res = c.generate(PUBLIC, max_tokens=2, temperature=0)
            wait_for("the prompt's blocks at the allowed subscriber",
                     lambda: router.blocks() >= n0 + (res.usage.prompt_tokens - 1) // BLOCK)
        assert stranger.messages == 0 and stranger.handshakes_ok == 0
        assert plain.messages == 0 and plain.handshakes_ok == 0
    finally:
        for s in (router, stranger, plain):
            s.close()
    k.stop()
    # --insecure: published to whoever reaches it, and said so
    k = Kvd(tmp_path / "insecure", "--kv-memory", "16MiB", "--kv-events", f"tcp://127.0.0.1:{free_port()}",
            "--insecure", workers=0)
    kvds.append(k)
    assert "INSECURE: anyone who reaches" in k.log()
    k.stop()


# ---- 8. /metrics --------------------------------------------------------------------------------

def _tenant_rows(m: dict[str, float]) -> set[str]:
    """The tenants /metrics has rows for."""
    return {name.split('tenant="', 1)[1].split('"', 1)[0] for name in m if name.startswith("kvd_tenant_")}


def test_metrics_rows_per_key(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 8: /metrics lists every tenant's rows for --operator-key, a tenant's own for its API key,
    none for an anonymous client or a wrong key (it listed every tenant's requests, tokens, cached
    tokens and blocks to anyone)."""
    keys = tmp_path / "keys"
    keys.write_text("key-of-alice-0001 alice\nkey-of-bob-000001 bob\n")
    op = tmp_path / "operator"
    op.write_text("operator-key-00000001\n")
    op.chmod(0o600)
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", "--api-keys", str(keys), "--operator-key", str(op), http=True)
    kvds.append(k)
    for key in ("key-of-alice-0001", "key-of-bob-000001", "key-of-bob-000001"):
        s, b = k.post("/v1/completions", {"prompt": ALICE, "max_tokens": 2, "temperature": 0}, key=key)
        assert s == 200, b
    everyone = k.metrics("operator-key-00000001")
    assert _tenant_rows(everyone) == {"alice", "bob"}
    assert everyone['kvd_tenant_requests_total{tenant="bob"}'] == 2
    assert everyone['kvd_tenant_requests_total{tenant="alice"}'] == 1
    alice = k.metrics("key-of-alice-0001")
    assert _tenant_rows(alice) == {"alice"}
    assert alice['kvd_tenant_requests_total{tenant="alice"}'] == 1
    assert _tenant_rows(k.metrics("key-of-bob-000001")) == {"bob"}
    for other in (None, "not-a-key-0000001", "operator-key-0000000"):
        m = k.metrics(other)
        assert _tenant_rows(m) == set(), (other, _tenant_rows(m))
        assert "kvd_http_connections" in m      # the rest is there for every one
    k.stop()


# ---- 9. namespaces an anonymous HTTP client may name ----------------------------------------------

def _cached(b: Any) -> int:
    return int(b["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


def test_anonymous_cannot_name_tenant_namespaces(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 9: without --api-keys, an HTTP request that names a "tenant:" or "public:" namespace is a
    400 (it hit a CURVE tenant's cache, 176 of 185 tokens, and was counted as that tenant); names
    that only resemble them are namespaces of their own, with nothing of alice's; with API keys a
    key's request naming another tenant stays inside its own tenant."""
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", http=True)
    kvds.append(k)
    with k.client() as c:
        # alice's prompt in her namespace, as a CURVE tenant's (or an API key's) is kept
        first = c.generate(ALICE, max_tokens=2, temperature=0, namespace="tenant:alice/")
        again = c.generate(ALICE, max_tokens=2, temperature=0, namespace="tenant:alice/")
        assert again.usage.cached_prompt_tokens >= first.usage.prompt_tokens - 2 * BLOCK    # it is cached
    req = {"prompt": ALICE, "max_tokens": 2, "temperature": 0}
    for ns in ("tenant:alice/", "tenant:alice", "tenant:", "public:", "public:shared/"):
        s, b = k.post("/v1/completions", {**req, "namespace": ns})
        assert s == 400 and b["error"]["param"] == "namespace", (ns, s, b)
        s, b = k.post("/v1/chat/completions", {"messages": [{"role": "user", "content": ALICE}], "max_tokens": 2,
                                               "namespace": ns})
        assert s == 400, (ns, s, b)
    for ns in ("Tenant:alice/", " tenant:alice/", "alice", "x/tenant:alice/"):
        s, b = k.post("/v1/completions", {**req, "namespace": ns})
        assert s == 200 and _cached(b) == 0, (ns, s, b)
    rows = {t.name: t for t in k.stats().tenants}
    assert set(rows) == {"alice"} and rows["alice"].requests == 2, rows
    k.stop()
    # with API keys: bob naming alice's namespace is inside bob's
    keys = tmp_path / "keys"
    keys.write_text("key-of-bob-000001 bob\n")
    k = Kvd(tmp_path / "keyed", "--kv-memory", "32MiB", "--api-keys", str(keys), http=True)
    kvds.append(k)
    with k.client() as c:
        c.generate(ALICE, max_tokens=2, temperature=0, namespace="tenant:alice/")
    s, b = k.post("/v1/completions", {**req, "namespace": "tenant:alice/"}, key="key-of-bob-000001")
    assert s == 200 and _cached(b) == 0, b
    rows = {t.name: t for t in k.stats().tenants}
    assert rows["alice"].requests == 1 and rows["bob"].requests == 1, rows
    k.stop()


# ---- 10. the tenant table under a flood -------------------------------------------------------------

def _note(i: int, words: int) -> str:
    return " ".join(f"n{i}w{j}" for j in range(words))


def test_tenant_table_flood(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 10: 4,100 invalid requests with "tenant:fakeN/" namespaces (a bad token id, or a prompt over
    the tenant's block limit) over ZeroMQ, and 4,100 anonymous ones over HTTP, leave no entry in the
    tenant table (they filled its 4,096 entries in a second); a tenant that comes later is accounted
    and held to --tenant-max-blocks 4; once --max-tenants (2) tenants hold blocks, a new one is
    refused OVERLOADED, not served unaccounted."""
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", "--tenant-max-blocks", "4", "--max-tenants", "2",
            http=True)
    kvds.append(k)
    with k.client() as c:
        long = _note(0, 40)
        assert len(c.tokenize(long)) + 1 > 4 * BLOCK
        for i in range(4100):
            with pytest.raises((kvd_client.BadRequest, kvd_client.TooLong)):
                if i % 2:
                    c.generate(token_ids=[10 ** 7], max_tokens=1, namespace=f"tenant:fake{i}/")
                else:
                    c.generate(long, max_tokens=1, namespace=f"tenant:fake{i}/")
        assert c.stats().tenants == []
    h = http.client.HTTPConnection("127.0.0.1", k.port, timeout=k.patience)
    try:
        for i in range(4100):
            h.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1,
                                                             "namespace": f"tenant:fake{i}/"}),
                      {"Content-Type": "application/json"})
            r = h.getresponse()
            r.read()
            assert r.status == 400, r.status
    finally:
        h.close()
    with k.client() as c:
        assert c.stats().tenants == []
        # alice comes later: accounted, and held to her 4 blocks (prompts of 3 full blocks each)
        prompts = [next(p for w in range(4, 40) if len(c.tokenize(p := _note(i, w))) >= 3 * BLOCK)
                   for i in range(1, 5)]
        for p in prompts:
            assert len(c.tokenize(p)) + 1 <= 4 * BLOCK, p
            c.generate(p, max_tokens=1, temperature=0, namespace="tenant:alice/")
        with pytest.raises(kvd_client.TooLong, match="--tenant-max-blocks"):
            c.generate(long, max_tokens=1, namespace="tenant:alice/")
        rows = {t.name: t for t in c.stats().tenants}
        assert set(rows) == {"alice"} and rows["alice"].requests == 4, rows
        assert 0 < rows["alice"].blocks_held <= 4, rows["alice"]
        # bob fills the table (two tenants with blocks); carol finds no entry: refused, not served
        c.generate(prompts[0], max_tokens=1, temperature=0, namespace="tenant:bob/")
        done = c.stats().requests_done
        with pytest.raises(kvd_client.Overloaded, match="--max-tenants"):
            c.generate(prompts[1], max_tokens=1, temperature=0, namespace="tenant:carol/")
        rows = {t.name: t for t in c.stats().tenants}
        assert set(rows) == {"alice", "bob"}, rows
        assert c.stats().requests_done == done
    k.stop()


# ---- 11. binds off loopback ---------------------------------------------------------------------------

def _other_interface() -> str | None:
    """A network interface that is not the loopback one (eth0...), or None."""
    for _, name in socket.if_nameindex():
        if not int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & 0x8:    # IFF_LOOPBACK
            return name
    return None


FLAGS = {  # how each endpoint is given, what kvd needs besides it, loopback hosts it takes
    "--listen": ("tcp://{}", ("--insecure",), ("lo", "127.0.0.1")),
    "--worker-endpoint": ("tcp://{}", ("--insecure",), ("lo", "127.0.0.1")),
    "--kv-events": ("tcp://{}", ("--insecure",), ("lo", "127.0.0.1")),
    "--http": ("{}", (), ("localhost", "127.0.0.1")),     # --http takes IPv4 addresses and localhost
}


@pytest.mark.parametrize("flag", list(FLAGS))
def test_binds_off_loopback_refused(tmp_path: Path, kvds: list[Kvd], flag: str) -> None:
    """Item 11: "0", "*", "0.0.0.0", "[::]" and a network interface's name (eth0) bind more than loopback,
    and are refused without --allow-remote for --listen, --worker-endpoint, --kv-events and --http
    alike (tcp://0:PORT and tcp://eth0:PORT passed the check); the loopback interface's name (localhost
    for --http) and a loopback address are taken (the control)."""
    form, extra, loopback = FLAGS[flag]
    port = free_port()
    hosts = ["0", "*", "0.0.0.0", "[::]"]
    nic = _other_interface()
    if nic is not None:
        hosts.append(nic)
    for i, host in enumerate(hosts):
        ep = form.format(f"{host}:{port}")
        r = run_kvd("-w", "0", "--kv-memory", "16MiB", "--listen", f"ipc://{tmp_path}/r{i}/kvd.sock", flag, ep,
                    *extra)
        assert r.returncode == 1 and f"{flag} {ep}" in r.stderr and "other machines could reach it" in r.stderr \
            and "--allow-remote" in r.stderr, (ep, r.stderr)
    # the control: the loopback interface's name, and an address of loopback, are taken
    for i, host in enumerate(loopback):
        port = free_port()
        ep = form.format(f"{host}:{port}")
        k = Kvd(tmp_path / f"ok{i}", "--kv-memory", "16MiB", flag, ep, *extra, workers=0, listen=flag != "--listen",
                ready=False)
        kvds.append(k)
        if flag == "--listen":
            k.endpoint = f"tcp://127.0.0.1:{port}"     # a connect takes no interface name
        k.wait_ready()
        assert "other machines could reach it" not in k.log()
        k.stop()
    if nic is None:
        pytest.skip("no network interface but loopback here: the interface-name case was not tried")


# ---- web pages elsewhere (the second review's finding 4) --------------------------------------------

def _raw_status(port: int, req: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
        c.sendall(req)
        head = b""
        while b"\r\n" not in head:
            got = c.recv(4096)
            if not got:
                break
            head += got
    return int(head.split(b" ", 2)[1])


def test_cross_site_requests_refused(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Without --api-keys, a web page the local user opens elsewhere could post to kvd on loopback
    (a body with no Content-Type needs no preflight) or read /pool through a name rebound to
    127.0.0.1. A POST without Content-Type is a 415; a request whose Host is not a loopback name a
    403, before anything runs; the loopback names pass."""
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", http=True)
    kvds.append(k)
    body = b'{"prompt": "hi", "max_tokens": 1}'

    def post(host: str, ctype: str | None) -> int:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        if ctype is not None:
            head += f"Content-Type: {ctype}\r\n"
        head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        return _raw_status(k.port, head.encode() + body)

    def get(path: str, host: str) -> int:
        return _raw_status(k.port, f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())

    assert post("127.0.0.1", None) == 415
    assert post("127.0.0.1", "text/plain") == 415
    assert post(f"evil.example:{k.port}", "application/json") == 403
    assert get("/pool", "rebound.example") == 403
    assert get("/", f"rebound.example:{k.port}") == 403
    for host in ("localhost", f"localhost:{k.port}", "127.0.0.1", f"127.0.0.2:{k.port}", f"[::1]:{k.port}"):
        assert get("/health", host) == 200, host
    assert post(f"localhost:{k.port}", "application/json") == 200
