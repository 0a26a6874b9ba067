"""AsyncClient against a real kvd: the same results as Client, streams,
concurrent requests on one client, cancel, errors and timeouts."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import PATIENCE, TIMEOUT_BOUND, Daemon

import kvd_client
from kvd_client import AsyncClient, Client, FinishReason


def test_async_generate_and_stream(kvd: Daemon, client: Client, namespace: str) -> None:
    ref = client.generate("The KV cache is", max_tokens=16, temperature=0, namespace=namespace)
    ref2 = client.generate("Paris is", max_tokens=10, temperature=0, namespace=namespace)

    async def main() -> None:
        async with AsyncClient(kvd.endpoint, timeout=kvd.patience) as c:
            assert (await c.health()).ok
            r = await c.generate("The KV cache is", max_tokens=16, temperature=0,
                                 namespace=namespace)
            assert (r.text, r.token_ids, r.finish_reason) == (
                ref.text, ref.token_ids, ref.finish_reason)

            async with c.stream("The KV cache is", max_tokens=16, temperature=0,
                                namespace=namespace) as s:
                chunks = [chunk async for chunk in s]
            assert s.result is not None
            assert [ch.seq for ch in chunks] == list(range(len(chunks)))
            assert "".join(ch.text for ch in chunks) == ref.text == s.result.text
            assert s.result.token_ids == ref.token_ids

            # two requests at once on one client, each gets its own replies
            a, b = await asyncio.gather(
                c.generate("The KV cache is", max_tokens=16, temperature=0, namespace=namespace),
                c.generate("Paris is", max_tokens=10, temperature=0, namespace=namespace),
            )
            assert a.token_ids == ref.token_ids and b.token_ids == ref2.token_ids
            assert (await c.stats()).requests_running == 0

    asyncio.run(main())


def test_async_cancel(kvd: Daemon) -> None:
    async def main() -> None:
        async with AsyncClient(kvd.endpoint, timeout=kvd.patience) as c:
            s = c.stream("Count from one to a thousand: one, two,", max_tokens=400,
                         ignore_eos=True, no_cache=True, temperature=0)
            n = 0
            async for _ in s:
                n += 1
                if n == 3:
                    await c.cancel(s.request_id)
            assert s.result is not None and s.result.finish_reason == FinishReason.CANCELLED
            st = await c.stats()
            assert (st.requests_running, st.blocks_in_use, st.blocks_pending) == (0, 0, 0)

            async with c.stream("Count from one to a thousand: one, two,", max_tokens=400,
                                ignore_eos=True, no_cache=True) as s2:
                await s2.__anext__()
            assert s2.result is not None and s2.result.finish_reason == FinishReason.CANCELLED

            with pytest.raises(kvd_client.NotFound):
                await c.cancel(s.request_id)

            # cancelling the task that awaits a generate cancels the request at kvd:
            # cancelled once kvd runs it, it ends before its 400 tokens
            before = await c.stats()
            task = asyncio.create_task(c.generate(
                "Count from one to a thousand: one, two,", max_tokens=400, ignore_eos=True,
                no_cache=True))
            until = time.monotonic() + kvd.patience
            while (await c.stats()).requests_running == 0 and time.monotonic() < until:
                assert not task.done()
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            until = time.monotonic() + kvd.patience
            while (st := await c.stats()).requests_running != 0 and time.monotonic() < until:
                await asyncio.sleep(0.05)
            assert (st.requests_running, st.blocks_in_use) == (0, 0)
            assert st.completion_tokens - before.completion_tokens < 400

    asyncio.run(main())


def test_async_errors(kvd: Daemon, kvd_full: Daemon, dead_endpoint: str) -> None:
    async def main() -> None:
        async with AsyncClient(kvd_full.endpoint, timeout=PATIENCE) as c:
            with pytest.raises(kvd_client.Overloaded) as e:
                await c.generate("Hi")
            assert e.value.retry_after_ms is not None and e.value.retry_after_ms > 0
        async with AsyncClient(kvd.endpoint, timeout=kvd.patience) as c:
            with pytest.raises(kvd_client.BadRequest):
                await c.generate("Hi", top_p=7)
            assert (await c.health()).ok
        async with AsyncClient(dead_endpoint, timeout=0.3) as c:
            for coro in (c.generate("Hi"), c.stats(), c.health()):
                t = time.monotonic()
                with pytest.raises(kvd_client.Timeout):
                    await coro
                assert 0.25 <= time.monotonic() - t < TIMEOUT_BOUND

    asyncio.run(main())
