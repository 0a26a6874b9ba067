"""The protocol of kvd (proto/kvd.proto) as both clients speak it: building
requests, reading replies, sending each reply to the request it answers, and
the order of replies a generate must follow. No I/O here; Client and
AsyncClient bring the sockets.

Replies are routed by request id. A reply to a request that is not open any
more (given up after a timeout, cancelled) is dropped. kvd answers a request
it cannot read with an Error whose request id is 0; as kvd answers requests in
the order they come, such an error goes to the oldest open request that has
had no reply yet.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Union

from . import errors, kvd_pb2
from .results import (
    ChatMessage,
    Chunk,
    FinishReason,
    Health,
    HostStats,
    Pin,
    Result,
    Stats,
    TenantStats,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerStats,
)

PROTOCOL_VERSION = 1            # ClientRequest.version ("must be 1")
DEFAULT_TIMEOUT = 30.0          # seconds without a message before Timeout
MAX_FRAME = 16 << 20            # largest frame kvd sends or takes (WIRE_MAX_FRAME, ZMQ_MAXMSGSIZE)
SOCKET_HWM = 100_000            # messages queued per direction

MessageLike = Union[ChatMessage, Mapping[str, str], Sequence[str]]
"""A chat message: a ChatMessage, a mapping with "role" and "content", or a
(role, content) pair."""

_FINISH = {
    kvd_pb2.FINISH_NONE: FinishReason.NONE,
    kvd_pb2.FINISH_STOP: FinishReason.STOP,
    kvd_pb2.FINISH_LENGTH: FinishReason.LENGTH,
    kvd_pb2.FINISH_CANCELLED: FinishReason.CANCELLED,
    kvd_pb2.FINISH_DEADLINE: FinishReason.DEADLINE,
}


def default_endpoint() -> str:
    """The endpoint kvd listens on by default: $KVD_ENDPOINT when set, else
    ``ipc://$XDG_RUNTIME_DIR/kvd/kvd.sock`` (an absolute XDG_RUNTIME_DIR only,
    as the XDG spec says), else ``ipc:///tmp/kvd-<uid>/kvd.sock``. The same
    as the C client's kvd_default_endpoint()."""
    env = os.environ.get("KVD_ENDPOINT", "")
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg.startswith("/"):
        stripped = xdg.rstrip("/") or "/"
        return f"ipc://{stripped}/kvd/kvd.sock"
    return f"ipc:///tmp/kvd-{os.getuid()}/kvd.sock"


# ---- CURVE (kvd --curve-secret) -------------------------------------------------------------

_Z85 = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def _z85_ok(s: str) -> bool:
    return len(s) == 40 and set(s) <= _Z85


