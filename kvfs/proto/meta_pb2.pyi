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
    __slots__ = ("namespace_digest", "block_key", "chunk_index", "chunk_count", "layout", "ttl_class")
    NAMESPACE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TTL_CLASS_FIELD_NUMBER: _ClassVar[int]
    namespace_digest: bytes
    block_key: bytes
    chunk_index: int
    chunk_count: int
    layout: BlockLayout
    ttl_class: str
    def __init__(self, namespace_digest: _Optional[bytes] = ..., block_key: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., layout: _Optional[_Union[BlockLayout, _Mapping]] = ..., ttl_class: _Optional[str] = ...) -> None: ...

class ChunkLocation(_message.Message):
    __slots__ = ("chunk_id", "length", "checksum", "replicas")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    chunk_id: bytes
    length: int
    checksum: int
    replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, chunk_id: _Optional[bytes] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("block_key", "layout", "chunks")
    BLOCK_KEY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    block_key: bytes
    layout: BlockLayout
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkLocation]
    def __init__(self, block_key: _Optional[bytes] = ..., layout: _Optional[_Union[BlockLayout, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[ChunkLocation, _Mapping]]] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MatchPrefixReply(_message.Message):
    __slots__ = ("matched", "blocks")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    matched: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    def __init__(self, matched: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("server_id", "address", "failure_domain", "capacity_bytes")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    failure_domain: str
    capacity_bytes: int
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., failure_domain: _Optional[str] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
