"""Client: the blocking client of kvd, one ZeroMQ DEALER socket.

Requests may overlap on one client (a stream open while you call stats() or
cancel(), several streams read in turns): replies are sent to the request
they answer. A client is not thread-safe; use one per thread, or AsyncClient.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import TypeVar

import zmq

from . import _core, errors, kvd_pb2
from ._wire import GenerateParams, MessageLike
from .results import Chunk, Health, Pin, Result, Stats

T = TypeVar("T")


class _DequeInbox:
    """A request's replies, waiting to be read."""

    def __init__(self) -> None:
        self.items: collections.deque[kvd_pb2.ServerReply | errors.KvdError] = (
            collections.deque()
        )

    def put(self, item: kvd_pb2.ServerReply | errors.KvdError) -> None:
        self.items.append(item)


class Client(_core._ClientCore[zmq.Socket[bytes]]):
    """A connection to kvd.

    Args:
        endpoint: kvd's endpoint (``ipc://PATH`` or ``tcp://HOST:PORT``);
            None: :func:`default_endpoint` ($KVD_ENDPOINT, else kvd's default).
        timeout: the longest wait, in seconds, for a message from kvd. A
            daemon that is not running (or is stuck) raises :class:`Timeout`
            after this long, never hangs; a stream may run for as long as
            messages keep coming.

    Connecting is lazy: creating a client never fails for a missing daemon.
    Use it as a context manager, or call :meth:`close`.

    Example::

        with Client() as kvd:
            r = kvd.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
            print(r.text, r.usage.cached_prompt_tokens)
    """

    _NAME = "Client"

    def _new_context(self) -> zmq.Context[zmq.Socket[bytes]]:
        return zmq.Context()

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- generate ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        token_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repeat_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        namespace: str | None = None,
        deadline_ms: int | None = None,
        ignore_eos: bool = False,
        no_cache: bool = False,
        logprobs: int | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        json_schema: str | Mapping[str, object] | None = None,
        json_object: bool = False,
        context_overflow: str | None = None,
        prefill_only: bool = False,
        pin_ttl: int | str | None = None,
        pin_messages: int | None = None,
    ) -> Result:
        """Generates a continuation and returns it whole.

        Give exactly one of:
            prompt: text, used as is.
            messages: a chat (ChatMessage, ``{"role", "content"}`` mappings or
                ``(role, content)`` pairs; roles "system", "user",
                "assistant"), put through the model's chat template.
            token_ids: token ids, used as given (no BOS added).

        Sampling and limits (None: kvd's default):
            max_tokens: tokens to generate at most (kvd's default: 256).
            temperature: 0 is greedy (default 0.8).
            top_p, top_k, min_p, repeat_penalty: the usual filters (defaults
                0.95, 40, 0.05, 1 = off).
            seed: sampling seed (default random).
            stop: a stop string or several; the output ends before one.
            namespace: the prefix-cache namespace. A convenience that keeps
                caches apart, not isolation between tenants.
            deadline_ms: give up after this long at kvd (a deadline that passes
                before any output raises DeadlineExceeded; after some output,
                the result has finish_reason "deadline").
            ignore_eos: generate past end-of-generation tokens.
            no_cache: neither use nor fill the prefix cache.
            presence_penalty, frequency_penalty: [-2, 2], OpenAI's: off the
                logit of each token the output holds, once or per time.
            logit_bias: token id -> [-100, 100], added to its logit.
            json_schema: structured output: the output is a JSON document
                that validates against this JSON Schema (a dict or its
                text); json_object: any JSON object.
            context_overflow: what the sequence does at kvd's context: "stop"
                (it ends, finish reason "length") or "window" (it keeps its first
                tokens and the newer half of the rest, and goes on); None: kvd's
                --context-overflow.
            logprobs: None (default): none; 0..20: each output token's
                log-probability (:class:`TokenLogprob`, in ``result.logprobs``
                and ``chunk.logprobs``) with this many most likely
                alternatives.
            prefill_only: compute the prompt (filling the cache) and generate
                nothing (a warm-up); ``result.usage.cached_blocks`` says how many
                of its blocks are then cached.
            pin_ttl: pin the prompt's cached blocks for this long: "5m", "1h"
                or whole seconds (up to kvd's --pin-max-ttl). They are never
                evicted before then and count against the tenant's block
                quota; a pin past a limit raises BadRequest. ``result.pin`` is
                the pin made (or renewed).
            pin_messages: with pin_ttl and messages, pin only the prefix the
                first N messages render to (a system prompt: 1).

        Returns the Result (finish_reason "cancelled" when someone cancelled
        it). Raises BadRequest, Overloaded, TooLong, DeadlineExceeded,
        Unavailable, ShuttingDown, InternalError (from kvd), Timeout or
        ProtocolError. The request asks for chunks even here: each one
        restarts the timeout, so a long generation is not taken for a dead
        daemon.
        """
        params = GenerateParams(
            prompt=prompt, messages=messages, token_ids=token_ids, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repeat_penalty=repeat_penalty, seed=seed, stop=stop, namespace=namespace,
            deadline_ms=deadline_ms, ignore_eos=ignore_eos, no_cache=no_cache,
            logprobs=logprobs, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, logit_bias=logit_bias, json_schema=json_schema,
            json_object=json_object, context_overflow=context_overflow, prefill_only=prefill_only,
            pin_ttl=pin_ttl, pin_messages=pin_messages,
        )
        with Stream(self, params) as s:
            for _ in s:
                pass
        assert s.result is not None
        return s.result

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        token_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repeat_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        namespace: str | None = None,
        deadline_ms: int | None = None,
        ignore_eos: bool = False,
        no_cache: bool = False,
        logprobs: int | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        json_schema: str | Mapping[str, object] | None = None,
        json_object: bool = False,
        context_overflow: str | None = None,
        prefill_only: bool = False,
        pin_ttl: int | str | None = None,
        pin_messages: int | None = None,
    ) -> Stream:
        """Generates a continuation chunk by chunk: returns a :class:`Stream`
        that yields each :class:`Chunk` as it arrives; ``stream.result`` holds
        the whole Result once it has ended. Arguments and errors as
        :meth:`generate`.

        The request is sent when the stream is entered (``with``) or first
        iterated; errors that kvd answers at once (Overloaded, BadRequest, ...)
        are raised there. Leaving the ``with`` block, calling close(), or
        breaking out of ``for chunk in client.stream(...)`` before the end
        cancels the request at kvd.

        Example::

            with kvd.stream("The KV cache", max_tokens=64) as s:
                for chunk in s:
                    print(chunk.text, end="", flush=True)
            print(s.result.finish_reason)
        """
        params = GenerateParams(
            prompt=prompt, messages=messages, token_ids=token_ids, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repeat_penalty=repeat_penalty, seed=seed, stop=stop, namespace=namespace,
            deadline_ms=deadline_ms, ignore_eos=ignore_eos, no_cache=no_cache,
            logprobs=logprobs, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, logit_bias=logit_bias, json_schema=json_schema,
            json_object=json_object, context_overflow=context_overflow, prefill_only=prefill_only,
            pin_ttl=pin_ttl, pin_messages=pin_messages,
        )
        return Stream(self, params)

    # ---- cancel, stats, health --------------------------------------------------------------

    def cancel(self, request_id: int) -> None:
        """Asks kvd to cancel this client's request ``request_id`` (e.g.
        ``stream.request_id``). The request then ends with finish_reason
        "cancelled". Raises NotFound when kvd does not run it (any more)."""
        self._call(_core.cancel_call(self._ids.take(), request_id))

    def stats(self, block_hashes: bool = False) -> Stats:
        """kvd's counters: requests, tokens, cache hits, blocks, workers (and,
        with block_hashes, the hashes of every block a lookup can find: what a
        --kv-events subscriber rebuilds)."""
        return self._call(_core.stats_call(self._ids.take(), block_hashes))

    def tokenize(self, text: str | None = None, *, messages: Sequence[MessageLike] | None = None) -> list[int]:
        """The token ids kvd computes for a prompt: text (as a generate prompt is
        tokenized) or chat messages (through the model's template)."""
        return self._call(_core.tokenize_call(self._ids.take(), text, messages))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (bytes that are not UTF-8 come back as U+FFFD)."""
        return self._call(_core.detokenize_call(self._ids.take(), token_ids))

    def health(self) -> Health:
        """Whether kvd can serve (ok: a worker is alive and kvd is not draining)."""
        return self._call(_core.health_call(self._ids.take()))

    def cache_list(self, namespace: str | None = None) -> list[Pin]:
        """The pinned prefixes of this client's tenant (its CURVE key's, or the one
        a namespace "tenant:NAME/..." names; every pin for a client of kvd's
        ipc:// socket naming none), with their sizes, hits and expiry."""
        return self._call(_core.cache_call(self._ids.take(), "list", None, namespace))

    def cache_unpin(self, pin_id: str, namespace: str | None = None) -> Pin:
        """Removes a pin of this client's tenant; its blocks stay cached, evictable.
        Raises NotFound for a pin it cannot see."""
        return self._call(_core.cache_call(self._ids.take(), "unpin", pin_id, namespace))[0]

    def cache_evict(self, pin_id: str, namespace: str | None = None) -> Pin:
        """Removes a pin of this client's tenant and evicts its blocks from the pool
        now. Raises NotFound for a pin it cannot see."""
        return self._call(_core.cache_call(self._ids.take(), "evict", pin_id, namespace))[0]

    # ---- transport (for Stream) ---------------------------------------------------------------

    def _open(self, request_id: int) -> _DequeInbox:
        inbox = _DequeInbox()
        self._router.open(request_id, inbox)
        return inbox

    def _auth_check(self, request_id: int) -> None:
        """AuthenticationFailed once the monitor has reported a failed handshake."""
        while self._mon is not None and self._mon.poll(0):
            self._handshake_event(self._mon.recv_multipart()[0])
        if self._auth_why:
            self._router.close(request_id)
            raise self._auth_failed(request_id)

    def _wait(self, sock: zmq.Socket[bytes], left: float, flags: int) -> bool:
        """Waits up to left seconds for sock (flags) or a monitor event; whether sock is ready."""
        ms = max(1, int(left * 1000 + 0.999))
        if self._mon is None:
            return bool(sock.poll(ms, flags))
        poller = zmq.Poller()
        poller.register(sock, flags)
        poller.register(self._mon, zmq.POLLIN)
        return sock in dict(poller.poll(ms))

    def _send(self, request_id: int, frame: bytes) -> None:
        """Sends frame, waiting at most the timeout for a connection; Timeout
        (with the request closed) otherwise."""
        sock = self._socket()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                sock.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            self._auth_check(request_id)
            left = deadline - time.monotonic()
            if left <= 0:
                self._router.close(request_id)
                raise self._no_connection(request_id)
            self._wait(sock, left, zmq.POLLOUT)

    def _next(self, request_id: int, inbox: _DequeInbox, timeout: float) -> kvd_pb2.ServerReply:
        """The next reply to request_id, reading the socket (and routing what
        comes for other requests) until one is there. Timeout after
        ``timeout`` seconds without one; ProtocolError for an unreadable frame."""
        sock = self._socket()
        deadline = time.monotonic() + timeout
        while not inbox.items:
            self._auth_check(request_id)
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._no_reply(request_id, timeout)
            if self._wait(sock, left, zmq.POLLIN):
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._router.route(frame)
        return self._unwrap(inbox.items.popleft())

    def _call(self, call: _core.Call[T]) -> T:
        """Sends a one-reply request and returns its result."""
        inbox = self._open(call.request_id)
        try:
            self._send(call.request_id, call.frame)
            r = self._next(call.request_id, inbox, self.timeout)
        finally:
            self._router.close(call.request_id)
        return call.result(r)

    def _cancel_nowait(self, target: int) -> None:
        """Tells kvd to stop working on target, without waiting for anything
        (the answer, when it comes, is dropped)."""
        if self._sock is None:
            return
        try:
            self._sock.send(self._cancel_frame(target), zmq.NOBLOCK)
        except (zmq.ZMQError, errors.KvdError):
            pass


