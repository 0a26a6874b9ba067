"""The package itself: typed (mypy --strict over its code, the statistics'
generated classes included), its message classes generated from
proto/kvd.proto and its statistics' from clients/c/kvd_stats_fields.h, the
command line, the default endpoint."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import typing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BIN_DIR, PATIENCE, ROOT, Daemon

import kvd_client
from kvd_client import kvd_pb2

SOURCE = ROOT / "clients" / "python"
STATS_HEADER = ROOT / "clients" / "c" / "kvd_stats_fields.h"


def test_mypy_strict(tmp_path: Path) -> None:
    """mypy --strict over the package's source, beside the generated modules
    of the installed package (protoc's module and stub, which the config
    leaves unchecked, and the statistics' classes, which it checks), and over
    these tests."""
    generated = ("kvd_pb2.py", "kvd_pb2.pyi", "_stats.py")
    pkg = tmp_path / "kvd_client"
    shutil.copytree(SOURCE / "kvd_client", pkg,
                    ignore=shutil.ignore_patterns("__pycache__", *generated))
    installed = Path(kvd_pb2.__file__).parent
    for name in generated:
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


def header_tables() -> dict[str, list[tuple[str, str, str]]]:
    """The tables of kvd_stats_fields.h read plainly (not by the build's
    parser): each message's (name, type, help) lines, in order. Enough for
    today's header; the build's parser is the strict one."""
    text = STATS_HEADER.read_text().replace("\\\n", "")
    out: dict[str, list[tuple[str, str, str]]] = {}
    for table, body in re.findall(r"^#define KVD_(\w*)_FIELDS\(X\)(.*)$", text, re.M):
        message = "".join(w.capitalize() for w in table.split("_"))
        out[message] = [
            (name, ctype, re.sub(r'\\(.)', r"\1", help_text))
            for name, ctype, help_text in re.findall(
                r'X\((\w+),\s*(\w+),\s*\w+,\s*"(?:[^"\\]|\\.)*",\s*"((?:[^"\\]|\\.)*)"\)', body)
        ]
        assert len(out[message]) == body.count("X("), f"a line of {table} this test cannot read"
    return out


def test_stats_come_from_the_header() -> None:
    """Stats and its rows begin with the figures of kvd_stats_fields.h's tables:
    every line a field of its Python type, in the table's order, its help its
    doc comment in the generated module; the rest of their fields are kvd.proto's
    rows and hashes (test_stats_come_from_the_proto holds all of them to the .proto)."""
    from kvd_client import _stats
    tables = header_tables()
    classes = {"Stats": kvd_client.Stats, "WorkerStats": kvd_client.WorkerStats,
               "HostStats": kvd_client.HostStats, "TenantStats": kvd_client.TenantStats}
    assert set(tables) == set(classes)
    py_types = {"U64": int, "U32": int, "I32": int, "BOOL": bool}
    source = Path(_stats.__file__).read_text()
    for message, cls in classes.items():
        lines = tables[message]
        assert len(lines) > 5
        fields = dataclasses.fields(cls)
        assert [f.name for f in fields[:len(lines)]] == [name for name, _, _ in lines], message
        hints = typing.get_type_hints(cls)
        generated = source.split(f"class {message}Fields:", 1)[1].split("\n\n\n", 1)[0]
        for name, ctype, help_text in lines:
            want = str if ctype.startswith("STR") else py_types[ctype]
            assert hints[name] is want, (message, name, hints[name])
            # the doc comment over the field in its generated class
            m = re.search(rf"((?:    #: .*\n)+)    {name}: ", generated)
            assert m, (message, name)
            assert " ".join(ln.strip()[3:] for ln in m.group(1).splitlines()) == " ".join(
                help_text.split()), (message, name)
        rest = {f.name for f in fields[len(lines):]}
        assert rest == ({"workers", "block_hashes", "tenants", "hosts"} if message == "Stats"
                        else set()), message
    # frozen; by default zeros, one block table per sequence (as from a kvd that
    # sends no kv_parts), no rows
    s = kvd_client.Stats()
    assert (s.requests_done, s.kv_type, s.kv_parts, s.workers, s.hit_rate) == (0, "", 1, [], 0.0)
    assert kvd_client.Stats(prompt_tokens=8, cached_prompt_tokens=2).hit_rate == 0.25
    w = kvd_client.WorkerStats(1, 5, True, 0, 0, 0)
    assert (w.alive, w.host, w.pid) == (True, "", 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(w, "pid", 6)
    assert '"K q8_0, V q4_0, rotated V"' in source   # an escaped quote, read as C reads it


def load_setup() -> typing.Any:
    """clients/python/setup.py as a module (it builds nothing unless run as __main__)."""
    pytest.importorskip("setuptools")
    spec = importlib.util.spec_from_file_location("kvd_client_setup", SOURCE / "setup.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stats_header_parser() -> None:
    """The build's parser of kvd_stats_fields.h reads today's header as this
    test does, C's string literals as C does, and stops at a line it cannot
    read, saying where."""
    setup = load_setup()
    header = STATS_HEADER.read_text()
    tables = setup.parse_stats_fields(header)
    plain = header_tables()
    assert {setup.stats_class_name(t).removesuffix("Fields"): [(f.name, f.type, f.help) for f in v]
            for t, v in tables.items()} == plain
    line = 'X(pid, I32, NONE, "", "Its process id.")'
    assert line in header
    at = header[:header.index(line)].count("\n") + 1
    odd = header.replace(line, 'X(pid, I32, NONE, "", "Its " /* kvd\'s */ "pro\\x63" "ess \\"id\\"\\101")')
    pid = setup.parse_stats_fields(odd)["KVD_WORKER_STATS_FIELDS"][1]
    assert (pid.name, pid.help, pid.line) == ("pid", 'Its process "id"A', at)
    for bad, says, where in (
        ('X(pid, I32 NONE, "", "Its process id.")', "expected ','", at),
        ('X(pid, F64, NONE, "", "Its process id.")', "expected a type", at),
        ('X(pid, I32, NONE, "", "Its \\q id.")', "expected a C escape", at),
        ('X(pid, I32, NONE, "", L"Its process id.")', "expected its help (a string literal)", at),
        ('X(id, I32, NONE, "", "Its process id.")', "'id' is", at),
        ('Y(pid, I32, NONE, "", "Its process id.")', "expected X(", at),
        # the literal runs on (a backslash-newline splices lines, in strings too)
        # to the next line's first quote, as in C
        ('X(pid, I32, NONE, "", "Its process id.)', "expected ')'", at + 1),
    ):
        with pytest.raises(setup.HeaderError, match=re.escape(says)) as e:
            setup.parse_stats_fields(header.replace(line, bad), "h.h")
        assert str(e.value).startswith(f"h.h:{where}: "), e.value
    # a table line cut off from its #define by a missing backslash
    cut = re.sub(re.escape(line) + r"[ \t]*\\\n", line + "\n", header)
    assert cut != header
    with pytest.raises(setup.HeaderError, match="lacks its backslash") as e:
        setup.parse_stats_fields(cut, "h.h")
    assert str(e.value).startswith(f"h.h:{at + 1}: "), e.value


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
