"""kvd_client: the Python client of kvd, the LLM serving daemon with a shared
KV cache.

    from kvd_client import Client

    with Client() as kvd:                      # $KVD_ENDPOINT or kvd's default endpoint
        r = kvd.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
        print(r.text, r.finish_reason, r.usage.cached_prompt_tokens)

Client is blocking, AsyncClient its asyncio twin; both speak kvd's protocol
(proto/kvd.proto, whose generated classes are kvd_client.kvd_pb2) over one
ZeroMQ connection. Errors are KvdError subclasses that carry kvd's code,
message and retry-after.
"""

from importlib.metadata import PackageNotFoundError, version

from ._wire import MessageLike, default_endpoint
from .aio import AsyncClient, AsyncStream
from .client import Client, Stream
from .errors import (
    AuthenticationFailed,
    BadRequest,
    Cancelled,
    DeadlineExceeded,
    InternalError,
    KvdError,
    NotFound,
    Overloaded,
    ProtocolError,
    ShuttingDown,
    Timeout,
    TooLong,
    Unavailable,
)
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

try:
    __version__ = version("kvd-client")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "AuthenticationFailed",
    "BadRequest",
    "Cancelled",
    "ChatMessage",
    "Chunk",
    "Client",
    "DeadlineExceeded",
    "FinishReason",
    "Health",
    "HostStats",
    "InternalError",
    "KvdError",
    "MessageLike",
    "NotFound",
    "Pin",
    "Overloaded",
    "ProtocolError",
    "Result",
    "ShuttingDown",
    "Stats",
    "Stream",
    "TenantStats",
    "Timeout",
    "Timings",
    "TokenLogprob",
    "TooLong",
    "TopLogprob",
    "Unavailable",
    "Usage",
    "WorkerStats",
    "default_endpoint",
]
