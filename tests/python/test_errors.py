"""Errors: kvd's (overload, bad arguments, too long, deadline) as the right
exceptions; timeouts when no daemon answers; replies out of the protocol."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from conftest import LONG_SYSTEM, PATIENCE, TIMEOUT_BOUND, Daemon

import kvd_client
from kvd_client import Client, kvd_pb2


def test_overloaded(kvd_full: Daemon) -> None:
    with Client(kvd_full.endpoint, timeout=PATIENCE) as c:
        with pytest.raises(kvd_client.Overloaded) as e:
            c.generate("Hi", max_tokens=4)
        assert e.value.code == kvd_pb2.ERR_OVERLOADED
        assert e.value.code_name == "ERR_OVERLOADED"
        assert e.value.retry_after_ms is not None and e.value.retry_after_ms > 0
        assert "queue is full" in e.value.message
        assert isinstance(e.value, kvd_client.KvdError)
        # a stream is refused when it starts
        with pytest.raises(kvd_client.Overloaded):
            with c.stream("Hi"):
                pass
        # the client is still usable
        assert c.stats().requests_running == 0


@pytest.mark.parametrize(
    "kwargs, where",
    [
        (dict(prompt="Hi", top_p=7), "top_p"),                      # kvd's range check
        (dict(prompt="Hi", temperature=-1), "temperature"),
        (dict(messages=[("robot", "Hi")]), "role"),
        (dict(token_ids=[10**8]), "token id"),                      # past the vocabulary
        (dict(prompt="Hi", stop=[""]), "stop"),
        (dict(prompt="Hi", max_tokens=-1), "max_tokens"),           # refused locally
        (dict(prompt="Hi", messages=[("user", "Hi")]), "exactly one"),
        (dict(), "exactly one"),
        (dict(messages=[{"role": "user"}]), "messages[0]"),
    ],
)
def test_bad_request(client: Client, kwargs: dict[str, object], where: str) -> None:
    with pytest.raises(kvd_client.BadRequest) as e:
        client.generate(**kwargs)  # type: ignore[arg-type]
    assert e.value.code == kvd_pb2.ERR_BAD_REQUEST
    assert where in e.value.message
    assert isinstance(e.value, ValueError)
    assert client.health().ok


def test_too_long(client: Client) -> None:
    with pytest.raises(kvd_client.TooLong) as e:
        client.generate("word " * 3000, max_tokens=1)       # over --ctx 2048
    assert e.value.code == kvd_pb2.ERR_TOO_LONG
    assert "context" in e.value.message
    with pytest.raises(kvd_client.TooLong) as e:
        client.generate("x" * (9 << 20), max_tokens=1)      # over kvd's 8 MiB of prompt
    assert e.value.request_id is not None
    with pytest.raises(kvd_client.TooLong) as e:
        client.generate("x" * (17 << 20), max_tokens=1)     # over the frame limit: not sent
    assert "frame limit" in e.value.message
    assert client.health().ok


def test_deadline(client: Client) -> None:
    with pytest.raises(kvd_client.DeadlineExceeded) as e:
        client.generate(
            messages=[{"role": "system", "content": LONG_SYSTEM},
                      {"role": "user", "content": "Hello"}],
            max_tokens=8, deadline_ms=1, no_cache=True,
        )
    assert e.value.code == kvd_pb2.ERR_DEADLINE
    st = client.stats()
    assert (st.requests_running, st.blocks_in_use) == (0, 0)


def timed(fn: Callable[[], object]) -> float:
    """Seconds until fn raised Timeout."""
    t = time.monotonic()
    with pytest.raises(kvd_client.Timeout) as e:
        fn()
    assert isinstance(e.value, TimeoutError) and e.value.code is None
    return time.monotonic() - t


def test_no_daemon_is_a_timeout(dead_endpoint: str) -> None:
    with Client(dead_endpoint, timeout=0.3) as c:
        for call in (lambda: c.generate("Hi"), c.stats, c.health, lambda: c.cancel(1),
                     lambda: list(c.stream("Hi"))):
            assert 0.25 <= timed(call) < TIMEOUT_BOUND


# ---- a fake kvd: a ROUTER socket the test drives by hand ----------------------------------


class FakeKvd:
    """Receives requests; the test decides what to answer."""

    def __init__(self, tmp: Path) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"ipc://{tmp}/fake.sock"
        self.sock.bind(self.endpoint)

    def recv(self, timeout: float = PATIENCE) -> tuple[bytes, kvd_pb2.ClientRequest]:
        assert self.sock.poll(int(timeout * 1000)), "the client sent nothing"
        rid, frame = self.sock.recv_multipart()
        req = kvd_pb2.ClientRequest()
        req.ParseFromString(frame)
        return rid, req

    def send(self, rid: bytes, reply: kvd_pb2.ServerReply | bytes) -> None:
        if isinstance(reply, kvd_pb2.ServerReply):
            reply.version = 1
            reply = reply.SerializeToString()
        self.sock.send_multipart([rid, reply])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeKvd]:
    f = FakeKvd(tmp_path)
    yield f
    f.close()


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Runs fn in a thread; join() it, then out[0] is its result or exception."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # handed to the test
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def join(t: threading.Thread) -> None:
    t.join(PATIENCE)
    assert not t.is_alive(), "the client call did not return"


def test_silent_daemon_is_a_timeout_and_a_cancel(fake: FakeKvd) -> None:
    with Client(fake.endpoint, timeout=0.3) as c:
        t, out = in_thread(lambda: c.generate("Hi"))
        rid, req = fake.recv()
        assert req.WhichOneof("body") == "generate" and req.generate.prompt == "Hi"
        assert req.generate.stream  # chunks are asked for even for a whole generate
        assert req.version == 1 and req.request_id != 0
        join(t)
        assert isinstance(out[0], kvd_client.Timeout)
        _, cancel = fake.recv()
        assert cancel.WhichOneof("body") == "cancel"
        assert cancel.cancel.target == req.request_id


def test_async_silent_daemon_is_a_timeout_and_a_cancel(fake: FakeKvd) -> None:
    async def go() -> object:
        async with kvd_client.AsyncClient(fake.endpoint, timeout=0.3) as c:
            return await c.generate("Hi")

    t, out = in_thread(lambda: asyncio.run(go()))
    _, req = fake.recv()
    join(t)
    assert isinstance(out[0], kvd_client.Timeout)
    _, cancel = fake.recv()
    assert cancel.cancel.target == req.request_id


def test_replies_out_of_order_are_a_protocol_error(fake: FakeKvd) -> None:
    with Client(fake.endpoint, timeout=PATIENCE) as c:
        t, out = in_thread(lambda: c.generate("Hi"))
        rid, req = fake.recv()
        # a reply to some other request is skipped
        other = kvd_pb2.ServerReply(request_id=req.request_id + 1000)
        other.error.code = kvd_pb2.ERR_INTERNAL
        other.error.message = "not yours"
        fake.send(rid, other)
        ok = kvd_pb2.ServerReply(request_id=req.request_id)
        ok.accepted.prompt_tokens = 2
        fake.send(rid, ok)
        bad = kvd_pb2.ServerReply(request_id=req.request_id)
        bad.chunk.seq = 1          # chunk 0 never came
        bad.chunk.text = "x"
        fake.send(rid, bad)
        join(t)
        assert isinstance(out[0], kvd_client.ProtocolError)
        assert "chunk 1, expected 0" in str(out[0])
        _, cancel = fake.recv()
        assert cancel.cancel.target == req.request_id


def test_garbage_is_a_protocol_error(fake: FakeKvd) -> None:
    with Client(fake.endpoint, timeout=PATIENCE) as c:
        t, out = in_thread(c.stats)
        rid, req = fake.recv()
        assert req.WhichOneof("body") == "stats"
        fake.send(rid, b"\xff\xff\xff not protobuf")
        join(t)
        assert isinstance(out[0], kvd_client.ProtocolError)


def test_error_for_an_unreadable_request_goes_to_the_oldest(fake: FakeKvd) -> None:
    """kvd answers a request it cannot read with request id 0."""
    with Client(fake.endpoint, timeout=PATIENCE) as c:
        t, out = in_thread(c.health)
        rid, req = fake.recv()
        e = kvd_pb2.ServerReply(request_id=0)
        e.error.code = kvd_pb2.ERR_BAD_REQUEST
        e.error.message = "ClientRequest has no body"
        fake.send(rid, e)
        join(t)
        assert isinstance(out[0], kvd_client.BadRequest)
        assert out[0].request_id == req.request_id


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@pytest.mark.parametrize("code", [kvd_pb2.ERR_UNAVAILABLE, kvd_pb2.ERR_SHUTTING_DOWN, 99])
def test_error_classes(fake: FakeKvd, code: int) -> None:
    with Client(fake.endpoint, timeout=PATIENCE) as c:
        t, out = in_thread(c.health)
        rid, req = fake.recv()
        # by hand: code 99 is no ErrorCode this client knows (a newer kvd's)
        msg = b"something new"
        err = b"\x08" + _varint(code) + b"\x12" + _varint(len(msg)) + msg
        frame = (b"\x08\x01\x10" + _varint(req.request_id) + b"\x32" + _varint(len(err)) + err)
        fake.send(rid, frame)
        join(t)
        e = out[0]
        assert isinstance(e, kvd_client.KvdError)
        classes: dict[int, type[kvd_client.KvdError]] = {
            kvd_pb2.ERR_UNAVAILABLE: kvd_client.Unavailable,
            kvd_pb2.ERR_SHUTTING_DOWN: kvd_client.ShuttingDown,
        }
        want = classes.get(code, kvd_client.KvdError)
        assert type(e) is want
        assert e.request_id == req.request_id
        assert e.code == code and "something new" in e.message
