from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Namespace(_message.Message):
    __slots__ = ("tenant", "model", "cache_format")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    cache_format: str
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., cache_format: _Optional[str] = ...) -> None: ...

class BlockLayout(_message.Message):
    __slots__ = ("layers", "block_tokens", "kv_dim", "dtype")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    layers: int
    block_tokens: int
    kv_dim: int
    dtype: str
    def __init__(self, layers: _Optional[int] = ..., block_tokens: _Optional[int] = ..., kv_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ChunkOwner(_message.Message):
    __slots__ = ("namespace_digest", "block_key", "chunk_index", "chunk_count", "layout", "ttl_class", "chunk_size", "seal", "hash_slot", "parent", "depth")
    NAMESPACE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TTL_CLASS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    HASH_SLOT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    namespace_digest: bytes
    block_key: bytes
    chunk_index: int
    chunk_count: int
    layout: BlockLayout
    ttl_class: str
    chunk_size: int
    seal: bytes
    hash_slot: int
    parent: bytes
    depth: int
    def __init__(self, namespace_digest: _Optional[bytes] = ..., block_key: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., layout: _Optional[_Union[BlockLayout, _Mapping]] = ..., ttl_class: _Optional[str] = ..., chunk_size: _Optional[int] = ..., seal: _Optional[bytes] = ..., hash_slot: _Optional[int] = ..., parent: _Optional[bytes] = ..., depth: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("server_id", "address", "failure_domain", "capacity_bytes", "data_address")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    failure_domain: str
    capacity_bytes: int
    data_address: str
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., failure_domain: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., data_address: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("server_id", "used_bytes", "allocated_bytes", "chunk_count", "capacity_bytes", "lost_chunks")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOST_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    used_bytes: int
    allocated_bytes: int
    chunk_count: int
    capacity_bytes: int
    lost_chunks: _containers.RepeatedCompositeFieldContainer[LostChunk]
    def __init__(self, server_id: _Optional[str] = ..., used_bytes: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., lost_chunks: _Optional[_Iterable[_Union[LostChunk, _Mapping]]] = ...) -> None: ...

class LostChunk(_message.Message):
    __slots__ = ("chunk_id", "owner")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    chunk_id: bytes
    owner: bytes
    def __init__(self, chunk_id: _Optional[bytes] = ..., owner: _Optional[bytes] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("register_again", "metaservers")
    REGISTER_AGAIN_FIELD_NUMBER: _ClassVar[int]
    METASERVERS_FIELD_NUMBER: _ClassVar[int]
    register_again: bool
    metaservers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, register_again: _Optional[bool] = ..., metaservers: _Optional[_Iterable[str]] = ...) -> None: ...

class AllocateBlocksRequest(_message.Message):
    __slots__ = ("namespace", "keys", "layout", "parent", "first_key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    layout: BlockLayout
    parent: bytes
    first_key: bytes
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Union[BlockLayout, _Mapping]] = ..., parent: _Optional[bytes] = ..., first_key: _Optional[bytes] = ...) -> None: ...

class ChunkPlacement(_message.Message):
    __slots__ = ("chunk_id", "offset", "length", "servers", "addresses", "owner_seal", "data_addresses")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    OWNER_SEAL_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    chunk_id: bytes
    offset: int
    length: int
    servers: _containers.RepeatedScalarFieldContainer[str]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    owner_seal: bytes
    data_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, chunk_id: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., servers: _Optional[_Iterable[str]] = ..., addresses: _Optional[_Iterable[str]] = ..., owner_seal: _Optional[bytes] = ..., data_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockAllocation(_message.Message):
    __slots__ = ("key", "already_present", "chunks")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    already_present: bool
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkPlacement]
    def __init__(self, key: _Optional[bytes] = ..., already_present: _Optional[bool] = ..., chunks: _Optional[_Iterable[_Union[ChunkPlacement, _Mapping]]] = ...) -> None: ...

class AllocateBlocksReply(_message.Message):
    __slots__ = ("allocation_id", "blocks", "expires_in_s", "chunk_size", "hash_slot")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SLOT_FIELD_NUMBER: _ClassVar[int]
    allocation_id: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[BlockAllocation]
    expires_in_s: float
    chunk_size: int
    hash_slot: int
    def __init__(self, allocation_id: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[BlockAllocation, _Mapping]]] = ..., expires_in_s: _Optional[float] = ..., chunk_size: _Optional[int] = ..., hash_slot: _Optional[int] = ...) -> None: ...

class CommitBlock(_message.Message):
    __slots__ = ("key", "chunk_checksums", "receipts")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    chunk_checksums: _containers.RepeatedScalarFieldContainer[int]
    receipts: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, key: _Optional[bytes] = ..., chunk_checksums: _Optional[_Iterable[int]] = ..., receipts: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitBlocksRequest(_message.Message):
    __slots__ = ("namespace", "allocation_id", "blocks", "ttl_class")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_CLASS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    allocation_id: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[CommitBlock]
    ttl_class: str
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., allocation_id: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[CommitBlock, _Mapping]]] = ..., ttl_class: _Optional[str] = ...) -> None: ...

