"""Typed errors shared by every part, and their mapping to gRPC status codes.

A server raises one of these; its servicer turns it into a status with the same
message. A client turns an RpcError back into the same type with from_rpc_error,
so callers catch kvfs.errors.NotFound whether it came from a server or not.
"""

from __future__ import annotations

import grpc


class KvfsError(Exception):
    """Base of all kvfs errors; `code` is the gRPC status it travels as."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(KvfsError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KvfsError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvfsError):
    code = grpc.StatusCode.ALREADY_EXISTS


class OutOfRange(KvfsError):
    code = grpc.StatusCode.OUT_OF_RANGE


class FailedPrecondition(KvfsError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Moved(FailedPrecondition):
    """A metaserver does not answer for this hash slot (kvfs/shards.py): the shard map
    it holds gives the slot to another, named in the trailing metadata (MOVED_TO, its
    address; MAP_EPOCH, the map's epoch). A client refreshes its map and asks there."""

    MOVED_TO, MAP_EPOCH = "kvfs-moved-to", "kvfs-map-epoch"

    def __init__(self, message: str, slot: int = -1, address: str = "", epoch: int = 0):
        super().__init__(message)
        self.slot, self.address, self.epoch = slot, address, epoch

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return ((self.MOVED_TO, self.address), (self.MAP_EPOCH, str(self.epoch)))


class DataLoss(KvfsError):
    """Stored or transferred bytes failed their checksum: never served."""

    code = grpc.StatusCode.DATA_LOSS


class ResourceExhausted(KvfsError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvfsError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KvfsError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Aborted(KvfsError):
    """A read lost the race to a hedged duplicate; its bytes were dropped."""

    code = grpc.StatusCode.ABORTED


class Internal(KvfsError):
    code = grpc.StatusCode.INTERNAL


class Unauthenticated(KvfsError):
    """The caller proved no identity (no client certificate, or one this cluster does not trust)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KvfsError):
    """The caller's identity does not allow this call (its role, or the tenant it names)."""

    code = grpc.StatusCode.PERMISSION_DENIED


_BY_CODE: dict[grpc.StatusCode, type[KvfsError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        OutOfRange,
        DataLoss,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Aborted,
        Internal,
        Unauthenticated,
        PermissionDenied,
    )
}
# google.rpc.Code numbers (what per-range results carry) to grpc.StatusCode.
_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def from_code(code: grpc.StatusCode | int, message: str) -> KvfsError:
    """The typed error for a status code (a grpc.StatusCode or its number)."""
    if isinstance(code, int):
        code = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code)
    if cls is None:
        err = KvfsError(message)
        err.code = code
        return err
    return cls(message)


def from_rpc_error(err: grpc.RpcError, peer: str = "") -> KvfsError:
    """Turns a failed call into the matching typed error, naming the server."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    where = f" (from {peer})" if peer else ""
    if code == grpc.StatusCode.FAILED_PRECONDITION and hasattr(err, "trailing_metadata"):
        trailers = dict(err.trailing_metadata() or ())
        if Moved.MOVED_TO in trailers:
            try:
                epoch = int(trailers.get(Moved.MAP_EPOCH, "0"))
            except ValueError:
                epoch = 0
            return Moved(f"{details}{where}", address=str(trailers[Moved.MOVED_TO]), epoch=epoch)
    return from_code(code, f"{details}{where}")
