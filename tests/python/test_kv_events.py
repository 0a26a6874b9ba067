"""kvd --kv-events: block events for prefix-aware routers, read by a subscriber written here from the
published format (vLLM's ZmqEventPublisher: frames [topic, 8-byte big-endian sequence, msgpack
EventBatch]; an EventBatch is [ts, events]; events are tagged arrays "BlockStored" / "BlockRemoved" /
"AllBlocksCleared"). After a mixed load that evicts, the subscriber's set of block hashes must be
exactly the set of blocks kvd can find."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]  # ships no type information
import pytest
import zmq

import kvd_client
from conftest import LONG_SYSTEM, MODEL, Daemon, _stop_checked

BLOCK = 16


class Subscriber:
    """Rebuilds the set of cached block hashes from the events, checking every message's shape."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sock.connect(endpoint)
        self.blocks: set[int] = set()
        self.tokens: dict[int, list[int]] = {}   # hash -> its block's tokens
        self.parent: dict[int, int | None] = {}
        self.topics: set[str] = set()
        self.seqs: list[int] = []
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.problems: list[str] = []
        self.mediums: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self.sock.recv_multipart()
            with self._lock:
                self._take(frames)

    def _take(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.problems.append(f"a message of {len(frames)} frames")
            return
        self.topics.add(frames[0].decode())
        self.seqs.append(int.from_bytes(frames[1], "big"))
        batch = msgpack.unpackb(frames[2], raw=False)
        if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[0], float)):
            self.problems.append(f"not an EventBatch: {batch!r:.200}")
            return
        for ev in batch[1]:
            self._event(ev)

    def _event(self, ev: Any) -> None:
        tag = ev[0]
        self.counts[tag] += 1
        if tag == "AllBlocksCleared":
            self.blocks.clear()
        elif tag == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = ev
            if block_size != BLOCK or len(tokens) != len(hashes) * BLOCK or lora_id is not None \
                    or lora_name is not None:
                self.problems.append(f"BlockStored of an odd shape: {ev!r:.200}")
            if parent is not None and parent not in self.blocks:
                self.problems.append(f"a block stored under parent {parent}, which is not cached")
            self.mediums.add(medium)
            for i, h in enumerate(hashes):
                if h in self.blocks:
                    self.problems.append(f"block {h} stored twice")
                self.blocks.add(h)
                self.tokens[h] = tokens[i * BLOCK:(i + 1) * BLOCK]
                self.parent[h] = parent if i == 0 else hashes[i - 1]
        elif tag == "BlockRemoved":
            _, hashes, medium = ev
            self.mediums.add(medium)
            for h in hashes:
                if h not in self.blocks:
                    self.problems.append(f"block {h} removed but never stored")
                self.blocks.discard(h)
        else:
            self.problems.append(f"unknown event {tag}")

    def received(self) -> int:
        """Batches received so far."""
        with self._lock:
            return len(self.seqs)

    def caught_up(self, batches: int, patience: float) -> set[int]:
        """The set once the batch numbered batches - 1 (kvd has sent `batches`) has come; fails
        after `patience` seconds without it."""
        deadline = time.monotonic() + patience
        while True:
            with self._lock:
                if self.seqs and self.seqs[-1] >= batches - 1:
                    return set(self.blocks)
            assert time.monotonic() < deadline, f"batch {batches - 1} never came ({self.seqs[-3:]})"
            time.sleep(0.01)

    def start_from(self, blocks: set[int]) -> None:
        """Takes kvd's own set as the state so far (what came before the subscription took hold
        is lost to any PUB subscriber)."""
        with self._lock:
            self.blocks = set(blocks)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def events_kvd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    work = tmp_path_factory.mktemp("kvd-events")
    ep = f"ipc://{work}/events.sock"
    # 24 MiB of f16 KV: about 68 blocks of 16 tokens, so the load below evicts
    # every namespace's token ids: the subscriber here checks each block's tokens (by default a
    # named namespace's blocks go out without them: tests/security/test_isolation.py)
    d = Daemon(work, "--kv-events-token-ids", "all", "--kv-events", ep, "--kv-memory", "24MiB", "-w", "1")
    d.measure_patience()
    yield d, ep
    _stop_checked(d)


