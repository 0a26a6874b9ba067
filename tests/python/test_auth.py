"""Who may talk to kvd over tcp:// (kvd --curve-secret, --clients-allow):
CURVE keys made by kvd-keygen, checked by kvd's ZAP handler. An allowed key
is served, under a tenant named after its file, whose cache no other tenant
shares; a key not allowed, a client without keys and a client with the wrong
server key each fail with AuthenticationFailed at once (not a timeout), and
kvd counts them; a key removed and announced by SIGHUP is refused from its
next connection; plain tcp:// needs an explicit --insecure."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN_DIR, MODEL, Daemon, _stop_checked

import kvd_client

SYSTEM = " ".join(
    f"Note {i}: the vault of hall {i} opens at hour {i % 12 + 1} and holds ledger {i * 7}."
    for i in range(14)
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def keygen(d: Path, name: str) -> None:
    subprocess.run([str(BIN_DIR / "kvd-keygen"), "--dir", str(d), name], check=True, capture_output=True)


def key_dirs(tmp_path: Path, allowed: tuple[str, ...], others: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """keys/ with a key pair for kvd and each name, allow/ with the allowed names' public keys."""
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    keys.mkdir()
    allow.mkdir()
    for name in ("kvd", *allowed, *others):
        keygen(keys, name)
    for name in allowed:
        (allow / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    return keys, allow


def ask(c: kvd_client.Client, q: int = 0, ns: str | None = None) -> kvd_client.Result:
    return c.generate(messages=[{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": f"When does hall {q} open?"}],
                      max_tokens=4, temperature=0, namespace=ns)


def wait_log(d: Daemon, text: str, count: int, patience: float) -> None:
    deadline = time.monotonic() + patience
    while d.log().count(text) < count:
        assert time.monotonic() < deadline, f"no {text!r} in kvd's log:\n{d.log()}"
        time.sleep(0.05)


def test_tcp_needs_curve_or_insecure(tmp_path: Path) -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    r = subprocess.run([str(BIN_DIR / "kvd"), "--model", str(MODEL), "--listen", ep, "-w", "0",
                        "--kv-memory", "16MiB"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--curve-secret" in r.stderr and "--insecure" in r.stderr, r.stderr
    # --clients-allow alone means nothing
    r = subprocess.run([str(BIN_DIR / "kvd"), "--model", str(MODEL), "--clients-allow", str(tmp_path), "-w", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 or r.returncode == 1
    assert "--curve-secret" in r.stderr, r.stderr
    # with --insecure it serves, and says so
    d = Daemon(tmp_path / "kvd", "--listen", ep, "--insecure", "-w", "0", "--kv-memory", "16MiB", ready="stats")
    try:
        assert "INSECURE" in d.log()
        with kvd_client.Client(ep, timeout=d.patience) as c:
            assert c.stats().blocks_total > 0
    finally:
        _stop_checked(d)


def test_curve_clients_tenants_and_revocation(tmp_path: Path) -> None:
    keys, allow = key_dirs(tmp_path, ("alice", "carol"), ("mallory",))
    (allow / "bad name!.key").write_text("not a key\n")          # skipped, with a log line
    ep = f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(tmp_path / "kvd", "--listen", ep, "--curve-secret", str(keys / "kvd.key_secret"),
               "--clients-allow", str(allow), "--kv-memory", "32MiB", "-w", "1")
    server = str(keys / "kvd.key")

    def client(name: str) -> kvd_client.Client:
        return kvd_client.Client(ep, timeout=d.patience, server_key=server, cert=str(keys / f"{name}.key_secret"))

    try:
        d.measure_patience()
        assert "skipped" in d.log()
        with kvd_client.Client(d.endpoint, timeout=d.patience) as local:
            assert local.stats().auth_client_keys == 2
        # tenants: the same system prompt is each tenant's own
        with client("alice") as a, client("carol") as c:
            a1 = ask(a, 1)
            assert a1.usage.cached_prompt_tokens == 0
            c1 = ask(c, 1)
            assert c1.usage.cached_prompt_tokens == 0, "carol found alice's cached blocks"
            assert c1.token_ids == a1.token_ids
            a2 = ask(a, 2)
            assert a2.usage.cached_prompt_tokens > 0, "alice's own prompt was not cached for her"
            # a namespace a tenant names stays inside the tenant
            assert ask(c, 3, ns="").usage.cached_prompt_tokens > 0
            assert ask(c, 4, ns="tenant:alice").usage.cached_prompt_tokens == 0
        # neither the plain socket's default namespace holds their blocks
        with kvd_client.Client(d.endpoint, timeout=d.patience) as local:
            assert ask(local, 5).usage.cached_prompt_tokens == 0
        # refused at once, each with its reason, and counted
        t0 = time.monotonic()
        with pytest.raises(kvd_client.AuthenticationFailed, match="refused this client's key"):
            with client("mallory") as m:
                m.health()
        with pytest.raises(kvd_client.AuthenticationFailed, match="wants CURVE keys"):
            with kvd_client.Client(ep, timeout=d.patience) as plain:
                plain.health()
        with pytest.raises(kvd_client.AuthenticationFailed):
            with kvd_client.Client(ep, timeout=d.patience, server_key=str(keys / "carol.key"),
                                   cert=str(keys / "alice.key_secret")) as wrong:
                wrong.health()
        assert time.monotonic() - t0 < d.patience / 2
        # the asyncio client the same: served with an allowed key, refused at once without
        async def async_clients() -> None:
            async with kvd_client.AsyncClient(ep, timeout=d.patience, server_key=server,
                                              cert=str(keys / "carol.key_secret")) as ac:
                r = await ac.generate("Hello", max_tokens=2, temperature=0)
                assert r.usage.completion_tokens == 2
            async with kvd_client.AsyncClient(ep, timeout=d.patience, server_key=server,
                                              cert=str(keys / "mallory.key_secret")) as am:
                with pytest.raises(kvd_client.AuthenticationFailed, match="refused this client's key"):
                    await am.health()

        asyncio.run(async_clients())
        with kvd_client.Client(d.endpoint, timeout=d.patience) as local:
            s = local.stats()
        assert s.auth_clients_refused >= 1 and s.auth_handshakes_failed >= 2, s
        assert s.auth_clients_admitted >= 2, s
        # kvcli (the C client) takes its keys from the environment
        env = dict(os.environ, KVD_CURVE_SERVER_KEY=server, KVD_CURVE_CERT=str(keys / "alice.key_secret"))
        r = subprocess.run([str(BIN_DIR / "kvcli"), "-e", ep, "health"], env=env, capture_output=True, text=True,
                           timeout=d.patience)
        assert r.returncode == 0, r.stderr
        env["KVD_CURVE_CERT"] = str(keys / "mallory.key_secret")
        r = subprocess.run([str(BIN_DIR / "kvcli"), "-e", ep, "--timeout", "60000", "generate", "hi"],
                           env=env, capture_output=True, text=True, timeout=d.patience)
        assert r.returncode == 1 and "authentication failed" in r.stderr, (r.returncode, r.stderr)
        # revoked: alice's key leaves the directory; SIGHUP; her next connection is refused
        (allow / "alice.key").unlink()
        d.proc.send_signal(signal.SIGHUP)
        wait_log(d, "SIGHUP: 1 client keys", 1, d.patience)
        with pytest.raises(kvd_client.AuthenticationFailed):
            with client("alice") as a:
                a.health()
        with client("carol") as c:
            assert ask(c, 6).usage.cached_prompt_tokens > 0
    finally:
        _stop_checked(d)


def test_tenant_stats_and_queue_limit(tmp_path: Path) -> None:
    """Per-tenant statistics (the operator sees every tenant, a tenant its own
    row) and --tenant-max-queue: one tenant's flood is refused past its limit
    while another tenant is still taken."""
    keys, allow = key_dirs(tmp_path, ("alice", "carol"))
    ep = f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(tmp_path / "kvd", "--listen", ep, "--curve-secret", str(keys / "kvd.key_secret"),
               "--clients-allow", str(allow), "--kv-memory", "32MiB", "-w", "1", "--max-batch", "1",
               "--tenant-max-queue", "1")

    def client(name: str) -> kvd_client.Client:
        return kvd_client.Client(ep, timeout=d.patience, server_key=str(keys / "kvd.key"),
                                 cert=str(keys / f"{name}.key_secret"))

    try:
        d.measure_patience()
        with client("alice") as a, client("carol") as c, kvd_client.Client(d.endpoint, timeout=d.patience) as op:
            ask(a, 1)
            ask(a, 2)
            ask(c, 1)
            # an ipc:// client's "tenant:NAME/" namespace (the HTTP API's keys) is that tenant
            ask(op, 1, ns="tenant:dave/")
            rows = {t.name: t for t in op.stats().tenants}
            assert set(rows) == {"alice", "carol", "dave"}, rows
            assert rows["alice"].requests == 2 and rows["carol"].requests == 1
            assert rows["alice"].cached_prompt_tokens > 0 and rows["carol"].cached_prompt_tokens == 0
            assert rows["alice"].prompt_tokens > rows["carol"].prompt_tokens
            own = a.stats().tenants
            assert [t.name for t in own] == ["alice"], own
            # alice: one running (max-batch 1), one queued, the third refused
            s1 = a.stream("Count slowly from one to a thousand.", max_tokens=400, ignore_eos=True)
            it = iter(s1)
            next(it)                          # running: its first chunk came
            s2 = a.stream("And again.", max_tokens=4)
            s2.start()                        # accepted: queued behind s1
            assert {t.name: t for t in op.stats().tenants}["alice"].queued == 1
            with pytest.raises(kvd_client.Overloaded, match="tenant alice"):
                a.generate("One more.", max_tokens=4)
            # carol is still taken (her own queue is empty)
            s3 = c.stream("Hello.", max_tokens=4)
            s3.start()
            row = {t.name: t for t in op.stats().tenants}["alice"]
            assert row.refused == 1 and row.running == 1 and row.blocks_held > 0, row
            s1.close()
            for s in (s2, s3):
                for _ in s:
                    pass
    finally:
        _stop_checked(d)


def flood_prompt(i: int) -> str:
    return " ".join(f"Item {i}.{j}: crate {j * 3 + i} goes to dock {(j * 5 + i) % 11}." for j in range(20))


def test_tenant_block_limit_keeps_others_cached(tmp_path: Path) -> None:
    """--tenant-max-blocks: a tenant that floods the pool with prompts evicts
    its own cached blocks, not another tenant's; without the limit the same
    flood evicts them (the control: the assertion can fail)."""
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("kvd", "alice", "mallory"):
        keygen(keys, name)
    for limit in ("40%", None):
        allow = tmp_path / f"allow-{limit is not None}"
        allow.mkdir()
        for name in ("alice", "mallory"):
            (allow / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
        ep = f"tcp://127.0.0.1:{free_port()}"
        extra = ["--tenant-max-blocks", limit] if limit else []
        d = Daemon(tmp_path / f"kvd-{limit is not None}", "--listen", ep, "--curve-secret",
                   str(keys / "kvd.key_secret"), "--clients-allow", str(allow), "--kv-memory", "24MiB", "-w", "1",
                   *extra)
        try:
            d.measure_patience()

            def client(name: str) -> kvd_client.Client:
                return kvd_client.Client(ep, timeout=d.patience, server_key=str(keys / "kvd.key"),
                                         cert=str(keys / f"{name}.key_secret"))

            with client("alice") as a, client("mallory") as m, \
                    kvd_client.Client(d.endpoint, timeout=d.patience) as op:
                total = op.stats().blocks_total
                first = ask(a, 1)
                full = (first.usage.prompt_tokens - 1) // 16 * 16
                flood = 0
                for i in range(10):
                    r = m.generate(flood_prompt(i), max_tokens=2, temperature=0)
                    flood += r.usage.prompt_tokens
                assert flood > 2 * total * 16, "the flood must be several pools' worth"
                rows = {t.name: t for t in op.stats().tenants}
                again = ask(a, 1)       # the same request: all of its full blocks, if kept
                if limit is not None:
                    assert rows["mallory"].blocks_held <= total * 40 // 100, rows["mallory"]
                    assert again.usage.cached_prompt_tokens == full, "mallory's flood evicted alice's prompt"
                else:
                    assert again.usage.cached_prompt_tokens < full, "without a limit the flood should evict it"
        finally:
            _stop_checked(d)


def test_curve_worker_endpoint(tmp_path: Path) -> None:
    """A tcp:// worker endpoint under CURVE: kvd's own workers join with its
    key pair and serve; a worker whose key is not in --workers-allow is
    refused and counted."""
    keys, wallow = tmp_path / "keys", tmp_path / "workers"
    keys.mkdir()
    wallow.mkdir()
    for name in ("kvd", "stranger"):
        keygen(keys, name)
    wep = f"tcp://127.0.0.1:{free_port()}"
    pool = f"kvd-test-auth-{os.getpid()}"
    d = Daemon(tmp_path / "kvd", "--worker-endpoint", wep, "--curve-secret", str(keys / "kvd.key_secret"),
               "--workers-allow", str(wallow), "--kv-memory", "32MiB", "-w", "1", "--pool", pool)
    stranger = None
    try:
        d.measure_patience()
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            assert c.generate("Hello", max_tokens=2, temperature=0).usage.completion_tokens == 2
            stranger = subprocess.Popen(
                [str(BIN_DIR / "kvd-worker"), "--model", str(MODEL), "--pool", pool, "--connect", wep,
                 "--id", "7", "--curve-server-key", str(keys / "kvd.key"),
                 "--curve-cert", str(keys / "stranger.key_secret")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + d.patience
            while c.stats().auth_workers_refused == 0:
                assert time.monotonic() < deadline, "the stranger's key was not refused"
                assert stranger.poll() is None or c.stats().auth_workers_refused > 0
                time.sleep(0.05)
            assert len([w for w in c.stats().workers if w.alive]) == 1
    finally:
        if stranger is not None:
            stranger.kill()
            stranger.wait()
        _stop_checked(d)
        try:
            os.unlink(f"/dev/shm/{pool}")
        except FileNotFoundError:
            pass


def test_public_prefix_shared_across_tenants(tmp_path: Path) -> None:
    """--public-prefix: a system prompt the operator marks public is cached
    once for every tenant (the second tenant finds its blocks), while what
    follows it, and any other system prompt, stays each tenant's own."""
    keys, allow = key_dirs(tmp_path, ("alice", "carol"))
    public = tmp_path / "public.txt"
    public.write_text(SYSTEM)
    ep = f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(tmp_path / "kvd", "--listen", ep, "--curve-secret", str(keys / "kvd.key_secret"),
               "--clients-allow", str(allow), "--kv-memory", "32MiB", "-w", "1", "--public-prefix", str(public))

    def client(name: str) -> kvd_client.Client:
        return kvd_client.Client(ep, timeout=d.patience, server_key=str(keys / "kvd.key"),
                                 cert=str(keys / f"{name}.key_secret"))

    try:
        d.measure_patience()
        assert "public prefix" in d.log()
        with client("alice") as a, client("carol") as c:
            a1 = ask(a, 1)
            assert a1.usage.cached_prompt_tokens == 0
            c1 = ask(c, 1)                    # the same prompt: the public blocks, not alice's question
            full = (c1.usage.prompt_tokens - 1) // 16 * 16
            assert 0 < c1.usage.cached_prompt_tokens < full, c1.usage
            assert c1.token_ids == a1.token_ids
            assert ask(c, 1).usage.cached_prompt_tokens == full     # then all of carol's own
            # another system prompt shares nothing
            other = c.generate(messages=[{"role": "system", "content": "Be brief. " + SYSTEM},
                                         {"role": "user", "content": "When does hall 1 open?"}],
                               max_tokens=2, temperature=0)
            assert other.usage.cached_prompt_tokens == 0
    finally:
        _stop_checked(d)


def test_curve_on_ipc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--curve-ipc: the ipc:// endpoint wants CURVE keys too (a client without
    them fails with AuthenticationFailed, one with an allowed key is served
    under its tenant), while the HTTP API reaches kvd on a plain socket of
    its own and keeps working."""
    import http.client

    keys, allow = key_dirs(tmp_path, ("alice",))
    # the fixture's own readiness checks and these clients take keys from the environment
    monkeypatch.setenv("KVD_CURVE_SERVER_KEY", str(keys / "kvd.key"))
    monkeypatch.setenv("KVD_CURVE_CERT", str(keys / "alice.key_secret"))
    port = free_port()
    d = Daemon(tmp_path / "kvd", "--curve-secret", str(keys / "kvd.key_secret"), "--clients-allow", str(allow),
               "--curve-ipc", "--http", f"127.0.0.1:{port}", "--kv-memory", "32MiB", "-w", "1")
    try:
        d.measure_patience()
        with kvd_client.Client(d.endpoint, timeout=d.patience) as a:
            assert ask(a, 1).usage.completion_tokens == 4
            assert [t.name for t in a.stats().tenants] == ["alice"]
        monkeypatch.delenv("KVD_CURVE_CERT")
        with pytest.raises(kvd_client.AuthenticationFailed, match="wants CURVE keys"):
            with kvd_client.Client(d.endpoint, timeout=d.patience) as plain:
                plain.health()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=d.patience)
        try:
            c.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hello", "max_tokens": 2}),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            body = json.loads(r.read())
        finally:
            c.close()
        assert r.status == 200 and body["usage"]["completion_tokens"] == 2, body
    finally:
        _stop_checked(d)
