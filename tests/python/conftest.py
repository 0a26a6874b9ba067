"""Fixtures of the Python client's tests: real kvd daemons over private ipc://
endpoints, started from the built binaries with the default model.

    KVD_BIN_DIR   where kvd, kvd-worker and kvcli are (default: build/ in the repository)
    KVD_MODEL     the model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)

Relative paths are taken from the repository root. Every daemon is stopped with
SIGTERM at the end, and must exit with status 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import kvd_client

ROOT = Path(__file__).resolve().parents[2]


def _path(var: str, default: str) -> Path:
    p = Path(os.environ.get(var) or default)
    return p if p.is_absolute() else ROOT / p


BIN_DIR = _path("KVD_BIN_DIR", "build")
MODEL = _path("KVD_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")

# Seconds: the longest wait for what must come (a reply, a start, an exit). An
# upper bound that fails a hung test, never a speed: a slow or busy machine
# (KVD_ISA=c under load) only takes longer to get there. A daemon that computes
# waits longer still where it prefills slowly (Daemon.patience).
PATIENCE = 300.0
# Seconds: a bound on a short client timeout (0.3 s) firing, for a daemon that
# never answers. Far above it, yet under the clients' 30 s default, so that a
# timeout the client ignored still fails.
TIMEOUT_BOUND = 15.0

# A system prompt of some 700 tokens: long enough that its cached blocks show.
LONG_SYSTEM = " ".join(
    f"Rule {i}: when the user asks about topic number {i}, answer briefly, politely and in "
    f"plain English, and cite section {i * 7 % 50} of the handbook."
    for i in range(1, 21)
)
CTX = 2048


class Daemon:
    """One kvd process and the endpoint it listens on."""

    def __init__(self, workdir: Path, *args: str, ready: str = "health", wrap: Sequence[str] = ()) -> None:
        """kvd with args (ready when it answers `ready` on its ipc:// endpoint);
        wrap: a command it runs under (e.g. ``ip netns exec NS``)."""
        for exe in ("kvd", "kvd-worker", "kvcli"):
            if not (BIN_DIR / exe).is_file():
                pytest.fail(f"{BIN_DIR / exe} is missing: build kvd first (or set KVD_BIN_DIR)")
        if not MODEL.is_file():
            pytest.fail(f"{MODEL} is missing: run scripts/fetch-model.sh (or set KVD_MODEL)")
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o700)
        self.endpoint = f"ipc://{workdir}/kvd.sock"
        self.log_path = workdir / "kvd.log"
        self._log = open(self.log_path, "wb")
        cmd = [
            *wrap, str(BIN_DIR / "kvd"), "--model", str(MODEL), "--listen", self.endpoint,
            "--ctx", str(CTX), *args,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.patience = PATIENCE  #: seconds to wait for any one reply (measure_patience)
        self._wait_ready(ready)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def _wait_ready(self, ready: str, limit: float = PATIENCE) -> None:
        deadline = time.monotonic() + limit
        with kvd_client.Client(self.endpoint, timeout=0.5) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    pytest.fail(f"kvd exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    if ready == "health" and c.health().ok:
                        return
                    if ready == "stats":
                        c.stats()
                        return
                except kvd_client.Timeout:
                    pass
                time.sleep(0.1)
        self.proc.kill()
        pytest.fail(f"kvd was not ready in {limit:g} s:\n{self.log()}")

    def measure_patience(self) -> None:
        """Sets patience from this daemon's speed: 4 times what prefilling the
        whole context would take at the speed of a short prefill measured now,
        or PATIENCE if that is longer. A reply can come no sooner than the
        prefill before it, so a slow machine must wait longer."""
        prompt = " ".join(f"w{i}" for i in range(32))   # some 64 tokens
        t = time.monotonic()
        with kvd_client.Client(self.endpoint, timeout=PATIENCE) as c:
            r = c.generate(prompt, max_tokens=1, no_cache=True)
        per_token = (time.monotonic() - t) / max(r.usage.prompt_tokens, 1)
        self.patience = max(PATIENCE, 4 * CTX * per_token)

    def stop(self) -> int:
        """SIGTERM, then the exit status (killed after PATIENCE)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=PATIENCE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        # a kvd that was killed leaves its default pool's name behind in /dev/shm
        # (it removes it itself when it exits): the tests' pools must not pile up
        Path(f"/dev/shm/kvd-{self.proc.pid}").unlink(missing_ok=True)
        return self.proc.returncode


def _stop_checked(d: Daemon) -> None:
    rc = d.stop()
    assert rc == 0, f"kvd exited with {rc} after SIGTERM:\n{d.log()}"


@pytest.fixture(scope="session")
def kvd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The daemon most tests share: one worker, 32 MiB of KV, context 2048."""
    d = Daemon(
        tmp_path_factory.mktemp("kvd"), "--kv-memory", "32MiB", "-w", "1", "--max-queue", "16"
    )
    d.measure_patience()
    yield d
    _stop_checked(d)


@pytest.fixture(scope="session")
def kvd_full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose queue holds nothing (--max-queue 0): every generate is
    OVERLOADED. It runs no worker; admission refuses before needing one."""
    d = Daemon(
        tmp_path_factory.mktemp("kvd-full"), "--kv-memory", "16MiB", "-w", "0",
        "--max-queue", "0", ready="stats",
    )
    yield d
    _stop_checked(d)


@pytest.fixture
def client(kvd: Daemon) -> Iterator[kvd_client.Client]:
    with kvd_client.Client(kvd.endpoint, timeout=kvd.patience) as c:
        yield c


@pytest.fixture
def namespace() -> str:
    """A cache namespace of this test alone, so that no other test's prompts are cached in it."""
    return f"test-{uuid.uuid4().hex}"


@pytest.fixture
def dead_endpoint(tmp_path: Path) -> str:
    """An endpoint nobody listens on."""
    return f"ipc://{tmp_path}/nobody.sock"
