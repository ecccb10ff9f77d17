"""Owner records and their seals: the metaserver's grant to write a chunk.

At allocation the metaserver seals each chunk's owner record (ChunkOwner: the
block it belongs to, its place in the block, the layout) with the cluster key
(kvfs.tls.seal), over the chunk id too. The writer hands the sealed record to
every chunkserver it writes the chunk to; a chunkserver that holds the cluster
key stores a chunk only under a record the metaserver sealed for that chunk id,
and a rebuild takes from the servers' inventories only sealed records.
"""

from __future__ import annotations

import hmac

from google.protobuf.message import DecodeError

from kvfs import tls
from kvfs.keys import KEY_BYTES
from kvfs.proto import meta_pb2


def owner_seal(key: bytes, full: bytes, index: int, count: int, layout: meta_pb2.BlockLayout, chunk_size: int,
               chunk_id: bytes) -> bytes:
    """The metaserver's seal on a chunk's owner record (ChunkOwner.seal): everything
    in it but the TTL class, and the chunk id, so a record is good for its own
    chunk only."""
    return tls.seal(key, tls.OWNER, full[:KEY_BYTES], full[KEY_BYTES:], index, count, layout.layers,
                    layout.block_tokens, layout.kv_dim, layout.dtype, chunk_size, chunk_id)


def owner_sealed(key: bytes, owner: meta_pb2.ChunkOwner, chunk_id: bytes) -> bool:
    return hmac.compare_digest(owner.seal, owner_seal(key, owner.namespace_digest + owner.block_key,
                                                      owner.chunk_index, owner.chunk_count, owner.layout,
                                                      owner.chunk_size, chunk_id))


def owner_record(namespace_digest: bytes, block_key: bytes, index: int, count: int, layout: meta_pb2.BlockLayout,
                 chunk_size: int, seal: bytes, ttl_class: str = "") -> bytes:
    """A chunk's owner record as its writer sends it with the chunk: chunk `index`
    of `count` of the block, under the seal its placement carried (owner_seal)."""
    return meta_pb2.ChunkOwner(namespace_digest=namespace_digest, block_key=block_key, chunk_index=index,
                               chunk_count=count, layout=layout, ttl_class=ttl_class, chunk_size=chunk_size,
                               seal=seal).SerializeToString()


def parse_owner(raw: bytes) -> meta_pb2.ChunkOwner | None:
    """A chunk's owner record (written by its writer, kept by the chunkserver), or
    None if there is none or it does not parse."""
    if not raw:
        return None
    try:
        return meta_pb2.ChunkOwner.FromString(raw)
    except DecodeError:
        return None
