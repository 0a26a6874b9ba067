"""Wrong answers to odd input (issue 38, items 14-15): seeds at the ends of the
int64 range, repetition penalties past the sampler's range, and what a remote
worker may ask of kvd (its fence time, its pool's size)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import zmq

import kvd_client
from conftest import BIN_DIR, MODEL, Kvd, wait_for

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
PROMPT = "Write a short poem about the sea:"


def _texts(k: Kvd, seed: int, n: int) -> list[str]:
    s, b = k.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "top_k": 0,
                                      "top_p": 1.0, "n": n, "seed": seed})
    assert s == 200, (seed, b)
    return [c["text"] for c in sorted(b["choices"], key=lambda c: c["index"])]


def _status(k: Kvd, code: int) -> float:
    return k.metrics().get(f'kvd_http_requests_total{{code="{code}"}}', 0.0)


def test_seed_extremes(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 14: seeds -9223372036854775808 and 9223372036854775807 with n=2 (signed overflows: UBSan
    aborted kvd, and the choices were not reproducible) are answered, the same each time; choice i
    takes seed + i, wrapping, so choice 1 of INT64_MAX is choice 0 of INT64_MIN, and choice 1 of -1
    is choice 0 of 0. Seeds outside int64 are a 400."""
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", http=True)
    kvds.append(k)
    lo, hi = _texts(k, INT64_MIN, 2), _texts(k, INT64_MAX, 2)
    assert _texts(k, INT64_MIN, 2) == lo and _texts(k, INT64_MAX, 2) == hi, "not reproducible"
    assert hi[1] == _texts(k, INT64_MIN, 1)[0], "choice 1 of INT64_MAX should take seed INT64_MIN"
    minus = _texts(k, -1, 2)
    assert minus[1] == _texts(k, 0, 1)[0], "choice 1 of seed -1 should take seed 0"
    # the control: the seed decides (otherwise every comparison above holds trivially)
    assert len({t for s in (0, 1, 2, 3, INT64_MIN, INT64_MAX) for t in _texts(k, s, 1)}) > 1
    for seed in (INT64_MAX + 1, INT64_MIN - 1, 1 << 64):
        s, b = k.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "seed": seed})
        assert s == 400, (seed, s, b)
    assert _status(k, 500) == 0
    assert k.proc.poll() is None and k.http("GET", "/health")[0] == 200
    k.stop()