class CommitBlocksReply(_message.Message):
    __slots__ = ("committed", "already_present")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    committed: int
    already_present: int
    def __init__(self, committed: _Optional[int] = ..., already_present: _Optional[int] = ...) -> None: ...

class Server(_message.Message):
    __slots__ = ("id", "address", "failure_domain", "data_address")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    failure_domain: str
    data_address: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., failure_domain: _Optional[str] = ..., data_address: _Optional[str] = ...) -> None: ...

class ChunkLocation(_message.Message):
    __slots__ = ("chunk_id", "offset", "length", "checksum", "replicas")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    chunk_id: bytes
    offset: int
    length: int
    checksum: int
    replicas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chunk_id: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., replicas: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("key", "layout", "chunks")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    layout: BlockLayout
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkLocation]
    def __init__(self, key: _Optional[bytes] = ..., layout: _Optional[_Union[BlockLayout, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[ChunkLocation, _Mapping]]] = ...) -> None: ...

class TenantKeyRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TenantKeyReply(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("namespace", "keys", "joined_keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    JOINED_KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    joined_keys: bytes
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., joined_keys: _Optional[bytes] = ...) -> None: ...

class MatchPrefixReply(_message.Message):
    __slots__ = ("matched", "blocks", "servers", "read_grant", "layout")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    READ_GRANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    matched: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    servers: _containers.RepeatedCompositeFieldContainer[Server]
    read_grant: bytes
    layout: BlockLayout
    def __init__(self, matched: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., servers: _Optional[_Iterable[_Union[Server, _Mapping]]] = ..., read_grant: _Optional[bytes] = ..., layout: _Optional[_Union[BlockLayout, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStatus(_message.Message):
    __slots__ = ("id", "address", "failure_domain", "live", "capacity_bytes", "used_bytes", "allocated_bytes", "chunk_count", "heartbeat_age_s", "data_address")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    failure_domain: str
    live: bool
    capacity_bytes: int
    used_bytes: int
    allocated_bytes: int
    chunk_count: int
    heartbeat_age_s: float
    data_address: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., failure_domain: _Optional[str] = ..., live: _Optional[bool] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., data_address: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("servers", "blocks", "block_bytes", "replicas", "chains", "open_allocations", "expired_blocks", "gc_deleted_chunks", "blocks_lost", "replicas_lost", "evicted_blocks", "stranded_blocks", "cache_bytes", "cache_capacity_bytes", "loop_stalls", "loop_longest_stall_s", "repair_backlog", "repair_copied_chunks", "repair_copied_bytes", "repair_failed_copies", "forgotten_blocks", "steps")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    OPEN_ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GC_DELETED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_LOST_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_LOST_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STRANDED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOP_STALLS_FIELD_NUMBER: _ClassVar[int]
    LOOP_LONGEST_STALL_S_FIELD_NUMBER: _ClassVar[int]
    REPAIR_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    REPAIR_COPIED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    REPAIR_COPIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FAILED_COPIES_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerStatus]
    blocks: int
    block_bytes: int
    replicas: int
    chains: int
    open_allocations: int
    expired_blocks: int
    gc_deleted_chunks: int
    blocks_lost: int
    replicas_lost: int
    evicted_blocks: int
    stranded_blocks: int
    cache_bytes: int
    cache_capacity_bytes: int
    loop_stalls: _containers.RepeatedCompositeFieldContainer[LoopStalls]
    loop_longest_stall_s: float
    repair_backlog: int
    repair_copied_chunks: int
    repair_copied_bytes: int
    repair_failed_copies: int
    forgotten_blocks: int
    steps: _containers.RepeatedCompositeFieldContainer[StepTimes]
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerStatus, _Mapping]]] = ..., blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., replicas: _Optional[int] = ..., chains: _Optional[int] = ..., open_allocations: _Optional[int] = ..., expired_blocks: _Optional[int] = ..., gc_deleted_chunks: _Optional[int] = ..., blocks_lost: _Optional[int] = ..., replicas_lost: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., stranded_blocks: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_capacity_bytes: _Optional[int] = ..., loop_stalls: _Optional[_Iterable[_Union[LoopStalls, _Mapping]]] = ..., loop_longest_stall_s: _Optional[float] = ..., repair_backlog: _Optional[int] = ..., repair_copied_chunks: _Optional[int] = ..., repair_copied_bytes: _Optional[int] = ..., repair_failed_copies: _Optional[int] = ..., forgotten_blocks: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepTimes, _Mapping]]] = ...) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tenants: _Optional[_Iterable[str]] = ...) -> None: ...

