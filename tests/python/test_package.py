"""The package itself: typed (mypy --strict over the hand-written code), its
message classes generated from proto/kvd.proto, the command line, the
default endpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BIN_DIR, PATIENCE, ROOT, Daemon

import kvd_client
from kvd_client import kvd_pb2

SOURCE = ROOT / "clients" / "python"


def test_mypy_strict(tmp_path: Path) -> None:
    """mypy --strict over the package's source, beside the generated module
    and stub of the installed package (which the config leaves unchecked),
    and over these tests."""
    pkg = tmp_path / "kvd_client"
    shutil.copytree(SOURCE / "kvd_client", pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "kvd_pb2.py*"))
    installed = Path(kvd_pb2.__file__).parent
    for name in ("kvd_pb2.py", "kvd_pb2.pyi"):
        shutil.copy(installed / name, pkg / name)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(SOURCE / "pyproject.toml"),
         "--cache-dir", str(tmp_path / ".mypy_cache"), str(pkg),
         *sorted(str(p) for p in Path(__file__).parent.glob("*.py"))],
        cwd=tmp_path, capture_output=True, text=True, timeout=2 * PATIENCE,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success" in out.stdout


def test_messages_come_from_the_proto() -> None:
    text = (ROOT / "proto" / "kvd.proto").read_text()
    in_proto = set(re.findall(r"^message (\w+)", text, re.M))
    assert in_proto and in_proto == set(kvd_pb2.DESCRIPTOR.message_types_by_name)
    assert set(re.findall(r"^enum (\w+)", text, re.M)) == set(
        kvd_pb2.DESCRIPTOR.enum_types_by_name)
    assert kvd_pb2.DESCRIPTOR.name == "kvd_client/kvd.proto"


def test_stats_come_from_the_proto() -> None:
    """Stats and its rows carry every field of kvd.proto's, copied by name."""
    from kvd_client import _wire
    assert _wire.stats_fields_missing() == {
        "Stats": set(), "WorkerStats": set(), "HostStats": set(), "TenantStats": set()}
    m = kvd_pb2.Stats(requests_done=3, host_cache_declined=7, block_hashes=[1, 2], kv_type="K f16",
                      finished_abort=2)
    m.workers.add(id=1, pid=5, alive=True, host="h")
    m.hosts.add(name="x", workers=2)
    m.tenants.add(name="t", pins=3)
    s = _wire.to_stats(m)
    assert (s.requests_done, s.host_cache_declined, s.block_hashes, s.kv_type) == (3, 7, [1, 2], "K f16")
    assert s.finished_abort == 2 and s.kv_parts == 1 and s.hit_rate == 0.0
    assert s.workers == [kvd_client.WorkerStats(id=1, pid=5, alive=True, running=0, tokens=0, restarts=0,
                                                host="h")]
    assert s.hosts[0].name == "x" and s.hosts[0].workers == 2
    assert s.tenants[0].name == "t" and s.tenants[0].pins == 3
    m.kv_parts = 3
    assert _wire.to_stats(m).kv_parts == 3


def test_default_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVD_ENDPOINT", "tcp://127.0.0.1:5555")
    assert kvd_client.default_endpoint() == "tcp://127.0.0.1:5555"
    assert kvd_client.Client(timeout=1).endpoint == "tcp://127.0.0.1:5555"
    monkeypatch.delenv("KVD_ENDPOINT")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000/")
    assert kvd_client.default_endpoint() == "ipc:///run/user/1000/kvd/kvd.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/dir")   # ignored, as the XDG spec says
    assert kvd_client.default_endpoint() == f"ipc:///tmp/kvd-{os.getuid()}/kvd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert kvd_client.default_endpoint() == f"ipc:///tmp/kvd-{os.getuid()}/kvd.sock"
    with pytest.raises(ValueError):
        kvd_client.Client("localhost:5555")
    with pytest.raises(ValueError):
        kvd_client.Client("ipc:///tmp/x", timeout=0)


def patient(d: Daemon) -> list[str]:
    """The CLIs' option for d.patience as the longest wait for a message (their
    default is 30 s)."""
    return ["--timeout", str(int(d.patience * 1000))]


def run_cli(*args: str, stdin: str | None = None,
            limit: float = 2 * PATIENCE) -> subprocess.CompletedProcess[str]:
    """python -m kvd_client; limit (seconds) only catches a hang."""
    return subprocess.run([sys.executable, "-m", "kvd_client", *args], input=stdin,
                          capture_output=True, text=True, timeout=limit)


def test_cli_json_matches_kvcli(kvd: Daemon, namespace: str) -> None:
    args = ["-e", kvd.endpoint, "--chat", "--system", "Answer in one word.", "-n", "12",
            "--temp", "0", "--namespace", namespace, "--json", "What color is the sky?"]
    py = run_cli(*patient(kvd), *args, limit=2 * kvd.patience)
    assert py.returncode == 0, py.stderr
    c = subprocess.run([str(BIN_DIR / "kvcli"), "-e", kvd.endpoint, *patient(kvd), "generate",
                        *args[2:]],
                       capture_output=True, text=True, timeout=2 * kvd.patience, check=True)
    mine, ref = json.loads(py.stdout), json.loads(c.stdout)
    assert list(mine) == list(ref)
    for key in ("text", "tokens", "finish_reason", "chunks"):
        assert mine[key] == ref[key], key
    assert mine["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert list(mine["timings"]) == list(ref["timings"])


def test_cli_streams_text(kvd: Daemon, namespace: str) -> None:
    with kvd_client.Client(kvd.endpoint, timeout=kvd.patience) as c:
        ref = c.generate("The capital of France is", max_tokens=8, temperature=0,
                         namespace=namespace)
    common = ["-e", kvd.endpoint, *patient(kvd), "-n", "8", "--temp", "0", "--namespace", namespace]
    out = run_cli(*common, "The capital of France is", limit=2 * kvd.patience)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ref.text + "\n"
    out = run_cli(*common, "--no-stream", "-", stdin="The capital of France is",
                  limit=2 * kvd.patience)
    assert out.stdout == ref.text + "\n"


def test_cli_errors(kvd: Daemon, kvd_full: Daemon, dead_endpoint: str) -> None:
    out = run_cli("-e", kvd_full.endpoint, *patient(kvd_full), "Hi")
    assert out.returncode == 1
    assert out.stderr.startswith("python -m kvd_client: Overloaded: ")
    assert "retry after" in out.stderr and out.stderr.count("\n") == 1
    out = run_cli("-e", dead_endpoint, "--timeout", "300", "Hi")
    assert out.returncode == 1 and "is it running?" in out.stderr
    out = run_cli("-e", kvd.endpoint, *patient(kvd), "--top-p", "7", "Hi")
    assert out.returncode == 1 and "BadRequest" in out.stderr and "top_p" in out.stderr
    for bad in (["--system", "x", "Hi"], [], ["-n", "0", "Hi"], ["--prompt-ids", "1,2", "Hi"]):
        out = run_cli("-e", kvd.endpoint, *bad)
        assert out.returncode == 2, bad