def test_repetition_penalty_range(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 14: a repetition_penalty outside the sampler's (0, 10] is a 400 naming it (in (10, 100] it
    passed both checks and the worker's sampler failed it: a 500); 10 and 1 are served. The ZeroMQ API
    refuses the same with BadRequest."""
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", http=True)
    kvds.append(k)
    for p in (50, 10.5, 100, 0, -1):
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
            s, b = k.post(path, {**body, "max_tokens": 2, "repetition_penalty": p})
            assert s == 400 and b["error"]["param"] == "repetition_penalty", (p, path, s, b)
    for p in (10, 1):
        s, b = k.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "repetition_penalty": p})
        assert s == 200, (p, b)
    with k.client() as c:
        for p in (50.0, 10.5):
            with pytest.raises(kvd_client.BadRequest, match="repeat_penalty"):
                c.generate(PROMPT, max_tokens=2, repeat_penalty=p)
        assert c.generate(PROMPT, max_tokens=2, repeat_penalty=10.0).text is not None
    assert _status(k, 500) == 0
    assert [w.restarts for w in k.stats().workers] == [0]      # no worker failed on a penalty
    k.stop()


def test_remote_worker_bounds(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 15: a worker of another host whose --fence-ms is over --max-fence-ms (default 60 s; a fence
    of 2^32 ms held a lost worker's blocks for 99 days), or whose pool is over --host-max-blocks, is
    refused and its host never joins; a worker within both (a fence of exactly 60 s) joins and serves."""
    wep = f"ipc://{tmp_path}/kvd/workers.sock"
    k = Kvd(tmp_path / "kvd", "--kv-memory", "16MiB", "--worker-endpoint", wep, "--host-max-blocks", "64",
            workers=0)
    kvds.append(k)
    tag = uuid.uuid4().hex[:8]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}

    def worker(host: str, wid: int, fence_ms: int, kv: str) -> None:
        logs[host] = tmp_path / f"worker-{host}.log"
        with open(logs[host], "wb") as log:
            procs[host] = subprocess.Popen(
                [str(BIN_DIR / "kvd-worker"), "--model", str(MODEL), "--pool", f"kvdsec-{tag}-{host}", "--connect", wep,
                 "--id", str(wid), "--host", host, "--kv-memory", kv, "--threads", "1", "--ctx", "2048",
                 "--fence-ms", str(fence_ms)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def hosts() -> dict[str, Any]:
        return {h.name: h for h in k.stats().hosts if h.name}

    try:
        worker("far", 1, 3600000, "16MiB")      # kvd-worker's own upper bound: an hour
        worker("big", 2, 10000, "40MiB")        # some 113 blocks of 360 KiB
        worker("ok", 3, 60000, "16MiB")         # 45 blocks, the longest fence kvd takes
        wait_for("the far host refused", lambda: "host far: refused: its --fence-ms 3600000 is outside 1000..60000"
                 in k.log())
        wait_for("the big host refused", lambda: "host big: refused: its pool of" in k.log() and
                 "blocks is over --host-max-blocks 64" in k.log())
        wait_for("the host within bounds joined", lambda: "ok" in hosts() and hosts()["ok"].workers == 1)
        with k.client() as c:
            r = c.generate(PROMPT, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        rows = hosts()
        assert set(rows) == {"ok"}, rows
        assert rows["ok"].requests == 1
        assert procs["far"].poll() is None and procs["big"].poll() is None, "refused workers wait to be let in"
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for host in ("far", "big", "ok"):
            Path(f"/dev/shm/kvdsec-{tag}-{host}").unlink(missing_ok=True)
    k.stop()


# A worker's Ready, taken from a real kvd-worker and changed field by field: the
# few protobuf wire types it uses (varints, length-delimited), written out here.

def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _fields(buf: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of a message."""
    out: list[tuple[int, int, int | bytes]] = []
    i = 0

    def varint() -> int:
        nonlocal i
        v, shift = 0, 0
        while True:
            b = buf[i]
            i += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v
    while i < len(buf):
        key = varint()
        num, wt = key >> 3, key & 7
        if wt == 0:
            out.append((num, wt, varint()))
        elif wt == 2:
            n = varint()
            out.append((num, wt, buf[i:i + n]))
            i += n
        else:
            raise AssertionError(f"wire type {wt} in a Ready")
    return out


def _message(fields: list[tuple[int, int, int | bytes]]) -> bytes:
    out = bytearray()
    for num, wt, v in fields:
        out += _varint(num << 3 | wt)
        out += _varint(v) if isinstance(v, int) else _varint(len(v)) + v
    return bytes(out)


def _ready_with(payload: bytes, worker_id: int, **ready: int | bytes) -> bytes:
    """A FromWorker (version 1, worker_id 2, ready 3) with the Ready's fields replaced: pid 1, host 5,
    pool_blocks 7, fence_ms 8."""
    numbers = {"pid": 1, "host": 5, "pool_blocks": 7, "fence_ms": 8}
    top = []
    for num, wt, v in _fields(payload):
        if num == 2:
            v = worker_id
        elif num == 3:
            assert isinstance(v, bytes)
            inner = {n: (w, x) for n, w, x in _fields(v)}
            for name, value in ready.items():
                inner[numbers[name]] = (2 if isinstance(value, bytes) else 0, value)
            v = _message([(n, w, x) for n, (w, x) in sorted(inner.items())])
        top.append((num, wt, v))
    return _message(top)


def test_remote_worker_extremes(tmp_path: Path, kvds: list[Kvd]) -> None:
    """Item 15, the values kvd-worker's own options cannot make: a Ready naming a fence of 2^32 - 1 ms
    (99 days), 999 ms or 0, or a pool of 4,194,304 blocks (kvd would keep metadata for all), is
    refused; the same Ready with the real worker's values joins (the control)."""
    wep = f"ipc://{tmp_path}/kvd/workers.sock"
    k = Kvd(tmp_path / "kvd", "--kv-memory", "16MiB", "--worker-endpoint", wep, workers=0)
    kvds.append(k)
    # a real worker's Ready, caught on a socket of our own
    ctx = zmq.Context()
    catch = ctx.socket(zmq.ROUTER)
    catch.bind(f"ipc://{tmp_path}/catch.sock")
    pool = f"kvdsec-{uuid.uuid4().hex[:8]}"
    w = subprocess.Popen([str(BIN_DIR / "kvd-worker"), "--model", str(MODEL), "--pool", pool, "--connect",
                          f"ipc://{tmp_path}/catch.sock", "--id", "9", "--host", "real", "--kv-memory", "16MiB",
                          "--threads", "1", "--ctx", "2048"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert catch.poll(int(k.patience * 1000)), "the worker sent no Ready"
        frames = catch.recv_multipart()
    finally:
        w.terminate()
        w.wait(60)
        Path(f"/dev/shm/{pool}").unlink(missing_ok=True)
        catch.close(0)
    assert len(frames) == 2
    payload = frames[1]
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(wep)
    try:
        cases = [("h1", {"fence_ms": (1 << 32) - 1}, "its --fence-ms 4294967295 is outside 1000..60000"),
                 ("h2", {"fence_ms": 999}, "its --fence-ms 999 is outside 1000..60000"),
                 ("h3", {"fence_ms": 0}, "its --fence-ms 0 is outside 1000..60000"),
                 ("h4", {"pool_blocks": 1 << 22}, "its pool of 4194304 blocks is over --host-max-blocks 262144")]
        for i, (host, change, why) in enumerate(cases):
            dealer.send(_ready_with(payload, 20 + i, host=host.encode(), **change))
            wait_for(f"Ready {change} refused", lambda: f"host {host}: refused: {why}" in k.log())
        dealer.send(_ready_with(payload, 30, host=b"h5"))
        wait_for("the unchanged Ready taken", lambda: "on host h5): ready" in k.log())
        assert {h.name for h in k.stats().hosts if h.name} <= {"h5"}
        assert not any(f"on host h{i}): ready" in k.log() for i in range(1, 5))
    finally:
        dealer.close(0)
        ctx.term()
    k.stop()


def test_schemas_that_blow_up_are_refused(tmp_path: Path, kvds: list[Kvd]) -> None:
    """A structured output's schema whose grammar would pass GRAMMAR_MAX_STATES (a 40-byte pattern
    whose automaton doubles per character) is a 400 naming the bound, and kvd goes on serving; one
    that fits is served, and again from the schemas kvd keeps."""
    k = Kvd(tmp_path / "kvd", "--kv-memory", "32MiB", http=True)
    kvds.append(k)
    for n in (24, 30, 40):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "(a|b)*a(a|b){%d}" % n}}}
        s, b = k.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                "response_format": fmt, "max_tokens": 4})
        assert s == 400 and "states" in b["error"]["message"], b
    ok = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    for _ in range(2):
        s, b = k.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                "response_format": ok, "max_tokens": 16, "temperature": 0})
        assert s == 200 and isinstance(b["choices"][0]["message"]["content"], str), b
    assert k.http("GET", "/health")[0] == 200
    k.stop()