class Stream(_core._StreamCore[Client], Iterator[Chunk]):
    """A streamed generate (made by :meth:`Client.stream`): iterate it for
    the chunks; ``result`` holds the whole Result after the end.

    Attributes:
        request_id: the id of the request, for :meth:`Client.cancel`.
        result: the Result once the stream has ended, else None.
        prompt_tokens: the prompt's length in tokens, once kvd accepted it.
        queue_position: requests ahead of it when kvd accepted it.
    """

    _NAME = "Stream"
    _inbox: _DequeInbox | None = None

    def start(self) -> Stream:
        """Sends the request and waits for kvd to accept it (raising its error
        if it does not). Entering the stream or iterating it does this."""
        if self._started:
            return self
        self._started = True
        self._inbox = self._client._open(self.request_id)
        try:
            self._client._send(self.request_id, self._frame)
            while not self._state.accepted and not self._finished:
                self._step()
        except BaseException:
            self._abandon()
            raise
        return self

    def _step(self) -> Chunk | None:
        assert self._inbox is not None
        return self._take(self._client._next(self.request_id, self._inbox, self._client.timeout))

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        if not self._started:
            self.start()
        try:
            while not self._finished:
                chunk = self._step()
                if chunk is not None:
                    return chunk
        except BaseException:
            self._abandon()
            raise
        raise StopIteration

    def close(self) -> None:
        """Ends the stream. Before its end, the request is cancelled at kvd
        and the stream waits (at most the client's timeout) for kvd to confirm, so
        that ``result`` says what came (finish_reason "cancelled")."""
        if not self._begin_close():
            return
        # kvd confirms once the worker's step in progress is over (seconds on
        # a slow CPU): one more wait of the client's timeout for that
        deadline = time.monotonic() + self._client.timeout
        try:
            while not self._finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                assert self._inbox is not None
                if self._confirmed(self._client._next(self.request_id, self._inbox, left)):
                    break
        except errors.KvdError:
            pass
        finally:
            self._end_close()

    def __enter__(self) -> Stream:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
