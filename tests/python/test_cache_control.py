"""Explicit prompt-cache control (issue 40): pins with a TTL, their limits and
tenants, pins through a restart, and usage that says what was written to the
cache and read from it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvd_client
from conftest import Daemon, _stop_checked

BT = 16  # kvd's default block tokens


def text(tag: str, n: int) -> str:
    """A prompt of distinct sentences (some 14 tokens each) that starts with tag."""
    return " ".join(f"{tag} rule {i}: the {tag} answer to item {i} cites page {i * 7 % 97}." for i in range(n))


def chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def sums(u: kvd_client.Usage) -> None:
    """Usage adds up: read + written + computed without caching = prompt tokens."""
    assert u.uncached_prompt_tokens >= 0, u
    assert u.cached_prompt_tokens + u.cache_creation_tokens + u.uncached_prompt_tokens == u.prompt_tokens
    assert u.cache_creation_tokens % BT == 0 and u.cached_prompt_tokens % BT == 0, u
    assert u.cached_blocks * BT == u.cached_prompt_tokens + u.cache_creation_tokens, u


@pytest.fixture(scope="module")
def kvd_pins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("kvd-pins"), "--kv-memory", "96MiB", "-w", "1",
               "--tenant-max-blocks", "120", "--pin-max-ttl", "900")
    d.measure_patience()
    yield d
    _stop_checked(d)


@pytest.fixture(autouse=True)
def no_pins_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails half-way leaves no pin to the next (its blocks would
    count against the next one's limits and fail it too)."""
    yield
    if "kvd_pins" in request.fixturenames:
        d: Daemon = request.getfixturevalue("kvd_pins")
        with kvd_client.Client(d.endpoint, timeout=d.patience) as c:
            for p in c.cache_list():
                c.cache_unpin(p.id)


def flood(c: kvd_client.Client, tag: str) -> None:
    """Distinct prompts until the pool has been refilled more than once over."""
    total = c.stats().blocks_total
    before = c.stats().evictions
    for i in range(12):
        c.generate(text(f"{tag}{i}", 50), max_tokens=1, temperature=0, namespace=f"flood-{tag}")
        if c.stats().evictions - before > total:
            return
    pytest.fail("the flood did not evict a pool's worth of blocks")


def test_pin_outlives_a_flood_and_expires(kvd_pins: Daemon) -> None:
    ns = "pins-flood"
    with kvd_client.Client(kvd_pins.endpoint, timeout=kvd_pins.patience) as c:
        big = text("Alpha", 75)
        assert 1400 <= len(c.tokenize(messages=[{"role": "system", "content": big}])) <= 1700
        r = c.generate(messages=chat(big, "Hi"), prefill_only=True, pin_ttl="5m", pin_messages=1,
                       namespace=ns)
        assert r.pin is not None and r.pin.ttl_s == 300 and r.pin.tokens >= 1400, r.pin_error
        assert r.pin.tokens % BT == 0 and r.pin.blocks == r.pin.tokens // BT
        sums(r.usage)
        short_ttl = c.generate(messages=chat(text("Beta", 25), "Hi"), prefill_only=True, pin_ttl=2,
                               pin_messages=1, namespace=ns)
        assert short_ttl.pin is not None and short_ttl.pin.ttl_s == 2, short_ttl.pin_error
        control = c.generate(messages=chat(text("Gamma", 25), "Hi"), prefill_only=True, namespace=ns)
        assert control.pin is None
        ids = {p.id for p in c.cache_list()}
        assert {r.pin.id, short_ttl.pin.id} <= ids
        time.sleep(3.5)
        ids = {p.id for p in c.cache_list()}
        assert r.pin.id in ids and short_ttl.pin.id not in ids
        st = c.stats()
        assert st.pins_expired >= 1 and st.pinned_blocks == r.pin.blocks
        flood(c, "flood1")
        again = c.generate(messages=chat(big, "What is rule 3?"), max_tokens=1, temperature=0, namespace=ns)
        assert again.usage.cached_prompt_tokens >= r.pin.tokens
        sums(again.usage)
        gone = c.generate(messages=chat(text("Beta", 25), "Hi"), max_tokens=1, namespace=ns)
        assert gone.usage.cached_prompt_tokens == 0
        ctl = c.generate(messages=chat(text("Gamma", 25), "Hi"), max_tokens=1, namespace=ns)
        assert ctl.usage.cached_prompt_tokens == 0
        listed = [p for p in c.cache_list() if p.id == r.pin.id][0]
        assert listed.hits >= 1
        # renewing the same prefix keeps one pin, with a new TTL
        r2 = c.generate(messages=chat(big, "Hi"), prefill_only=True, pin_ttl=600, pin_messages=1,
                        namespace=ns)
        assert r2.pin is not None and r2.pin.id == r.pin.id and r2.pin.ttl_s == 600, r2.pin_error
        assert r2.pin.expires_unix_ms > r.pin.expires_unix_ms
        assert len([p for p in c.cache_list() if p.id == r.pin.id]) == 1
        c.cache_unpin(r.pin.id)
        assert r.pin.id not in {p.id for p in c.cache_list()}


