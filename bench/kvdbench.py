"""What the Python benchmarks share: a kvd started for one run, a free loopback port, and the
page cache dropped."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import kvd_client


class Kvd:
    """kvd with --model and an ipc:// endpoint in work (plus extra arguments),
    ready (healthy) when constructed; stop() ends it."""

    def __init__(self, bin_dir: Path, model: Path, work: Path, extra: list[str],
                 env: dict[str, str] | None = None) -> None:
        work.mkdir(parents=True, exist_ok=True)
        work.chmod(0o700)
        self.endpoint = f"ipc://{work}/kvd.sock"
        self.log = open(work / "kvd.log", "wb")
        self.proc = subprocess.Popen(
            [str(bin_dir / "kvd"), "--model", str(model), "--listen", self.endpoint, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        with kvd_client.Client(self.endpoint, timeout=0.5) as c:
            for _ in range(1200):
                try:
                    if c.health().ok:
                        return
                except kvd_client.Timeout:
                    pass
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        raise SystemExit(f"kvd did not start (see {work}/kvd.log)")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=300)
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def drop_page_cache() -> bool:
    """Drops the page cache (as root); False where that is not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
