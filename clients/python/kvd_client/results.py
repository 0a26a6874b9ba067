"""What kvd_client's calls return: plain, immutable dataclasses made from
kvd's replies (the protobuf classes stay inside the package). Stats and its
rows are built on the classes _stats.py generates from the statistics' tables
(clients/c/kvd_stats_fields.h) when the package is built."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from ._stats import HostStatsFields, StatsFields, TenantStatsFields, WorkerStatsFields


class FinishReason(str, enum.Enum):
    """Why a generation ended. A ``str``: compares equal to its value, which
    is the name ``kvcli --json`` prints."""

    NONE = "none"
    STOP = "stop"            #: an end-of-generation token or a stop string
    LENGTH = "length"        #: max_tokens, or the context is full
    CANCELLED = "cancelled"  #: cancelled (by :meth:`Client.cancel` or closing a stream)
    DEADLINE = "deadline"    #: the deadline passed after some output

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat, put through the model's chat template by kvd."""

    role: str      #: "system", "user" or "assistant"
    content: str


@dataclass(frozen=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int = 0           #: after the chat template
    cached_prompt_tokens: int = 0    #: prompt tokens whose K/V came from the prefix cache
    completion_tokens: int = 0       #: tokens generated
    #: of cached_prompt_tokens, those copied back from the host tier (kvd --host-cache)
    host_cached_prompt_tokens: int = 0
    #: ... and those read back from the disk tier (kvd --cache-dir)
    disk_cached_prompt_tokens: int = 0
    #: prompt tokens this request computed and wrote to the cache (whole blocks it
    #: indexed); prompt_tokens = cached_prompt_tokens + these + uncached_prompt_tokens
    cache_creation_tokens: int = 0
    cached_blocks: int = 0           #: prompt blocks in the cache when it ended

    @property
    def cache_read_tokens(self) -> int:
        """Prompt tokens read from the cache (Anthropic's cache_read_input_tokens)."""
        return self.cached_prompt_tokens

    @property
    def uncached_prompt_tokens(self) -> int:
        """Prompt tokens computed and not cached (a partial last block, no_cache)."""
        return self.prompt_tokens - self.cached_prompt_tokens - self.cache_creation_tokens


@dataclass(frozen=True)
class Pin:
    """A pinned prefix: blocks kvd keeps in its pool until ``expires_unix_ms``."""

    id: str                  #: "pin_" and 32 hex digits
    tenant: str              #: "" for none
    namespace: str           #: the namespace its request named
    tokens: int              #: prompt tokens pinned (whole blocks)
    blocks: int              #: KV blocks it holds
    hits: int                #: requests whose cached prefix covered it
    created_unix_ms: int
    expires_unix_ms: int
    ttl_s: int


@dataclass(frozen=True)
class Timings:
    """kvd's timings of one request, in milliseconds."""

    queued_ms: float = 0.0   #: arrival to dispatch
    ttft_ms: float = 0.0     #: arrival to the first token
    decode_ms: float = 0.0   #: first to last token
    total_ms: float = 0.0    #: arrival to the end


def _finite(x: float) -> float:
    """A logprob as JSON can hold it (-9999 for -inf or NaN, as OpenAI writes it)."""
    return x if math.isfinite(x) else -9999.0


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    logprob: float
    token: bytes     #: its bytes (a token may hold part of a UTF-8 character)


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the model (the log-softmax of
    the raw logits, before penalties, truncation and temperature), with the
    most likely tokens at its position, most likely first."""

    logprob: float
    token: bytes
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Chunk:
    """New output of a streamed request: whole UTF-8 characters (text that
    could still become a stop string is held back until it cannot)."""

    seq: int                                         #: 0, 1, 2, ... per request
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  #: one per token id, when asked


@dataclass(frozen=True)
class Result:
    """The whole output of a generate request."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    request_id: int      #: the id the client gave the request
    chunks: int = 0      #: streamed chunks received
    logprobs: list[TokenLogprob] = field(default_factory=list)  #: one per token id, when asked
    pin: Pin | None = None   #: with pin_ttl: the pin made or renewed
    pin_error: str = ""      #: with pin_ttl and no pin: why (the output is whole)

    def to_dict(self) -> dict[str, Any]:
        """The result as ``kvcli generate --json`` prints it (same field names
        and order; ``tokens`` holds the token ids)."""
        d: dict[str, Any] = {
            "text": self.text,
            "tokens": list(self.token_ids),
            "finish_reason": self.finish_reason.value,
            "cached_prompt_tokens": self.usage.cached_prompt_tokens,
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "cached_prompt_tokens": self.usage.cached_prompt_tokens,
                "host_cached_prompt_tokens": self.usage.host_cached_prompt_tokens,
                "disk_cached_prompt_tokens": self.usage.disk_cached_prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
            },
            "timings": {
                "queued_ms": round(self.timings.queued_ms, 1),
                "ttft_ms": round(self.timings.ttft_ms, 1),
                "decode_ms": round(self.timings.decode_ms, 1),
                "total_ms": round(self.timings.total_ms, 1),
            },
            "chunks": self.chunks,
            "request_id": self.request_id,
        }
        if self.logprobs:
            d["logprobs"] = [
                {
                    "logprob": _finite(lp.logprob),
                    "top": [[t.token_id, _finite(t.logprob)] for t in lp.top],
                }
                for lp in self.logprobs
            ]
        return d


# Stats and its rows: their figures are the lines of clients/c/kvd_stats_fields.h's tables,
# generated into _stats.py when the package is built (each field of its Python type, 0, "" or
# False by default, in the table's order); the classes here add the rows, the hashes and what is
# worked out from the figures. ``to_stats`` fills them from kvd.proto's fields of the same names
# (tests/python/test_package.py holds them to both the .proto and the header).


@dataclass(frozen=True)
class WorkerStats(WorkerStatsFields):
    """One worker process, as kvd sees it (KVD_WORKER_STATS_FIELDS)."""


@dataclass(frozen=True)
class HostStats(HostStatsFields):
    """A pool kvd dispatches to: its own (name ""), or another host's, whose workers were
    started there with ``kvd-worker --host NAME`` (KVD_HOST_STATS_FIELDS)."""


@dataclass(frozen=True)
class TenantStats(TenantStatsFields):
    """One tenant: a CURVE client's key name, or an HTTP API key's tenant
    (KVD_TENANT_STATS_FIELDS)."""


@dataclass(frozen=True)
class Stats(StatsFields):
    """kvd's counters (``kvcli stats``): kvd.proto's Stats, each field by its
    name there; its figures are KVD_STATS_FIELDS's lines, in their order."""

    #: block tables per sequence: 1, or the parts of a model with sliding-window layers
    #: (1 too from a kvd that predates them and sends none)
    kv_parts: int = 1
    workers: list[WorkerStats] = field(default_factory=list)
    #: with ``stats(block_hashes=True)``: the hashes --kv-events publishes of every block
    #: a lookup can find (what a subscriber rebuilds), in no order
    block_hashes: list[int] = field(default_factory=list)
    #: per tenant (all of them for a client of kvd's ipc:// socket, a tenant its own)
    tenants: list[TenantStats] = field(default_factory=list)
    #: the pools kvd dispatches to, its own first (for a client of kvd's ipc:// socket)
    hosts: list[HostStats] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """cached_prompt_tokens / prompt_tokens (0 before any prompt)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class Health:
    """Whether kvd can serve."""

    ok: bool              #: at least one worker is alive and kvd is not draining
    workers_alive: int
    model: str