def test_limits_and_tenants(kvd_pins: Daemon) -> None:
    alice, bob = "tenant:alice/x", "tenant:bob/x"
    with kvd_client.Client(kvd_pins.endpoint, timeout=kvd_pins.patience) as c:
        with pytest.raises(kvd_client.BadRequest, match="pin-max-ttl"):
            c.generate("short prompt " * 40, prefill_only=True, pin_ttl=901, namespace=alice)
        big = text("Delta", 75)
        r = c.generate(messages=chat(big, "Hi"), prefill_only=True, pin_ttl="5m", pin_messages=1,
                       namespace=alice)
        assert r.pin is not None and r.pin.tenant == "alice" and r.pin.blocks > 60, r.pin_error
        with pytest.raises(kvd_client.BadRequest, match="tenant-max-blocks"):
            c.generate(messages=chat(text("Epsilon", 40), "Hi"), prefill_only=True, pin_ttl=60,
                       pin_messages=1, namespace=alice)
        assert [p.id for p in c.cache_list(namespace=bob)] == []
        assert r.pin.id in [p.id for p in c.cache_list(namespace=alice)]
        with pytest.raises(kvd_client.NotFound):
            c.cache_unpin(r.pin.id, namespace=bob)
        with pytest.raises(kvd_client.NotFound):
            c.cache_evict(r.pin.id, namespace=bob)
        st = c.stats()
        row = [t for t in st.tenants if t.name == "alice"][0]
        assert row.pins == 1 and row.pinned_blocks == r.pin.blocks and row.cache_creation_tokens > 0
        assert st.pins_refused >= 2
        gone = c.cache_evict(r.pin.id, namespace=alice)
        assert gone.id == r.pin.id
        assert c.cache_list(namespace=alice) == []
        after = c.generate(messages=chat(big, "Hi"), max_tokens=1, namespace=alice)
        assert after.usage.cached_prompt_tokens == 0


def test_usage_adds_up(kvd_pins: Daemon) -> None:
    with kvd_client.Client(kvd_pins.endpoint, timeout=kvd_pins.patience) as c:
        for kind in ("chat", "prompt", "ids"):
            ns = f"usage-{kind}-{time.monotonic_ns()}"
            body = text("Zeta" + kind, 20)
            kw: dict[str, object]
            if kind == "chat":
                kw = {"messages": chat(body, "Hi")}
            elif kind == "prompt":
                kw = {"prompt": body}
            else:
                kw = {"token_ids": c.tokenize(body)}
            r1 = c.generate(**kw, max_tokens=4, temperature=0, namespace=ns)  # type: ignore[arg-type]
            sums(r1.usage)
            assert r1.usage.cached_prompt_tokens == 0
            assert r1.usage.cache_creation_tokens == r1.usage.prompt_tokens // BT * BT
            r2 = c.generate(**kw, max_tokens=4, temperature=0, namespace=ns)  # type: ignore[arg-type]
            sums(r2.usage)
            assert r2.usage.cached_prompt_tokens == (r1.usage.prompt_tokens - 1) // BT * BT
            nc = c.generate(**kw, max_tokens=1, no_cache=True, namespace=ns)  # type: ignore[arg-type]
            sums(nc.usage)
            assert nc.usage.cached_prompt_tokens == nc.usage.cache_creation_tokens == 0
        st = c.stats()
        assert st.cache_creation_tokens > 0


