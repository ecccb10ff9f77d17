from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CopyChunkRequest(_message.Message):
    __slots__ = ("chunk_id", "source", "length", "checksum", "owner")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    chunk_id: bytes
    source: str
    length: int
    checksum: int
    owner: bytes
    def __init__(self, chunk_id: _Optional[bytes] = ..., source: _Optional[str] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., owner: _Optional[bytes] = ...) -> None: ...

class CopyChunkReply(_message.Message):
    __slots__ = ("created", "bytes")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    created: bool
    bytes: int
    def __init__(self, created: _Optional[bool] = ..., bytes: _Optional[int] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("chunk_id", "length", "checksum", "owner")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    chunk_id: bytes
    length: int
    checksum: int
    owner: bytes
    def __init__(self, chunk_id: _Optional[bytes] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., owner: _Optional[bytes] = ...) -> None: ...

class WriteChunkRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteChunkReply(_message.Message):
    __slots__ = ("created", "receipt")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    created: bool
    receipt: bytes
    def __init__(self, created: _Optional[bool] = ..., receipt: _Optional[bytes] = ...) -> None: ...

class ReadRange(_message.Message):
    __slots__ = ("chunk_id", "offset", "length")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    chunk_id: bytes
    offset: int
    length: int
    def __init__(self, chunk_id: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReadChunksRequest(_message.Message):
    __slots__ = ("ranges", "read_grant")
    RANGES_FIELD_NUMBER: _ClassVar[int]
    READ_GRANT_FIELD_NUMBER: _ClassVar[int]
    ranges: _containers.RepeatedCompositeFieldContainer[ReadRange]
    read_grant: bytes
    def __init__(self, ranges: _Optional[_Iterable[_Union[ReadRange, _Mapping]]] = ..., read_grant: _Optional[bytes] = ...) -> None: ...

class RangeResult(_message.Message):
    __slots__ = ("code", "message", "data", "chunk_length", "chunk_checksum", "index", "block_checksums")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    data: bytes
    chunk_length: int
    chunk_checksum: int
    index: int
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., data: _Optional[bytes] = ..., chunk_length: _Optional[int] = ..., chunk_checksum: _Optional[int] = ..., index: _Optional[int] = ..., block_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteChunksRequest(_message.Message):
    __slots__ = ("chunk_ids",)
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    chunk_ids: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, chunk_ids: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteChunksReply(_message.Message):
    __slots__ = ("deleted", "not_found")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    not_found: int
    def __init__(self, deleted: _Optional[int] = ..., not_found: _Optional[int] = ...) -> None: ...

class ListChunksRequest(_message.Message):
    __slots__ = ("start_after", "limit")
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    start_after: bytes
    limit: int
    def __init__(self, start_after: _Optional[bytes] = ..., limit: _Optional[int] = ...) -> None: ...

class ChunkInfo(_message.Message):
    __slots__ = ("chunk_id", "length", "checksum", "created", "owner")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    chunk_id: bytes
    length: int
    checksum: int
    created: float
    owner: bytes
    def __init__(self, chunk_id: _Optional[bytes] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., created: _Optional[float] = ..., owner: _Optional[bytes] = ...) -> None: ...

class ListChunksReply(_message.Message):
    __slots__ = ("chunks", "next_start_after")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_START_AFTER_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkInfo]
    next_start_after: bytes
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkInfo, _Mapping]]] = ..., next_start_after: _Optional[bytes] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TenantReadStats(_message.Message):
    __slots__ = ("tenant_id", "reads", "bytes", "reads_paced", "paced_seconds")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    READS_PACED_FIELD_NUMBER: _ClassVar[int]
    PACED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: bytes
    reads: int
    bytes: int
    reads_paced: int
    paced_seconds: float
    def __init__(self, tenant_id: _Optional[bytes] = ..., reads: _Optional[int] = ..., bytes: _Optional[int] = ..., reads_paced: _Optional[int] = ..., paced_seconds: _Optional[float] = ...) -> None: ...

class IoCounters(_message.Message):
    __slots__ = ("reads", "read_bytes", "writes", "write_bytes", "deletes", "checksum_errors", "rejected_requests", "scrubbed_bytes", "scrub_passes", "corrupt_chunks_removed", "reads_paced", "paced_seconds", "writes_deferred", "deferred_seconds")
    READS_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELETES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCRUBBED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCRUB_PASSES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_CHUNKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    READS_PACED_FIELD_NUMBER: _ClassVar[int]
    PACED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITES_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    reads: int
    read_bytes: int
    writes: int
    write_bytes: int
    deletes: int
    checksum_errors: int
    rejected_requests: int
    scrubbed_bytes: int
    scrub_passes: int
    corrupt_chunks_removed: int
    reads_paced: int
    paced_seconds: float
    writes_deferred: int
    deferred_seconds: float
    def __init__(self, reads: _Optional[int] = ..., read_bytes: _Optional[int] = ..., writes: _Optional[int] = ..., write_bytes: _Optional[int] = ..., deletes: _Optional[int] = ..., checksum_errors: _Optional[int] = ..., rejected_requests: _Optional[int] = ..., scrubbed_bytes: _Optional[int] = ..., scrub_passes: _Optional[int] = ..., corrupt_chunks_removed: _Optional[int] = ..., reads_paced: _Optional[int] = ..., paced_seconds: _Optional[float] = ..., writes_deferred: _Optional[int] = ..., deferred_seconds: _Optional[float] = ...) -> None: ...

class StatReply(_message.Message):
    __slots__ = ("server_id", "failure_domain", "capacity_bytes", "used_bytes", "allocated_bytes", "chunk_count", "io_engine", "io_mode", "counters", "data_address", "tenant_reads")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    IO_ENGINE_FIELD_NUMBER: _ClassVar[int]
    IO_MODE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TENANT_READS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    failure_domain: str
    capacity_bytes: int
    used_bytes: int
    allocated_bytes: int
    chunk_count: int
    io_engine: str
    io_mode: str
    counters: IoCounters
    data_address: str
    tenant_reads: _containers.RepeatedCompositeFieldContainer[TenantReadStats]
    def __init__(self, server_id: _Optional[str] = ..., failure_domain: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., io_engine: _Optional[str] = ..., io_mode: _Optional[str] = ..., counters: _Optional[_Union[IoCounters, _Mapping]] = ..., data_address: _Optional[str] = ..., tenant_reads: _Optional[_Iterable[_Union[TenantReadStats, _Mapping]]] = ...) -> None: ...
