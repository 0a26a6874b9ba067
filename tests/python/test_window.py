"""Context windowing on the serving path (issue 40): a sequence that reaches kvd's --ctx keeps its
first --sinks tokens and the newer half of the rest and goes on, through kvd's Window exchange
with its worker, instead of ending; its blocks stay bounded however long it runs."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import kvd_client
from conftest import MODEL, Daemon, _stop_checked

CTX = 128           # positions: 8 blocks of 16
BT = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    port = free_port()
    d = Daemon(tmp_path_factory.mktemp("window"), "--ctx", str(CTX), "--kv-memory", "16MiB", "-w", "1",
               "--http", f"127.0.0.1:{port}")
    d.port = port  # type: ignore[attr-defined]
    yield d
    _stop_checked(d)


def test_window_runs_past_the_context_with_bounded_blocks(small: Daemon) -> None:
    """A greedy generation of 4x the context finishes, every token there, while the blocks in use
    (polled) never pass what one context holds plus the copies a window makes."""
    peak = 0
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        with kvd_client.Client(small.endpoint, timeout=small.patience) as c:
            while not done.is_set():
                s = c.stats()
                peak = max(peak, s.blocks_in_use + s.blocks_pending)
                time.sleep(0.02)

    t = threading.Thread(target=poll)
    t.start()
    try:
        with kvd_client.Client(small.endpoint, timeout=small.patience) as c:
            r = c.generate("Once upon a time", max_tokens=4 * CTX, temperature=0, ignore_eos=True,
                           context_overflow="window", namespace="window-a")
    finally:
        done.set()
        t.join()
    assert r.usage.completion_tokens == 4 * CTX
    assert r.finish_reason == "length"
    assert len(r.token_ids) == 4 * CTX
    # one context's blocks, plus at most half of them as private copies while a window is made
    assert 0 < peak <= CTX // BT + CTX // BT // 2 + 1, peak
    # the same request without windowing ends at the context
    with kvd_client.Client(small.endpoint, timeout=small.patience) as c:
        s = c.generate("Once upon a time", max_tokens=4 * CTX, temperature=0, ignore_eos=True,
                       context_overflow="stop", namespace="window-b")
    assert s.finish_reason == "length"
    assert s.usage.prompt_tokens + s.usage.completion_tokens <= CTX
    # up to the context both produced the same tokens (windowing changes nothing before it)
    n = len(s.token_ids)
    assert r.token_ids[:n - 1] == s.token_ids[:n - 1]
    # nothing is left held when it is over
    with kvd_client.Client(small.endpoint, timeout=small.patience) as c:
        st = c.stats()
    assert st.blocks_in_use == 0 and st.blocks_pending == 0


def test_window_over_http_and_streamed(small: Daemon) -> None:
    """The OpenAI API's kvd field: a streamed completion windows too, and a bad value is a 400
    naming it."""
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{small.port}/v1", api_key="none",  # type: ignore[attr-defined]
                        timeout=small.patience, max_retries=0)
    usage = None
    pieces = 0
    for ev in oai.completions.create(model=MODEL.name.removesuffix(".gguf"), prompt="The list of numbers:", max_tokens=3 * CTX,
                                     temperature=0, stream=True, stream_options={"include_usage": True},
                                     extra_body={"ignore_eos": True, "context_overflow": "window"}):
        if ev.usage is not None:
            usage = ev.usage
        if ev.choices:
            pieces += 1
    assert usage is not None and usage.completion_tokens == 3 * CTX
    assert pieces > 1
    with pytest.raises(openai.BadRequestError, match="context_overflow"):
        oai.completions.create(model=MODEL.name.removesuffix(".gguf"), prompt="hi", extra_body={"context_overflow": "slide"})


def test_window_refused_where_it_cannot(tmp_path: Path) -> None:
    """A context too short for the sinks refuses a request that asks for windowing, by name."""
    d = Daemon(tmp_path / "short", "--ctx", "32", "--kv-memory", "16MiB", "-w", "1")
    try:
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            with pytest.raises(kvd_client.BadRequest, match="context_overflow"):
                c.generate("hi", max_tokens=64, context_overflow="window")
            # kvd's default is stop: the request ends at the context
            r = c.generate("hi", max_tokens=64, ignore_eos=True, temperature=0)
            assert r.finish_reason == "length" and r.usage.prompt_tokens + r.usage.completion_tokens <= 32
    finally:
        _stop_checked(d)


def test_windowed_request_survives_its_worker(small: Daemon) -> None:
    """A worker killed after its sequence has windowed: kvd resumes the request on the restarted
    worker from the windowed history (the sinks and the newer tokens), and it still finishes with
    every token asked for."""
    import os
    import signal

    out: dict[str, object] = {}

    def run() -> None:
        with kvd_client.Client(small.endpoint, timeout=small.patience) as c:
            out["r"] = c.generate("Once upon a time", max_tokens=8 * CTX, temperature=0, ignore_eos=True,
                                  context_overflow="window", namespace="window-kill")

    t = threading.Thread(target=run)
    t.start()
    with kvd_client.Client(small.endpoint, timeout=small.patience) as c:
        # wait until it has run past the context at least once (positions its worker computed)
        base = sum(w.tokens for w in c.stats().workers)
        deadline = time.monotonic() + small.patience
        while time.monotonic() < deadline:
            if sum(w.tokens for w in c.stats().workers) - base >= 2 * CTX:
                break
            time.sleep(0.01)
        pids = [w.pid for w in c.stats().workers if w.alive and w.pid > 0]
        assert pids
        os.kill(pids[0], signal.SIGKILL)
    t.join(timeout=small.patience)
    r = out["r"]
    assert isinstance(r, kvd_client.Result)
    assert r.usage.completion_tokens == 8 * CTX
    assert r.finish_reason == "length"
    with kvd_client.Client(small.endpoint, timeout=small.patience) as c:
        assert sum(w.restarts for w in c.stats().workers) >= 1     # it really was killed
