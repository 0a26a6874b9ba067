"""The exceptions of kvd_client.

Every error is a :class:`KvdError`. Errors that kvd reports carry its code (a
``kvd.ErrorCode`` value from ``proto/kvd.proto``), its message and, with
:class:`Overloaded`, how long to wait before retrying. Errors that the client
finds itself (:class:`Timeout`, :class:`ProtocolError`, and arguments it can
refuse without asking kvd) carry ``code`` None, or the code kvd would have
used.
"""

from __future__ import annotations

from . import kvd_pb2


class KvdError(Exception):
    """An error from kvd or from talking to it.

    Attributes:
        code: kvd's error code (``kvd_pb2.ERR_*``), or None for an error the
            client found itself (a timeout, an unreadable reply).
        message: kvd's message, or the client's reason.
        retry_after_ms: with :class:`Overloaded`, kvd's advice on when to
            retry, in milliseconds; otherwise None.
        request_id: the id of the request that failed, when there was one.
    """

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        retry_after_ms: int | None = None,
        request_id: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.retry_after_ms = retry_after_ms
        self.request_id = request_id

    @property
    def code_name(self) -> str | None:
        """The code's name in kvd.proto (e.g. "ERR_OVERLOADED"), or None."""
        if self.code is None:
            return None
        try:
            return kvd_pb2.ErrorCode.Name(self.code)
        except ValueError:
            return f"ERR_{self.code}"

    def __str__(self) -> str:
        s = self.message
        if self.retry_after_ms:
            s += f" (retry after {self.retry_after_ms} ms)"
        return s

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, code={self.code_name}, "
            f"retry_after_ms={self.retry_after_ms}, request_id={self.request_id})"
        )


class BadRequest(KvdError, ValueError):
    """The request is malformed or an argument is out of range (ERR_BAD_REQUEST)."""


class Overloaded(KvdError):
    """kvd's queue is full; retry after ``retry_after_ms`` (ERR_OVERLOADED)."""


class TooLong(KvdError):
    """The prompt does not fit the context or the KV pool (ERR_TOO_LONG)."""


class DeadlineExceeded(KvdError):
    """The request's deadline passed before any output (ERR_DEADLINE).

    A deadline that passes after some output is not an error: the result then
    has ``finish_reason`` :attr:`FinishReason.DEADLINE`."""


class Cancelled(KvdError):
    """kvd cancelled the request (ERR_CANCELLED)."""


class Unavailable(KvdError):
    """No worker can run the request (ERR_UNAVAILABLE)."""


class InternalError(KvdError):
    """kvd failed inside (ERR_INTERNAL)."""


class NotFound(KvdError):
    """A cancel named a request kvd does not know, or no longer runs (ERR_NOT_FOUND)."""


class ShuttingDown(KvdError):
    """kvd is draining and takes no new requests (ERR_SHUTTING_DOWN)."""


class Timeout(KvdError, TimeoutError):
    """No message came from kvd within the client's timeout (kvd not running,
    unreachable or stuck). The request, if it was sent, is cancelled."""


class AuthenticationFailed(KvdError, PermissionError):
    """kvd refused this client's CURVE key (not in its --clients-allow, or
    revoked), or the CURVE handshake failed (a wrong server key, a kvd without
    CURVE there). Raised instead of waiting for a Timeout."""


class ProtocolError(KvdError):
    """kvd sent something unreadable or out of the protocol's order."""


_BY_CODE: dict[int, type[KvdError]] = {
    kvd_pb2.ERR_BAD_REQUEST: BadRequest,
    kvd_pb2.ERR_OVERLOADED: Overloaded,
    kvd_pb2.ERR_TOO_LONG: TooLong,
    kvd_pb2.ERR_DEADLINE: DeadlineExceeded,
    kvd_pb2.ERR_CANCELLED: Cancelled,
    kvd_pb2.ERR_UNAVAILABLE: Unavailable,
    kvd_pb2.ERR_INTERNAL: InternalError,
    kvd_pb2.ERR_NOT_FOUND: NotFound,
    kvd_pb2.ERR_SHUTTING_DOWN: ShuttingDown,
}


def error_for_code(code: int) -> type[KvdError]:
    """The exception class for kvd error code ``code`` (KvdError for a code
    this client does not know, e.g. from a newer kvd)."""
    return _BY_CODE.get(code, KvdError)


def _unknown_code(err: kvd_pb2.Error) -> int:
    """The code of an Error whose code this client's kvd.proto does not name
    (protobuf keeps such a value among the unknown fields); ERR_NONE when there
    is none."""
    try:
        from google.protobuf import unknown_fields

        fields = unknown_fields.UnknownFieldSet(err)
        for i in range(len(fields)):
            f = fields[i]
            if f.field_number == kvd_pb2.Error.CODE_FIELD_NUMBER and isinstance(f.data, int):
                return f.data
    except Exception:  # an older protobuf without the module: no code, then
        pass
    return kvd_pb2.ERR_NONE


def from_reply(err: kvd_pb2.Error, request_id: int | None) -> KvdError:
    """The exception for an Error reply."""
    code = int(err.code) if err.HasField("code") else _unknown_code(err)
    retry = int(err.retry_after_ms) if err.HasField("retry_after_ms") else None
    if code in _BY_CODE:
        message = err.message or kvd_pb2.ErrorCode.Name(code)
    else:
        message = f"kvd sent error code {code}: {err.message}"
    return error_for_code(code)(
        message, code=code, retry_after_ms=retry, request_id=request_id
    )
