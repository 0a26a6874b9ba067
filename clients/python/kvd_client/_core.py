"""What Client and AsyncClient share, apart from their I/O: one sans-I/O core.

_ClientCore holds a client's state and its bookkeeping: the endpoint, the
timeout and the CURVE keys, the DEALER socket and its handshake monitor (made
by _socket.open_dealer), request ids, the router of replies, what a failed
handshake means, the errors of a wait that ran out, and closing. _StreamCore
holds a streamed generate's: its frame, the state of its replies, whether it
has started and ended, and giving it up. The one-reply requests (cancel,
stats, tokenize, detokenize, health) are Call objects: the frame to send, and
how the reply becomes the result.

Client (client.py) and AsyncClient (aio.py) bring only the I/O: sending,
waiting for replies, reading the socket, watching the monitor. A feature that
does not depend on how one waits (CURVE, a new request) goes here, once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import zmq

from . import _socket, _wire, errors, kvd_pb2
from ._wire import GenerateParams, MessageLike
from .results import Chunk, Health, Pin, Result, Stats

S = TypeVar("S", bound="zmq.Socket[Any]")
T = TypeVar("T")
C = TypeVar("C", bound="_ClientCore[Any]")


# ---- the one-reply requests -------------------------------------------------------------


class Call(Generic[T]):
    """A request that kvd answers with one reply: the frame to send, and how
    that reply becomes the result."""

    def __init__(self, request_id: int, frame: bytes, body: str,
                 decode: Callable[[kvd_pb2.ServerReply], T]) -> None:
        self.request_id = request_id
        self.frame = frame
        self._body = body           # the kind of reply that answers it
        self._decode = decode

    def result(self, r: kvd_pb2.ServerReply) -> T:
        """The result of the reply r; raises the error kvd sent, or
        ProtocolError for a reply of another kind."""
        return self._decode(_wire.expect(r, self._body, self.request_id))


def cancel_call(request_id: int, target: int) -> Call[None]:
    """Cancel this client's request target (BadRequest here for an id that is
    not one; NotFound from kvd when it does not run it)."""
    return Call(request_id, _wire.encode_cancel(request_id, target), "accepted", lambda r: None)


def stats_call(request_id: int, block_hashes: bool) -> Call[Stats]:
    """kvd's counters (with the findable blocks' hashes when asked)."""
    return Call(request_id, _wire.encode_stats(request_id, block_hashes), "stats",
                lambda r: _wire.to_stats(r.stats))


def tokenize_call(request_id: int, text: str | None,
                  messages: Sequence[MessageLike] | None) -> Call[list[int]]:
    """The token ids of a text or of chat messages."""
    return Call(request_id, _wire.encode_tokenize(request_id, text=text, messages=messages), "tokens",
                lambda r: list(r.tokens.token_ids))


def detokenize_call(request_id: int, token_ids: Sequence[int]) -> Call[str]:
    """The text of token ids."""
    return Call(request_id, _wire.encode_tokenize(request_id, token_ids=token_ids), "tokens",
                lambda r: str(r.tokens.text))


def cache_call(request_id: int, op: str, pin_id: str | None, namespace: str | None) -> Call[list[Pin]]:
    """A cache management request: the pins listed, or the one unpinned or evicted."""
    return Call(request_id, _wire.encode_cache(request_id, op, pin_id, namespace), "cache",
                lambda r: [_wire.to_pin(p) for p in r.cache.pins])


def health_call(request_id: int) -> Call[Health]:
    """Whether kvd can serve."""
    return Call(request_id, _wire.encode_health(request_id), "health", lambda r: _wire.to_health(r.health))


# ---- the client ---------------------------------------------------------------------------


class _ClientCore(Generic[S]):
    """A connection to kvd, less the I/O. Constructor arguments as :class:`Client`.

    A subclass gives the ZeroMQ context of its kind (_new_context), sends a
    cancel without waiting (_cancel_nowait), and may stop what it runs in the
    background when the client closes (_stop_tasks).
    """

    _NAME: ClassVar[str]   # the class's public name, for repr

    def __init__(self, endpoint: str | None = None, timeout: float = _wire.DEFAULT_TIMEOUT, *,
                 server_key: str | None = None, cert: str | None = None) -> None:
        self.endpoint = _wire.check_endpoint(
            endpoint if endpoint is not None else _wire.default_endpoint()
        )
        keys = _wire.curve_keys(server_key, cert)   # ValueError for a bad key file
        self._mon: S | None = None
        self._auth_why = ""         # why handshakes fail, once the monitor said so
        self.timeout = _wire.check_timeout(timeout)
        self._ids = _wire.IdSource()
        self._router = _wire.Router()
        self._ctx: zmq.Context[S] | None = self._new_context()
        try:
            sock, self._mon = _socket.open_dealer(self._ctx, self.endpoint, keys)
        except ValueError:
            self._ctx.term()
            self._ctx = None
            raise
        self._has_keys = keys is not None
        self._sock: S | None = sock

    def _new_context(self) -> zmq.Context[S]:
        """A ZeroMQ context of this client's kind."""
        raise NotImplementedError

    def _cancel_nowait(self, target: int) -> None:
        """Tells kvd to stop working on target, without waiting for anything
        (the answer, when it comes, is dropped)."""
        raise NotImplementedError

    def _stop_tasks(self) -> None:
        """Stops what the client runs in the background, on close."""

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Cancels the requests still open (best effort) and closes the
        connection. Safe to call twice."""
        if self._sock is None:
            return
        for rid in self._router.open_ids():
            self._cancel_nowait(rid)
        self._router.fail_all(errors.KvdError("the client was closed"))
        self._stop_tasks()
        if self._mon is not None:
            self._mon.close(0)
            self._mon = None
        self._sock.close(0)
        self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    @property
    def closed(self) -> bool:
        return self._sock is None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<kvd_client.{self._NAME} {self.endpoint} timeout={self.timeout}s {state}>"

    # ---- bookkeeping (for the I/O of a subclass) ---------------------------------------------

    def _socket(self) -> S:
        if self._sock is None:
            raise errors.KvdError("the client is closed")
        return self._sock

    def _close_request(self, request_id: int) -> None:
        self._router.close(request_id)

    def _cancel_frame(self, target: int) -> bytes:
        """The frame of a cancel of target, under an id of its own."""
        return _wire.encode_cancel(self._ids.take(), target)

    def _handshake_event(self, first_frame: bytes) -> str | None:
        """Takes an event of the handshake monitor (its first frame): why
        calls fail from now on (kept for _auth_failed), or None."""
        why = _wire.handshake_failure(int.from_bytes(first_frame[:2], "little"), self._has_keys)
        if why is not None:
            self._auth_why = why
        return why

    def _auth_failed(self, request_id: int | None = None) -> errors.AuthenticationFailed:
        """The error of a call once a handshake has failed."""
        return errors.AuthenticationFailed(f"{self._auth_why} at {self.endpoint}", request_id=request_id)

    def _no_connection(self, request_id: int) -> errors.Timeout:
        """The error of a send that found no connection in the timeout."""
        return errors.Timeout(
            f"no connection to kvd at {self.endpoint} in {self.timeout:g} s (is it running?)",
            request_id=request_id,
        )

    def _no_reply(self, request_id: int, timeout: float) -> errors.Timeout:
        """The error of a wait of timeout seconds for a reply that did not come."""
        return errors.Timeout(
            f"no reply from kvd at {self.endpoint} in {timeout:g} s", request_id=request_id
        )

    @staticmethod
    def _unwrap(item: kvd_pb2.ServerReply | errors.KvdError) -> kvd_pb2.ServerReply:
        """A reply taken from an inbox; the error raised when the router put one there."""
        if isinstance(item, errors.KvdError):
            raise item
        return item


# ---- the streamed generate ----------------------------------------------------------------


class _StreamCore(Generic[C]):
    """A streamed generate on a client of type C, less the I/O.

    Attributes:
        request_id: the id of the request, for the client's cancel().
    """

    _NAME: ClassVar[str]   # the class's public name, for repr

    def __init__(self, client: C, params: GenerateParams) -> None:
        self._client = client
        self.request_id = client._ids.take()
        self._frame = params.encode(self.request_id)   # BadRequest here, before anything is sent
        self._state = _wire.GenerateState(self.request_id)
        self._started = False
        self._finished = False

    @property
    def result(self) -> Result | None:
        return self._state.result

    @property
    def prompt_tokens(self) -> int:
        return self._state.prompt_tokens

    @property
    def queue_position(self) -> int:
        return self._state.queue_position

    def _take(self, r: kvd_pb2.ServerReply) -> Chunk | None:
        """Takes the next reply: a Chunk to hand out, or None. The request is
        over here once it is over at kvd (its final, or its error)."""
        try:
            chunk = self._state.on_reply(r)
        except errors.ProtocolError:
            raise   # kvd may still run it: the caller abandons (cancels) it
        except errors.KvdError:
            # kvd's error: the request is over there
            self._finished = True
            self._client._close_request(self.request_id)
            raise
        if self._state.done:
            self._finished = True
            self._client._close_request(self.request_id)
        return chunk

    def _abandon(self) -> None:
        """Gives the request up after a failure: cancelled at kvd when it may
        still run there, forgotten here."""
        if not self._finished:
            self._finished = True
            self._client._cancel_nowait(self.request_id)
        self._client._close_request(self.request_id)

    def _begin_close(self) -> bool:
        """The start of closing the stream: cancels the request at kvd before
        its end; whether to wait for kvd to confirm that."""
        if not self._started:
            self._started = self._finished = True
            return False
        if self._finished:
            return False
        if self._client.closed:
            self._finished = True
            return False
        self._client._cancel_nowait(self.request_id)
        return True

    def _confirmed(self, r: kvd_pb2.ServerReply) -> bool:
        """Takes a reply that came while closing: whether the request is over
        (its final, or its error)."""
        try:
            self._state.on_reply(r)
        except errors.KvdError:
            return True
        return self._state.done

    def _end_close(self) -> None:
        self._finished = True
        self._client._close_request(self.request_id)

    def __del__(self) -> None:
        # a stream dropped before its end (a `break` out of a for loop over
        # client.stream(...)): cancel without waiting
        try:
            if self._started and not self._finished:
                self._finished = True
                self._client._cancel_nowait(self.request_id)
                self._client._close_request(self.request_id)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "done" if self._finished else "running" if self._started else "not started"
        return f"<kvd_client.{self._NAME} request_id={self.request_id} {state}>"
