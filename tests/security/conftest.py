"""Helpers of the perimeter tests (tests/security): real kvd processes from the
built binaries, reached over ipc:// with the Python client and over HTTP with
the standard library, and a way to act as another local user.

    KVD_BIN_DIR   where kvd, kvd-worker and kvcli are (default: build/ in the repository)
    KVD_MODEL     the model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)

Every wait is for a condition, bounded by PATIENCE seconds that only fail a
hung test; a kvd's PATIENCE grows with its measured prefill speed, so that a
slow machine (KVD_ISA=c, both cores busy) only takes longer.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvd_client

ROOT = Path(__file__).resolve().parents[2]


def _path(var: str, default: str) -> Path:
    p = Path(os.environ.get(var) or default)
    return p if p.is_absolute() else ROOT / p


BIN_DIR = _path("KVD_BIN_DIR", "build")
MODEL = _path("KVD_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
PATIENCE = 300.0
NOBODY = 65534


def wait_for(what: str, cond: Callable[[], Any], limit: float = PATIENCE, every: float = 0.05) -> Any:
    """cond()'s first true value; fails naming `what` after `limit` seconds."""
    deadline = time.monotonic() + limit
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"{what}: not after {limit:g} s"
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_fd_limit(want: int) -> None:
    """This process's descriptor limit raised to at least `want` (skips when the hard limit is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"the hard descriptor limit is {hard}, under the {want} this test needs")
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def proc_status(pid: int, key: str) -> int:
    """A number of /proc/PID/status (VmRSS in KiB, Threads)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def as_user(cmd: Sequence[str], uid: int = NOBODY, **kw: Any) -> subprocess.CompletedProcess[str]:
    """cmd run as another local user (setpriv; the tests run as root in CI)."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root (CI runs the tests as root)")
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd],
                          capture_output=True, text=True, timeout=120, **kw)


class Kvd:
    """One kvd, its ipc:// endpoint in a private directory, optionally --http."""

    def __init__(self, work: Path, *args: str, http: bool = False, listen: bool = True,
                 env: dict[str, str] | None = None, ready: bool = True, workers: int = 1) -> None:
        for exe in ("kvd", "kvd-worker", "kvcli"):
            if not (BIN_DIR / exe).is_file():
                pytest.fail(f"{BIN_DIR / exe} is missing: build kvd first (or set KVD_BIN_DIR)")
        if not MODEL.is_file():
            pytest.fail(f"{MODEL} is missing: run scripts/fetch-model.sh (or set KVD_MODEL)")
        work.mkdir(parents=True, exist_ok=True)
        work.chmod(0o700)
        self.work = work
        self.endpoint = f"ipc://{work}/kvd.sock"
        self.port = free_port() if http else 0
        self.log_path = work / f"kvd-{time.monotonic_ns()}.log"
        cmd = [str(BIN_DIR / "kvd"), "--model", str(MODEL), "--ctx", "2048", "-w", str(workers),
               *(("--listen", self.endpoint) if listen else ()),
               *(("--http", f"127.0.0.1:{self.port}") if http else ()), *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                         start_new_session=True)
        self.patience = PATIENCE
        self.workers = workers
        if ready:
            self.wait_ready()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        """Until kvd answers (and, with workers, has one alive)."""
        def up() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"kvd exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with kvd_client.Client(self.endpoint, timeout=0.5) as c:
                    return c.health().ok or self.workers == 0
            except kvd_client.Timeout:
                return False
        wait_for("kvd ready", up, every=0.1)

    def client(self, timeout: float | None = None) -> kvd_client.Client:
        return kvd_client.Client(self.endpoint, timeout=timeout or self.patience)

    def stats(self) -> Any:
        with self.client() as c:
            return c.stats()

    def http(self, method: str, path: str, body: bytes | str | None = None,
             headers: dict[str, str] | None = None, timeout: float | None = None,
             source: str | None = None) -> tuple[int, dict[str, str], bytes]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout or self.patience,
                                       source_address=(source, 0) if source else None)
        try:
            h = {"Content-Type": "application/json"} if body is not None else {}
            h.update(headers or {})
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def post(self, path: str, obj: object, key: str | None = None) -> tuple[int, Any]:
        s, _, raw = self.http("POST", path, json.dumps(obj),
                              {"Authorization": f"Bearer {key}"} if key else None)
        return s, json.loads(raw)

    def metrics(self, key: str | None = None) -> dict[str, float]:
        """/metrics as {name{labels}: value}."""
        s, _, raw = self.http("GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else None)
        assert s == 200
        out = {}
        for line in raw.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, v = line.rpartition(" ")
                out[name] = float(v)
        return out

    def stop(self, expect: int | None = 0) -> int:
        """SIGTERM, then the exit status (checked against expect unless None)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=PATIENCE)
            except subprocess.TimeoutExpired:
                self.kill()
        Path(f"/dev/shm/kvd-{self.proc.pid}").unlink(missing_ok=True)
        if expect is not None:
            assert self.proc.returncode == expect, f"kvd exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL to kvd and the workers it started (its process group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def kvds() -> Iterator[list[Kvd]]:
    """Daemons a test starts: whatever is still running at its end is killed."""
    started: list[Kvd] = []
    yield started
    for k in started:
        if k.proc.poll() is None:
            k.kill()
        Path(f"/dev/shm/kvd-{k.proc.pid}").unlink(missing_ok=True)


def run_kvd(*args: str, env: dict[str, str] | None = None, limit: float = 120) -> subprocess.CompletedProcess[str]:
    """kvd expected to stop at its checks: its exit status and output."""
    return subprocess.run([str(BIN_DIR / "kvd"), "--model", str(MODEL), *args], capture_output=True, text=True,
                          timeout=limit, cwd=ROOT, env={**os.environ, **(env or {})})


def keygen(d: Path, *names: str) -> None:
    """CURVE key pairs made by kvd-keygen in d: NAME.key (public), NAME.key_secret."""
    d.mkdir(parents=True, exist_ok=True)
    for name in names:
        subprocess.run([str(BIN_DIR / "kvd-keygen"), "--dir", str(d), "--force", name], check=True,
                       capture_output=True, timeout=60)


@pytest.fixture
def nobody_tmp() -> Iterator[Path]:
    """A directory of the other user's (NOBODY, mode 0700) in /tmp, removed at the end."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root (CI runs the tests as root)")
    d = Path(tempfile.mkdtemp(prefix="kvd-security-"))
    os.chown(d, NOBODY, NOBODY)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# the interpreter itself, not a virtual environment's link to it inside a checkout others may not enter
OTHERS_PYTHON = os.path.realpath(sys.executable)


def for_others(d: Path) -> tuple[Path, Path, Path]:
    """kvd, kvd-worker and the model as another user (NOBODY) can run and read them: where they are
    when the checkout is open to others, else copies in d, their directory (a clone made in a 0700
    directory, as `mktemp -d` makes, is closed to them)."""
    files = (BIN_DIR / "kvd", BIN_DIR / "kvd-worker", MODEL)
    reach = as_user(["sh", "-c", 'test -x "$1" && test -x "$2" && test -r "$3"', "sh", *map(str, files)])
    if reach.returncode == 0:
        return files
    copies = []
    for f in files:
        c = d / f.name
        shutil.copy2(f, c)
        os.chown(c, NOBODY, NOBODY)
        copies.append(c)
    reach = as_user(["sh", "-c", 'test -x "$1" && test -x "$2" && test -r "$3"', "sh", *map(str, copies)])
    assert reach.returncode == 0, reach.stderr
    return copies[0], copies[1], copies[2]