def read_cert(path: str) -> tuple[str, str]:
    """(public key, secret key or "") of a certificate file as kvd-keygen
    writes it (ZeroMQ's format), or of a file holding a bare public key."""
    public = secret = ""
    lines = [ln.strip() for ln in Path(path).read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    for ln in lines:
        for name in ("public-key", "secret-key"):
            if ln.startswith(name):
                value = ln[len(name):].strip()
                if value.startswith("=") and value[1:].strip().startswith('"'):
                    value = value[1:].strip()[1:].split('"')[0]
                    if name == "public-key":
                        public = value
                    else:
                        secret = value
    if not public and len(lines) == 1 and _z85_ok(lines[0]):
        public = lines[0]
    if not _z85_ok(public) or (secret and not _z85_ok(secret)):
        raise ValueError(f"{path}: not a CURVE certificate (want kvd-keygen's files or a 40-character Z85 key)")
    return public, secret


def curve_keys(server_key: str | None, cert: str | None) -> tuple[bytes, bytes, bytes] | None:
    """(server public, client public, client secret) for a CURVE connection:
    from the arguments, else from $KVD_CURVE_SERVER_KEY and $KVD_CURVE_CERT;
    None when neither gives both. server_key: a key file or the 40 characters;
    cert: this client's secret certificate (kvd-keygen's NAME.key_secret)."""
    if server_key is None and cert is None:
        server_key = os.environ.get("KVD_CURVE_SERVER_KEY") or None
        cert = os.environ.get("KVD_CURVE_CERT") or None
        if server_key is None or cert is None:
            return None
    if server_key is None or cert is None:
        raise ValueError("CURVE needs both server_key and cert")
    server = server_key if _z85_ok(server_key) and not Path(server_key).exists() else read_cert(server_key)[0]
    public, secret = read_cert(cert)
    if not secret:
        raise ValueError(f"{cert}: no secret-key (give this client's NAME.key_secret)")
    return server.encode(), public.encode(), secret.encode()


#: the monitor events that end a call with AuthenticationFailed
HANDSHAKE_FAILED = {0x0800: "the CURVE handshake failed (a wrong server key?)",
                    0x2000: "the CURVE handshake failed (does kvd use CURVE here?)",
                    0x4000: "kvd refused this client's key"}
#: the same protocol failure for a client without keys
NO_KEYS = "kvd wants CURVE keys here (server_key and cert, or KVD_CURVE_SERVER_KEY and KVD_CURVE_CERT)"


def handshake_failure(event: int, has_keys: bool) -> str | None:
    """Why a monitor event ends a call, or None."""
    if event in HANDSHAKE_FAILED and not has_keys:
        return NO_KEYS
    return HANDSHAKE_FAILED.get(event)


def check_endpoint(endpoint: str) -> str:
    """endpoint, if it looks like a ZeroMQ endpoint; ValueError otherwise."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ValueError(
            f"malformed endpoint {endpoint!r} (want ipc://PATH or tcp://HOST:PORT)"
        )
    return endpoint


def check_timeout(timeout: float) -> float:
    """timeout as a float, if it is a positive number of seconds."""
    t = float(timeout)
    if not t > 0 or math.isinf(t):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return t


class IdSource:
    """Request ids: a random 64-bit start, counting up, never 0 (kvd's id for
    replies to requests it could not read)."""

    def __init__(self) -> None:
        self._next = secrets.randbits(64)

    def take(self) -> int:
        """The next id."""
        if self._next == 0:
            self._next = 1
        rid = self._next
        self._next = (self._next + 1) & 0xFFFF_FFFF_FFFF_FFFF
        return rid


# ---- requests ---------------------------------------------------------------------------


def _request(request_id: int) -> kvd_pb2.ClientRequest:
    req = kvd_pb2.ClientRequest()
    req.version = PROTOCOL_VERSION
    req.request_id = request_id
    return req


def encode_stats(request_id: int, block_hashes: bool = False) -> bytes:
    """A StatsRequest (with the findable blocks' hashes when asked)."""
    req = _request(request_id)
    req.stats.SetInParent()
    if block_hashes:
        req.stats.block_hashes = True
    return req.SerializeToString()


def encode_tokenize(
    request_id: int,
    text: str | None = None,
    messages: Sequence[MessageLike] | None = None,
    token_ids: Sequence[int] | None = None,
) -> bytes:
    """A TokenizeRequest: exactly one of text, messages and token ids (to detokenize)."""
    given = (text is not None) + (messages is not None) + (token_ids is not None)
    if given != 1:
        raise errors.BadRequest("give exactly one of text, messages and token_ids")
    req = _request(request_id)
    t = req.tokenize
    t.SetInParent()
    if text is not None:
        t.text = text
    elif messages is not None:
        for i, m in enumerate(messages):
            role, content = _message(i, m)
            t.messages.add(role=role, content=content)
    elif token_ids is not None:
        t.token_ids.extend(int(x) for x in token_ids)
    return req.SerializeToString()


def ttl_seconds(ttl: int | str) -> int:
    """A pin's TTL in seconds: "5m", "1h" (Anthropic's) or whole seconds."""
    if isinstance(ttl, str):
        if ttl in _TTLS:
            return _TTLS[ttl]
        raise errors.BadRequest(f'pin_ttl = {ttl!r}: want "5m", "1h" or whole seconds',
                                code=kvd_pb2.ERR_BAD_REQUEST)
    return _int_in("pin_ttl", ttl, 1, 604800)


_TTLS = {"5m": 300, "1h": 3600}
_CACHE_OPS = {"list": kvd_pb2.CacheRequest.OP_LIST, "unpin": kvd_pb2.CacheRequest.OP_UNPIN,
              "evict": kvd_pb2.CacheRequest.OP_EVICT}


def encode_cache(request_id: int, op: str, pin_id: str | None, namespace: str | None) -> bytes:
    """A CacheRequest: list, unpin or evict."""
    req = _request(request_id)
    c = req.cache
    c.op = _CACHE_OPS[op]
    if op != "list":
        if not isinstance(pin_id, str) or not pin_id:
            raise errors.BadRequest("a pin id is needed", code=kvd_pb2.ERR_BAD_REQUEST)
        c.pin_id = pin_id
    if namespace is not None:
        c.namespace = namespace
    return req.SerializeToString()


def to_pin(p: kvd_pb2.Pin) -> Pin:
    """A Pin from its message."""
    return Pin(id=p.id, tenant=p.tenant, namespace=p.namespace, tokens=p.tokens, blocks=p.blocks,
               hits=p.hits, created_unix_ms=p.created_unix_ms, expires_unix_ms=p.expires_unix_ms,
               ttl_s=p.ttl_s)


def encode_health(request_id: int) -> bytes:
    """A HealthRequest."""
    req = _request(request_id)
    req.health.SetInParent()
    return req.SerializeToString()


def encode_cancel(request_id: int, target: int) -> bytes:
    """A CancelRequest for this client's request ``target``."""
    if not isinstance(target, int) or not 0 < target < 1 << 64:
        raise errors.BadRequest(
            f"request id {target!r} is not one (want an int in [1, 2**64))",
            code=kvd_pb2.ERR_BAD_REQUEST,
        )
    req = _request(request_id)
    req.cancel.target = target
    return req.SerializeToString()


def _int_in(name: str, v: object, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise errors.BadRequest(
            f"{name} = {v!r} is not an integer in [{lo}, {hi}]", code=kvd_pb2.ERR_BAD_REQUEST
        )
    return v


def _number(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise errors.BadRequest(f"{name} = {v!r} is not a number", code=kvd_pb2.ERR_BAD_REQUEST)
    return float(v)


def _message(i: int, m: MessageLike) -> tuple[str, str]:
    role: object
    content: object
    if isinstance(m, ChatMessage):
        role, content = m.role, m.content
    elif isinstance(m, Mapping):
        role, content = m.get("role"), m.get("content")
    elif isinstance(m, Sequence) and not isinstance(m, str) and len(m) == 2:
        role, content = m[0], m[1]
    else:
        role = content = None
    if not isinstance(role, str) or not isinstance(content, str):
        raise errors.BadRequest(
            f"messages[{i}] = {m!r} is not a chat message (want a ChatMessage, "
            '{"role": ..., "content": ...} or (role, content), both str)',
            code=kvd_pb2.ERR_BAD_REQUEST,
        )
    return role, content


@dataclass(frozen=True)
class GenerateParams:
    """What to generate; see Client.generate for each field. None: kvd's default."""

    prompt: str | None = None
    messages: Sequence[MessageLike] | None = None
    token_ids: Sequence[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    namespace: str | None = None
    deadline_ms: int | None = None
    ignore_eos: bool = False
    no_cache: bool = False
    logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    json_schema: str | Mapping[str, object] | None = None
    json_object: bool = False
    context_overflow: str | None = None
    prefill_only: bool = False
    pin_ttl: int | str | None = None
    pin_messages: int | None = None

    def encode(self, request_id: int) -> bytes:
        """The GenerateRequest, asking for chunks. Raises BadRequest for what
        cannot be sent; ranges that kvd checks (top_p in [0, 1], ...) are left
        to kvd, so that its rules live in one place."""
        forms = sum(x is not None for x in (self.prompt, self.messages, self.token_ids))
        if forms != 1:
            raise errors.BadRequest(
                f"give exactly one of prompt, messages and token_ids (got {forms})",
                code=kvd_pb2.ERR_BAD_REQUEST,
            )
        req = _request(request_id)
        g = req.generate
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise errors.BadRequest(
                    f"prompt must be a str, got {type(self.prompt).__name__}",
                    code=kvd_pb2.ERR_BAD_REQUEST,
                )
            g.prompt = self.prompt
        if self.messages is not None:
            if isinstance(self.messages, (str, bytes)) or not isinstance(self.messages, Sequence):
                raise errors.BadRequest(
                    "messages must be a sequence of chat messages", code=kvd_pb2.ERR_BAD_REQUEST
                )
            for i, m in enumerate(self.messages):
                role, content = _message(i, m)
                g.messages.add(role=role, content=content)
        if self.token_ids is not None:
            g.token_ids.extend(
                _int_in(f"token_ids[{i}]", t, -(1 << 31), (1 << 31) - 1)
                for i, t in enumerate(self.token_ids)
            )
        if self.prefill_only:
            g.prefill_only = True
        if self.pin_ttl is not None:
            g.pin_ttl_s = ttl_seconds(self.pin_ttl)
        if self.pin_messages is not None:
            if self.pin_ttl is None:
                raise errors.BadRequest("pin_messages needs pin_ttl", code=kvd_pb2.ERR_BAD_REQUEST)
            g.pin_messages = _int_in("pin_messages", self.pin_messages, 0, 1 << 20)
        s = g.sampling
        if self.temperature is not None:
            s.temperature = _number("temperature", self.temperature)
        if self.top_k is not None:
            s.top_k = _int_in("top_k", self.top_k, -(1 << 31), (1 << 31) - 1)
        if self.top_p is not None:
            s.top_p = _number("top_p", self.top_p)
        if self.min_p is not None:
            s.min_p = _number("min_p", self.min_p)
        if self.repeat_penalty is not None:
            s.repeat_penalty = _number("repeat_penalty", self.repeat_penalty)
        if self.seed is not None:
            s.seed = _int_in("seed", self.seed, 0, (1 << 64) - 1)
        if self.presence_penalty is not None:
            s.presence_penalty = _number("presence_penalty", self.presence_penalty)
        if self.frequency_penalty is not None:
            s.frequency_penalty = _number("frequency_penalty", self.frequency_penalty)
        if self.logit_bias is not None:
            for tid, bias in self.logit_bias.items():
                s.logit_bias_ids.append(_int_in("logit_bias id", tid, 0, (1 << 31) - 1))
                s.logit_bias.append(_number("logit_bias", bias))
        if not s.ListFields():
            g.ClearField("sampling")
        if self.max_tokens is not None:
            g.max_tokens = _int_in("max_tokens", self.max_tokens, 0, (1 << 32) - 1)
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
            for i, st in enumerate(stops):
                if not isinstance(st, str):
                    raise errors.BadRequest(
                        f"stop[{i}] = {st!r} is not a str", code=kvd_pb2.ERR_BAD_REQUEST
                    )
            g.stop.extend(stops)
        g.stream = True
        if self.deadline_ms is not None:
            g.deadline_ms = _int_in("deadline_ms", self.deadline_ms, 0, (1 << 32) - 1)
        if self.namespace is not None:
            if not isinstance(self.namespace, str):
                raise errors.BadRequest("namespace must be a str", code=kvd_pb2.ERR_BAD_REQUEST)
            g.namespace = self.namespace
        if self.ignore_eos:
            g.ignore_eos = True
        if self.no_cache:
            g.no_cache = True
        if self.logprobs is not None:
            g.logprobs = _int_in("logprobs", self.logprobs, 0, (1 << 32) - 1)
        if self.json_schema is not None:
            g.json_schema = (self.json_schema if isinstance(self.json_schema, str)
                             else json.dumps(self.json_schema, separators=(",", ":")))
        if self.json_object:
            g.json_object = True
        if self.context_overflow is not None:
            modes = {"stop": kvd_pb2.OVERFLOW_STOP, "window": kvd_pb2.OVERFLOW_WINDOW}
            if self.context_overflow not in modes:
                raise errors.BadRequest("context_overflow must be 'stop' or 'window'",
                                        code=kvd_pb2.ERR_BAD_REQUEST)
            g.context_overflow = modes[self.context_overflow]
        try:
            frame = req.SerializeToString()
        except (ValueError, TypeError) as e:  # e.g. a string that is not valid UTF-8
            raise errors.BadRequest(
                f"cannot encode the request: {e}", code=kvd_pb2.ERR_BAD_REQUEST
            ) from e
        if len(frame) > MAX_FRAME:
            # kvd would drop the connection on it, and the call would time out
            raise errors.TooLong(
                f"the request is {len(frame)} bytes, over kvd's frame limit of {MAX_FRAME}",
                code=kvd_pb2.ERR_TOO_LONG,
            )
        return frame


# ---- replies ----------------------------------------------------------------------------


def parse_reply(frame: bytes) -> kvd_pb2.ServerReply:
    """The ServerReply in frame; ProtocolError when it is not one."""
    r = kvd_pb2.ServerReply()
    try:
        r.ParseFromString(frame)
    except Exception as e:  # protobuf's DecodeError, or worse on garbage
        raise errors.ProtocolError(f"unreadable reply from kvd: {e}") from e
    if not r.HasField("version"):
        raise errors.ProtocolError("unreadable reply from kvd: ServerReply has no version")
    if r.version != PROTOCOL_VERSION:
        raise errors.ProtocolError(
            f"kvd speaks protocol version {r.version}, this client {PROTOCOL_VERSION}"
        )
    if r.WhichOneof("body") is None:
        raise errors.ProtocolError("unreadable reply from kvd: ServerReply has no body")
    return r


class Inbox(Protocol):
    """Where the router puts the replies (or a ProtocolError) of one request."""

    def put(self, item: kvd_pb2.ServerReply | errors.KvdError) -> None: ...


class Router:
    """Sends each reply to the inbox of the open request it answers."""

    def __init__(self) -> None:
        self._inboxes: dict[int, Inbox] = {}
        self._unanswered: dict[int, None] = {}  # open ids without a reply yet, oldest first

    def open(self, request_id: int, inbox: Inbox) -> None:
        """Registers a request (before it is sent)."""
        self._inboxes[request_id] = inbox
        self._unanswered[request_id] = None

    def close(self, request_id: int) -> None:
        """Forgets a request; its later replies are dropped."""
        self._inboxes.pop(request_id, None)
        self._unanswered.pop(request_id, None)

    def fail_all(self, err: errors.KvdError, close: bool = True) -> None:
        """Gives err to every open request (and, with close, forgets them)."""
        for inbox in list(self._inboxes.values()):
            inbox.put(err)
        if close:
            self._inboxes.clear()
            self._unanswered.clear()

    def open_ids(self) -> list[int]:
        return list(self._inboxes)

    def __len__(self) -> int:
        return len(self._inboxes)

    def route(self, frame: bytes) -> None:
        """Delivers one frame from kvd. An unreadable frame cannot be told
        apart, so every open request gets the ProtocolError."""
        try:
            r = parse_reply(frame)
        except errors.ProtocolError as e:
            self.fail_all(e, close=False)
            return
        rid = r.request_id
        if rid == 0 and r.WhichOneof("body") == "error":
            rid = next(iter(self._unanswered), 0)
        inbox = self._inboxes.get(rid)
        if inbox is None:
            return  # a reply to a request given up earlier
        self._unanswered.pop(rid, None)
        inbox.put(r)


def expect(r: kvd_pb2.ServerReply, body: str, request_id: int) -> kvd_pb2.ServerReply:
    """r, if it is a ``body`` reply; the error it carries, or ProtocolError."""
    got = r.WhichOneof("body")
    if got == "error":
        raise errors.from_reply(r.error, request_id)
    if got != body:
        raise errors.ProtocolError(
            f"kvd answered a {body} request with {got}", request_id=request_id
        )
    return r


#: the dataclass of each row message of Stats
_STATS_ROWS: dict[str, type[Any]] = {
    "WorkerStats": WorkerStats, "HostStats": HostStats, "TenantStats": TenantStats,
}


def _take(cls: type[Any], m: Any) -> Any:
    """An instance of the dataclass cls from the message m: each of cls's fields
    from m's field of the same name (kvd.proto's names are the dataclasses'), a
    repeated row message as a list of its dataclass, other repeated fields as
    lists."""
    fields = m.DESCRIPTOR.fields_by_name
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        v = getattr(m, f.name)
        d = fields[f.name]
        if d.message_type is not None and d.is_repeated:
            v = [_take(_STATS_ROWS[d.message_type.name], x) for x in v]
        elif d.is_repeated:
            v = list(v)
        kw[f.name] = v
    return cls(**kw)


def stats_fields_missing() -> dict[str, set[str]]:
    """The fields of Stats and its rows in kvd.proto that their dataclasses
    lack, by message (empty sets when they cover the .proto; the latencies and
    the pool view are not carried)."""
    skip = {"ttft_seconds", "e2e_seconds", "queue_seconds", "itl_seconds", "pool_view"}
    out: dict[str, set[str]] = {}
    for name, cls in (("Stats", Stats), *_STATS_ROWS.items()):
        have = {f.name for f in dataclasses.fields(cls)}
        out[name] = set(kvd_pb2.DESCRIPTOR.message_types_by_name[name].fields_by_name) - have - skip
    return out


def to_stats(s: kvd_pb2.Stats) -> Stats:
    """Stats from a Stats reply: every field of the dataclass from the field of
    that name (a kvd that predates windowed parts sends no kv_parts: 1)."""
    st: Stats = _take(Stats, s)
    if not s.HasField("kv_parts"):
        st = dataclasses.replace(st, kv_parts=1)
    return st


def to_health(h: kvd_pb2.Health) -> Health:
    """Health from a Health reply."""
    return Health(ok=h.ok, workers_alive=h.workers_alive, model=h.model)


def to_logprobs(lps: Iterable[kvd_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            logprob=lp.logprob,
            token=lp.token,
            top=[
                TopLogprob(token_id=i, logprob=x, token=t)
                for i, x, t in zip(lp.top_ids, lp.top_logprobs, lp.top_tokens)
            ],
        )
        for lp in lps
    ]


class GenerateState:
    """The replies of one generate, in the order kvd promises: Accepted,
    Chunks numbered 0, 1, 2, ..., then one Final (whose chunk count and text
    agree with the chunks) or an Error at any point. Anything else is a
    ProtocolError."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self.accepted = False
        self.prompt_tokens = 0          # from Accepted
        self.queue_position = 0         # from Accepted
        self.chunks = 0
        self.result: Result | None = None
        self._text: list[str] = []
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    @property
    def done(self) -> bool:
        return self.result is not None

    def on_reply(self, r: kvd_pb2.ServerReply) -> Chunk | None:
        """Takes one reply: a Chunk to hand out, or None. Raises the error kvd
        sent, or ProtocolError."""
        rid = self.request_id
        body = r.WhichOneof("body")
        if body == "error":
            raise errors.from_reply(r.error, rid)
        if self.done:
            raise errors.ProtocolError(f"kvd sent {body} after the final", request_id=rid)
        if body == "accepted":
            if self.accepted:
                raise errors.ProtocolError("kvd accepted the request twice", request_id=rid)
            self.accepted = True
            self.prompt_tokens = r.accepted.prompt_tokens
            self.queue_position = r.accepted.queue_position
            return None
        if body == "chunk":
            c = r.chunk
            if not self.accepted:
                raise errors.ProtocolError(
                    "kvd sent a chunk before accepting the request", request_id=rid
                )
            if c.seq != self.chunks:
                raise errors.ProtocolError(
                    f"kvd sent chunk {c.seq}, expected {self.chunks}", request_id=rid
                )
            if not c.HasField("text"):
                raise errors.ProtocolError("kvd sent a chunk without text", request_id=rid)
            self.chunks += 1
            self._text.append(c.text)
            self._tokens.extend(c.token_ids)
            lps = to_logprobs(c.logprobs)
            self._logprobs.extend(lps)
            return Chunk(seq=c.seq, text=c.text, token_ids=list(c.token_ids), logprobs=lps)
        if body == "final":
            self._take_final(r.final)
            return None
        raise errors.ProtocolError(f"kvd answered a generate with {body}", request_id=rid)

    def _take_final(self, f: kvd_pb2.Final) -> None:
        rid = self.request_id
        if not self.accepted:
            raise errors.ProtocolError(
                "kvd ended the request before accepting it", request_id=rid
            )
        if f.HasField("chunks") and f.chunks != self.chunks:
            raise errors.ProtocolError(
                f"kvd's final counts {f.chunks} chunks, {self.chunks} came", request_id=rid
            )
        streamed = "".join(self._text)
        if not f.HasField("text"):
            raise errors.ProtocolError("kvd sent a final without text", request_id=rid)
        # the chunks' text is the final's, or its start (a held-back tail may
        # come only with the final)
        if not f.text.startswith(streamed):
            raise errors.ProtocolError(
                "kvd's final text does not start with its chunks' text", request_id=rid
            )
        tokens = list(f.token_ids) if len(f.token_ids) > 0 else list(self._tokens)
        u, t = f.usage, f.timings
        usage = Usage(
            prompt_tokens=u.prompt_tokens if u.HasField("prompt_tokens") else self.prompt_tokens,
            cached_prompt_tokens=u.cached_prompt_tokens,
            host_cached_prompt_tokens=u.host_cached_prompt_tokens,
            disk_cached_prompt_tokens=u.disk_cached_prompt_tokens,
            cache_creation_tokens=u.cache_creation_tokens,
            cached_blocks=u.cached_blocks,
            completion_tokens=(
                u.completion_tokens if u.HasField("completion_tokens") else len(tokens)
            ),
        )
        self.result = Result(
            text=f.text,
            token_ids=tokens,
            finish_reason=_FINISH.get(f.finish_reason, FinishReason.NONE),
            usage=usage,
            timings=Timings(
                queued_ms=t.queued_ms, ttft_ms=t.ttft_ms, decode_ms=t.decode_ms,
                total_ms=t.total_ms,
            ),
            request_id=rid,
            chunks=self.chunks,
            logprobs=to_logprobs(f.logprobs) if len(f.logprobs) > 0 else list(self._logprobs),
            pin=to_pin(f.pin) if f.HasField("pin") else None,
            pin_error=f.pin_error,
        )
