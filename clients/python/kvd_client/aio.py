"""AsyncClient: the asyncio client of kvd (zmq.asyncio), with the methods of
Client as coroutines.

One task reads the socket while requests are open and hands each reply to
the request it answers, so any number of tasks may share one AsyncClient:
concurrent generates, a stream read while another task calls stats() or
cancel(). Use an AsyncClient within one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from . import _core, errors, kvd_pb2
from ._wire import GenerateParams, MessageLike
from .results import Chunk, Health, Pin, Result, Stats

T = TypeVar("T")


class _QueueInbox:
    """A request's replies, waiting to be read by the task that made it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[kvd_pb2.ServerReply | errors.KvdError] = asyncio.Queue()

    def put(self, item: kvd_pb2.ServerReply | errors.KvdError) -> None:
        self.queue.put_nowait(item)


def _retrieve(f: asyncio.Future[Any]) -> None:
    """Marks a fire-and-forget future's outcome as seen (no "exception was
    never retrieved" noise)."""
    if not f.cancelled():
        f.exception()


class AsyncClient(_core._ClientCore[zmq.asyncio.Socket]):
    """A connection to kvd for asyncio code. Arguments as :class:`Client`.

    Example::

        async with AsyncClient() as kvd:
            r = await kvd.generate("The KV cache", max_tokens=32)
            async with kvd.stream("Once upon a time", max_tokens=64) as s:
                async for chunk in s:
                    print(chunk.text, end="", flush=True)
    """

    _NAME = "AsyncClient"
    _reader: asyncio.Task[None] | None = None       # reads the socket while requests are open
    _watch: asyncio.Task[None] | None = None        # watches the handshake monitor
    _auth_error: errors.AuthenticationFailed | None = None   # every call's error once a handshake failed

    def _new_context(self) -> zmq.asyncio.Context:
        return zmq.asyncio.Context()

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Cancels the requests still open (best effort; their waiting tasks
        get a KvdError) and closes the connection. Safe to call twice."""
        super().close()

    def _stop_tasks(self) -> None:
        self._stop_reader()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- generate ---------------------------------------------------------------------------

    async def generate(
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
        """Generates a continuation and returns it whole; see
        :meth:`Client.generate`. Cancelling the awaiting task cancels the
        request at kvd."""
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
        async with AsyncStream(self, params) as s:
            async for _ in s:
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
    ) -> AsyncStream:
        """Generates chunk by chunk: returns an :class:`AsyncStream` to use
        with ``async with`` and ``async for`` (not awaited itself); see
        :meth:`Client.stream`."""
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
        return AsyncStream(self, params)

    # ---- cancel, stats, health --------------------------------------------------------------

    async def cancel(self, request_id: int) -> None:
        """Asks kvd to cancel this client's request ``request_id``; see
        :meth:`Client.cancel`. Raises NotFound when kvd does not run it."""
        await self._call(_core.cancel_call(self._ids.take(), request_id))

    async def stats(self, block_hashes: bool = False) -> Stats:
        """kvd's counters; see :meth:`Client.stats`."""
        return await self._call(_core.stats_call(self._ids.take(), block_hashes))

    async def tokenize(self, text: str | None = None, *,
                       messages: Sequence[MessageLike] | None = None) -> list[int]:
        """The token ids of a prompt; see :meth:`Client.tokenize`."""
        return await self._call(_core.tokenize_call(self._ids.take(), text, messages))

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids; see :meth:`Client.detokenize`."""
        return await self._call(_core.detokenize_call(self._ids.take(), token_ids))

    async def health(self) -> Health:
        """Whether kvd can serve; see :meth:`Client.health`."""
        return await self._call(_core.health_call(self._ids.take()))

    async def cache_list(self, namespace: str | None = None) -> list[Pin]:
        """The pinned prefixes of this client's tenant; see :meth:`Client.cache_list`."""
        return await self._call(_core.cache_call(self._ids.take(), "list", None, namespace))

    async def cache_unpin(self, pin_id: str, namespace: str | None = None) -> Pin:
        """Removes a pin; see :meth:`Client.cache_unpin`."""
        return (await self._call(_core.cache_call(self._ids.take(), "unpin", pin_id, namespace)))[0]

    async def cache_evict(self, pin_id: str, namespace: str | None = None) -> Pin:
        """Removes a pin and evicts its blocks; see :meth:`Client.cache_evict`."""
        return (await self._call(_core.cache_call(self._ids.take(), "evict", pin_id, namespace)))[0]

    # ---- transport (for AsyncStream) ------------------------------------------------------------

    def _open(self, request_id: int) -> _QueueInbox:
        self._socket()
        inbox = _QueueInbox()
        self._router.open(request_id, inbox)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        return inbox

    def _close_request(self, request_id: int) -> None:
        self._router.close(request_id)
        if len(self._router) == 0:
            self._stop_reader()

    def _stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None

    async def _read_loop(self) -> None:
        """Reads replies and routes them, while requests are open."""
        sock = self._socket()
        try:
            while True:
                frame = await sock.recv()
                self._router.route(frame)
        except zmq.ZMQError as e:
            self._router.fail_all(
                errors.KvdError(f"connection to kvd at {self.endpoint} failed: {e}"), close=False
            )

    async def _watch_handshakes(self) -> None:
        """Fails every open request with AuthenticationFailed once the
        monitor reports a failed handshake."""
        assert self._mon is not None
        try:
            while self._auth_error is None:
                ev = await self._mon.recv_multipart()
                if self._handshake_event(ev[0]) is not None:
                    self._auth_error = self._auth_failed()
                    self._router.fail_all(self._auth_error, close=False)
        except zmq.ZMQError:
            pass

    async def _send(self, request_id: int, frame: bytes) -> None:
        """Sends frame, waiting at most the timeout for a connection
        (AuthenticationFailed as soon as a handshake fails)."""
        sock = self._socket()
        if self._mon is not None and self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_handshakes())
        if self._auth_error is not None:
            self._close_request(request_id)
            raise self._auth_error
        send = asyncio.ensure_future(sock.send(frame))
        waits = {send} | ({self._watch} if self._watch is not None else set())
        done, _ = await asyncio.wait(waits, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        if send in done:
            send.result()
            return
        send.cancel()
        self._close_request(request_id)
        if self._auth_error is not None:
            raise self._auth_error
        raise self._no_connection(request_id)

    async def _next(
        self, request_id: int, inbox: _QueueInbox, timeout: float
    ) -> kvd_pb2.ServerReply:
        """The next reply to request_id; Timeout after ``timeout`` seconds.

        asyncio.wait rather than wait_for: before Python 3.12, wait_for can
        lose a cancellation of the awaiting task when the reply arrives at the
        same moment, and a cancelled generate must raise CancelledError."""
        get = asyncio.ensure_future(inbox.queue.get())
        try:
            done, _ = await asyncio.wait({get}, timeout=timeout)
        finally:
            if not get.done():
                get.cancel()
        if not done:
            raise self._no_reply(request_id, timeout)
        return self._unwrap(get.result())

    async def _call(self, call: _core.Call[T]) -> T:
        """Sends a one-reply request and returns its result."""
        inbox = self._open(call.request_id)
        try:
            await self._send(call.request_id, call.frame)
            r = await self._next(call.request_id, inbox, self.timeout)
        finally:
            self._close_request(call.request_id)
        return call.result(r)

    def _cancel_nowait(self, target: int) -> None:
        """Tells kvd to stop working on target, waiting for nothing."""
        if self._sock is None:
            return
        try:
            f = self._sock.send(self._cancel_frame(target), zmq.NOBLOCK)
            if isinstance(f, asyncio.Future):
                f.add_done_callback(_retrieve)
        except Exception:
            pass


class AsyncStream(_core._StreamCore[AsyncClient], AsyncIterator[Chunk]):
    """A streamed generate for asyncio (made by :meth:`AsyncClient.stream`);
    attributes as :class:`Stream`. The request is sent on ``async with`` or
    the first ``async for`` step; leaving the block, ``await aclose()``, or
    breaking out of ``async for chunk in client.stream(...)`` cancels it."""

    _NAME = "AsyncStream"
    _inbox: _QueueInbox | None = None

    async def start(self) -> AsyncStream:
        """Sends the request and waits for kvd to accept it."""
        if self._started:
            return self
        self._started = True
        self._inbox = self._client._open(self.request_id)
        try:
            await self._client._send(self.request_id, self._frame)
            while not self._state.accepted and not self._finished:
                await self._step()
        except BaseException:
            self._abandon()
            raise
        return self

    async def _step(self) -> Chunk | None:
        assert self._inbox is not None
        return self._take(await self._client._next(self.request_id, self._inbox, self._client.timeout))

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        if not self._started:
            await self.start()
        try:
            while not self._finished:
                chunk = await self._step()
                if chunk is not None:
                    return chunk
        except BaseException:
            self._abandon()
            raise
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Ends the stream; before its end, cancels the request at kvd and
        waits (at most the client's timeout) for kvd to confirm."""
        if not self._begin_close():
            return
        loop = asyncio.get_running_loop()
        # kvd confirms once the worker's step in progress is over: one more
        # wait of the client's timeout for that
        deadline = loop.time() + self._client.timeout
        try:
            while not self._finished:
                left = deadline - loop.time()
                if left <= 0:
                    break
                assert self._inbox is not None
                if self._confirmed(await self._client._next(self.request_id, self._inbox, left)):
                    break
        except errors.KvdError:
            pass
        finally:
            self._end_close()

    async def __aenter__(self) -> AsyncStream:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