class UsageReply(_message.Message):
    __slots__ = ("tenants", "at")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    at: float
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., at: _Optional[float] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "lookups", "blocks_requested", "blocks_hit", "tokens_hit", "bytes_hit", "blocks_written", "tokens_written", "bytes_written", "blocks_stored", "bytes_stored", "byte_seconds", "since", "as_of", "cache_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HIT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HIT_FIELD_NUMBER: _ClassVar[int]
    BYTES_HIT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    AS_OF_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    lookups: int
    blocks_requested: int
    blocks_hit: int
    tokens_hit: int
    bytes_hit: int
    blocks_written: int
    tokens_written: int
    bytes_written: int
    blocks_stored: int
    bytes_stored: int
    byte_seconds: float
    since: float
    as_of: float
    cache_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., lookups: _Optional[int] = ..., blocks_requested: _Optional[int] = ..., blocks_hit: _Optional[int] = ..., tokens_hit: _Optional[int] = ..., bytes_hit: _Optional[int] = ..., blocks_written: _Optional[int] = ..., tokens_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., blocks_stored: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., byte_seconds: _Optional[float] = ..., since: _Optional[float] = ..., as_of: _Optional[float] = ..., cache_bytes: _Optional[int] = ...) -> None: ...

class StepTimes(_message.Message):
    __slots__ = ("kind", "count", "seconds", "over_s", "over_count", "cpu_seconds", "over_cpu_count")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OVER_S_FIELD_NUMBER: _ClassVar[int]
    OVER_COUNT_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OVER_CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    count: int
    seconds: float
    over_s: _containers.RepeatedScalarFieldContainer[float]
    over_count: _containers.RepeatedScalarFieldContainer[int]
    cpu_seconds: float
    over_cpu_count: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., count: _Optional[int] = ..., seconds: _Optional[float] = ..., over_s: _Optional[_Iterable[float]] = ..., over_count: _Optional[_Iterable[int]] = ..., cpu_seconds: _Optional[float] = ..., over_cpu_count: _Optional[_Iterable[int]] = ...) -> None: ...

class LoopStalls(_message.Message):
    __slots__ = ("over_s", "count", "busy_count", "waiting_count")
    OVER_S_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BUSY_COUNT_FIELD_NUMBER: _ClassVar[int]
    WAITING_COUNT_FIELD_NUMBER: _ClassVar[int]
    over_s: float
    count: int
    busy_count: int
    waiting_count: int
    def __init__(self, over_s: _Optional[float] = ..., count: _Optional[int] = ..., busy_count: _Optional[int] = ..., waiting_count: _Optional[int] = ...) -> None: ...

class RebuildRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RebuildReply(_message.Message):
    __slots__ = ("blocks_restored", "blocks_incomplete", "chunks_seen")
    BLOCKS_RESTORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SEEN_FIELD_NUMBER: _ClassVar[int]
    blocks_restored: int
    blocks_incomplete: int
    chunks_seen: int
    def __init__(self, blocks_restored: _Optional[int] = ..., blocks_incomplete: _Optional[int] = ..., chunks_seen: _Optional[int] = ...) -> None: ...

class RunLifecycleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunLifecycleReply(_message.Message):
    __slots__ = ("expired_blocks", "expired_allocations", "deleted_chunks")
    EXPIRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    DELETED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    expired_blocks: int
    expired_allocations: int
    deleted_chunks: int
    def __init__(self, expired_blocks: _Optional[int] = ..., expired_allocations: _Optional[int] = ..., deleted_chunks: _Optional[int] = ...) -> None: ...

class StoredChunk(_message.Message):
    __slots__ = ("chunk_id", "offset", "length", "checksum", "servers")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    chunk_id: bytes
    offset: int
    length: int
    checksum: int
    servers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, chunk_id: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., servers: _Optional[_Iterable[str]] = ...) -> None: ...

class AllocationRecord(_message.Message):
    __slots__ = ("namespace_digest", "expires_at", "keys", "chunks", "layout", "parents", "settled", "hash_slot")
    NAMESPACE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    HASH_SLOT_FIELD_NUMBER: _ClassVar[int]
    namespace_digest: bytes
    expires_at: float
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    chunks: _containers.RepeatedCompositeFieldContainer[StoredChunk]
    layout: BlockLayout
    parents: _containers.RepeatedScalarFieldContainer[bytes]
    settled: int
    hash_slot: int
    def __init__(self, namespace_digest: _Optional[bytes] = ..., expires_at: _Optional[float] = ..., keys: _Optional[_Iterable[bytes]] = ..., chunks: _Optional[_Iterable[_Union[StoredChunk, _Mapping]]] = ..., layout: _Optional[_Union[BlockLayout, _Mapping]] = ..., parents: _Optional[_Iterable[bytes]] = ..., settled: _Optional[int] = ..., hash_slot: _Optional[int] = ...) -> None: ...

class ServerRecord(_message.Message):
    __slots__ = ("id", "address", "failure_domain", "capacity_bytes", "data_address", "number")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    failure_domain: str
    capacity_bytes: int
    data_address: str
    number: int
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., failure_domain: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., data_address: _Optional[str] = ..., number: _Optional[int] = ...) -> None: ...

class ShardMapRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardMapReply(_message.Message):
    __slots__ = ("map_json", "epoch")
    MAP_JSON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    map_json: str
    epoch: int
    def __init__(self, map_json: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...