def idle_stats(c: kvd_client.Client, patience: float) -> kvd_client.Stats:
    """kvd's stats (with the block hashes) once no request runs and no block is in use."""
    deadline = time.monotonic() + patience
    while True:
        st = c.stats(block_hashes=True)
        if st.requests_running == 0 and st.blocks_in_use == 0:
            return st
        assert time.monotonic() < deadline, "kvd never went idle"
        time.sleep(0.01)


def test_subscriber_rebuilds_the_cache_exactly(events_kvd: tuple[Daemon, str]) -> None:
    d, ep = events_kvd
    sub = Subscriber(ep)
    try:
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            # a PUB drops what it sends before a subscription takes hold, and says nothing of
            # when it does: cache short prompts until one batch arrives; from then on nothing is
            # lost. The set so far is then kvd's own, taken while idle once every batch is here.
            deadline = time.monotonic() + d.patience
            probe = 0
            while sub.received() == 0:
                assert time.monotonic() < deadline, "no batch ever reached the subscriber"
                c.generate(f"Probe {probe}: " + "the subscription is not there yet. " * 3, max_tokens=1)
                probe += 1
            st = idle_stats(c, d.patience)
            sub.caught_up(st.kv_event_batches, d.patience)
            sub.start_from(set(st.block_hashes))
            # shared system prompts, several namespaces, more distinct prompts than the pool holds
            for round_ in range(2):
                for i in range(6):
                    system = f"You are assistant number {i}. " + LONG_SYSTEM[: 700 + 150 * i]
                    c.generate(messages=[{"role": "system", "content": system},
                                         {"role": "user", "content": f"Question {round_}."}],
                               max_tokens=20, temperature=0, namespace=f"ns{i % 3}")
            # a stream dropped halfway, and a request that bypasses the cache
            with c.stream("Count slowly: one, two, three,", max_tokens=60, temperature=0,
                          ignore_eos=True) as s:
                for k, _ in enumerate(s):
                    if k == 3:
                        break
            c.generate("Nothing of this is cached. " * 8, max_tokens=4, no_cache=True)
            # the same prompt in two namespaces: two chains
            for ns in ("left", "right"):
                c.generate("The same words in two namespaces. " * 6, max_tokens=2, namespace=ns)
            # idle, then the truth: the set after kvd's last batch against kvd's own
            st = idle_stats(c, d.patience)
            got = sub.caught_up(st.kv_event_batches, d.patience)
        assert st.evictions > 0, "the load must evict for this test to mean anything"
        assert sub.problems == []
        assert sub.counts["BlockStored"] > 0 and sub.counts["BlockRemoved"] > 0
        assert got == set(st.block_hashes)
        assert len(got) == st.blocks_cached    # idle: every cached block is findable, and only those
        assert sub.mediums == {"CPU"}
        host = socket.gethostname()
        assert sub.topics == {f"kv@{host}@{MODEL.name.removesuffix('.gguf')}"}
        # sequence numbers: consecutive, none lost
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
        assert st.kv_event_batches == sub.seqs[-1] + 1
        # the same prompt in two namespaces is two different chains
        firsts = [tuple(sub.tokens[h]) for h, p in sub.parent.items() if p is None and h in got]
        assert any(firsts.count(t) == 2 for t in firsts)
    finally:
        sub.close()


def test_options_are_checked(tmp_path: Path) -> None:
    import subprocess
    from conftest import BIN_DIR
    r = subprocess.run([str(BIN_DIR / "kvd"), "--model", str(MODEL), "--kv-events", "tcp://*:5557"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--allow-remote" in r.stderr
    r = subprocess.run([str(BIN_DIR / "kvd"), "--model", str(MODEL), "--kv-events-topic", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--kv-events-topic goes with --kv-events" in r.stderr
