"""Across real network links, in network namespaces that the tests make (and
remove), joined by veth pairs on private test addresses. Skipped where
network namespaces cannot be made (not root, no ip(8), no CAP_NET_ADMIN).

- CURVE: kvd in one namespace, its clients in another. An allowed key is
  served across the link with the same output as a client of kvd's own
  ipc:// socket; a refused key and a client without keys fail there with
  AuthenticationFailed.
- Two hosts: kvd in one namespace, a worker with a pool of its own in each of
  two others (test_hosts.py's scenario): a cached prefix sends its follow-up to
  its host, and killing that host's worker mid-stream resumes on the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BIN_DIR, Daemon, _stop_checked
from test_hosts import Hosts, two_hosts_scenario

import kvd_client

TAG = f"kt{os.getpid() % 100000}"
SRV, CLI = f"{TAG}s", f"{TAG}c"
SRV_ADDR, CLI_ADDR = "10.203.77.1", "10.203.77.2"   # a private /30 that exists only in these namespaces


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def link() -> Iterator[None]:
    """Two namespaces joined by a veth pair, or a skip where they cannot be made."""
    try:
        ip("netns", "add", SRV)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        ip("netns", "add", CLI)
        ip("link", "add", f"{TAG}a", "type", "veth", "peer", "name", f"{TAG}b")
        ip("link", "set", f"{TAG}a", "netns", SRV)
        ip("link", "set", f"{TAG}b", "netns", CLI)
        for ns, dev, addr in ((SRV, f"{TAG}a", SRV_ADDR), (CLI, f"{TAG}b", CLI_ADDR)):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (SRV, CLI):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)


HOSTS_NS = {"A": (f"{TAG}A", "10.203.78.1", "10.203.78.2"), "B": (f"{TAG}B", "10.203.79.1", "10.203.79.2")}


@pytest.fixture
def hosts_links() -> Iterator[None]:
    """kvd's namespace SRV, and one per host, each joined to SRV by a veth pair
    on a /30 of its own."""
    try:
        ip("netns", "add", SRV)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        for name, (ns, kvd_addr, host_addr) in HOSTS_NS.items():
            ip("netns", "add", ns)
            a, b = f"{TAG}{name}k", f"{TAG}{name}h"
            ip("link", "add", a, "type", "veth", "peer", "name", b)
            ip("link", "set", a, "netns", SRV)
            ip("link", "set", b, "netns", ns)
            for n, dev, addr in ((SRV, a, kvd_addr), (ns, b, host_addr)):
                ip("-n", n, "addr", "add", f"{addr}/30", "dev", dev)
                ip("-n", n, "link", "set", dev, "up")
                ip("-n", n, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (SRV, *(v[0] for v in HOSTS_NS.values())):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)


def test_two_hosts_across_namespaces(tmp_path: Path, hosts_links: None) -> None:
    port = 5556
    h = Hosts(tmp_path, "")
    d = h.kvd(f"tcp://*:{port}", 3000, "--allow-remote", wrap=["ip", "netns", "exec", SRV])
    try:
        for wid, (name, (ns, kvd_addr, _)) in enumerate(HOSTS_NS.items(), start=1):
            h.start(wid, name, wrap=["ip", "netns", "exec", ns], connect=f"tcp://{kvd_addr}:{port}")
        two_hosts_scenario(d, h)
    finally:
        h.stop()
        _stop_checked(d)


CLIENT = r"""
import json, sys, kvd_client
ep, server, cert, bad = sys.argv[1:5]
out = {}
with kvd_client.Client(ep, timeout=float(sys.argv[5]), server_key=server, cert=cert) as c:
    r = c.generate("The lighthouse keeper", max_tokens=8, temperature=0)
    out["tokens"] = r.token_ids
for name, kw in (("refused", dict(server_key=server, cert=bad)), ("plain", {})):
    try:
        with kvd_client.Client(ep, timeout=float(sys.argv[5]), **kw) as c:
            c.health()
        out[name] = "admitted"
    except kvd_client.AuthenticationFailed as e:
        out[name] = "AuthenticationFailed: " + str(e)
print(json.dumps(out))
"""


def test_curve_across_namespaces(tmp_path: Path, link: None) -> None:
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    keys.mkdir()
    allow.mkdir()
    for name in ("kvd", "alice", "mallory"):
        subprocess.run([str(BIN_DIR / "kvd-keygen"), "--dir", str(keys), name], check=True, capture_output=True)
    (allow / "alice.key").write_bytes((keys / "alice.key").read_bytes())
    ep = f"tcp://{SRV_ADDR}:5555"
    # the veth's address is not loopback: another machine (namespace) is meant to reach it
    d = Daemon(tmp_path / "kvd", "--listen", ep, "--allow-remote", "--curve-secret", str(keys / "kvd.key_secret"),
               "--clients-allow", str(allow), "--kv-memory", "32MiB", "-w", "1", wrap=["ip", "netns", "exec", SRV])
    try:
        d.measure_patience()
        # the reference: the same request on kvd's own ipc:// socket (a unix socket: no network)
        with kvd_client.Client(d.endpoint, timeout=d.patience) as local:
            want = local.generate("The lighthouse keeper", max_tokens=8, temperature=0, no_cache=True).token_ids
        r = subprocess.run(["ip", "netns", "exec", CLI, sys.executable, "-c", CLIENT, ep, str(keys / "kvd.key"),
                            str(keys / "alice.key_secret"), str(keys / "mallory.key_secret"), str(d.patience)],
                           capture_output=True, text=True, timeout=4 * d.patience)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["tokens"] == want
        assert out["refused"].startswith("AuthenticationFailed") and "refused" in out["refused"], out
        assert out["plain"].startswith("AuthenticationFailed"), out
        with kvd_client.Client(d.endpoint, timeout=d.patience) as local:
            s = local.stats()
        assert s.auth_clients_admitted >= 1 and s.auth_clients_refused >= 1 and s.auth_handshakes_failed >= 1
    finally:
        _stop_checked(d)
