"""The one ZeroMQ socket every kvd client (blocking or asyncio) talks over:
set up and connected the same way, with CURVE keys when given and a monitor
of failed handshakes (kvd may want keys on any endpoint: tcp://, or ipc://
with --curve-ipc)."""

from __future__ import annotations

from typing import Any, TypeVar

import zmq

from . import _wire

S = TypeVar("S", bound="zmq.Socket[Any]")


def open_dealer(ctx: zmq.Context[S], endpoint: str,
                keys: tuple[bytes, bytes, bytes] | None) -> tuple[S, S | None]:
    """A DEALER of ctx connected to endpoint, and its handshake monitor;
    ValueError when it cannot connect (a malformed endpoint)."""
    sock = ctx.socket(zmq.DEALER)
    mon: S | None = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        # queue a request only on a completed connection: with no daemon a
        # send waits (and times out) instead of piling up requests
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RCVHWM, _wire.SOCKET_HWM)
        sock.setsockopt(zmq.SNDHWM, _wire.SOCKET_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, _wire.MAX_FRAME)
        if keys is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
        # a refused key, or a kvd that wants keys, shows as a failed
        # handshake: AuthenticationFailed, not a Timeout
        mon = sock.get_monitor_socket(sum(_wire.HANDSHAKE_FAILED))
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        if mon is not None:
            mon.close(0)
        sock.close(0)
        raise ValueError(f"cannot connect to {endpoint!r}: {e}") from e
    return sock, mon