def test_usage_adds_up_when_preempted(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "kvd", "--kv-memory", "16MiB", "-w", "1")
    try:
        results: list[kvd_client.Result] = []
        errs: list[BaseException] = []

        def one(i: int) -> None:
            try:
                with kvd_client.Client(d.endpoint, timeout=300) as c:
                    results.append(c.generate(text(f"Eta{i}", 8), max_tokens=300, ignore_eos=True,
                                              temperature=0))
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errs, errs
        with kvd_client.Client(d.endpoint, timeout=30) as c:
            assert c.stats().preemptions > 0
        for r in results:
            sums(r.usage)
            assert r.usage.cache_creation_tokens == r.usage.prompt_tokens // BT * BT
    finally:
        _stop_checked(d)


def test_pins_survive_a_restart(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ("--kv-memory", "96MiB", "-w", "1", "--cache-dir", str(cache))
    d = Daemon(tmp_path / "k1", *args)
    big = text("Theta", 75)
    try:
        with kvd_client.Client(d.endpoint, timeout=300) as c:
            r = c.generate(messages=chat(big, "Hi"), prefill_only=True, pin_ttl="1h", pin_messages=1)
            assert r.pin is not None
    finally:
        _stop_checked(d)
    assert (cache / "pins").is_file()
    d = Daemon(tmp_path / "k2", *args)
    try:
        assert "pins: 1 taken again" in d.log()
        with kvd_client.Client(d.endpoint, timeout=300) as c:
            pins = c.cache_list()
            assert [p.id for p in pins] == [r.pin.id]
            assert pins[0].expires_unix_ms == r.pin.expires_unix_ms and pins[0].blocks == r.pin.blocks
            assert c.stats().pinned_blocks == r.pin.blocks
            again = c.generate(messages=chat(big, "Hi"), max_tokens=1)
            assert again.usage.cached_prompt_tokens >= r.pin.tokens
            sums(again.usage)
    finally:
        _stop_checked(d)


def test_concurrent_pins_of_one_prefix(kvd_pins: Daemon) -> None:
    """Requests that pin the same prefix at once all succeed: each has the pin
    or says why not (its prefix was still being computed by another), and one
    pin holds the prefix afterwards."""
    ns = f"pins-race-{time.monotonic_ns()}"
    body = text("Iota", 30)
    results: list[kvd_client.Result] = []
    errs: list[BaseException] = []

    def one() -> None:
        try:
            with kvd_client.Client(kvd_pins.endpoint, timeout=kvd_pins.patience) as c:
                results.append(c.generate(messages=chat(body, "Hi"), max_tokens=2, temperature=0, pin_ttl=60,
                                          pin_messages=1, namespace=ns))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=one) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs, errs
    assert len(results) == 4
    for r in results:
        assert (r.pin is None) == (r.pin_error != ""), (r.pin, r.pin_error)
        assert r.pin is not None or "not pinned" in r.pin_error
        sums(r.usage)
    ids = {r.pin.id for r in results if r.pin is not None}
    assert len(ids) == 1
    with kvd_client.Client(kvd_pins.endpoint, timeout=kvd_pins.patience) as c:
        mine = [p for p in c.cache_list() if p.namespace == ns]
        assert [p.id for p in mine] == list(ids)
        c.cache_unpin(mine[0].id)
