"""Grants: what the metaserver lets a worker do with chunks, sealed with the
cluster key (kvfs.tls.seal) so that chunkservers can check it on their own.

Writing. At allocation the metaserver seals each chunk's owner record
(ChunkOwner: the block it belongs to, its place in the block, the layout), over
the chunk id too. The writer hands the sealed record to every chunkserver it
writes the chunk to; a chunkserver stores a worker's chunk only under a record
the metaserver sealed for that chunk id, and a rebuild takes from the servers'
inventories only sealed records.

Reading. With each lookup the metaserver mints a read grant for the caller's
namespace, good until an expiry: the namespace digest, its tenant's id (an
8-byte hash of the name: chunkservers pace each tenant's reads by it), the
expiry, and their seal (READ_GRANT_BYTES in all). A chunkserver serves a
worker's read of a chunk only with a valid grant for the namespace the chunk's
owner record names.
"""

from __future__ import annotations

import hmac
import struct
from typing import NamedTuple

import xxhash
from google.protobuf.message import DecodeError

from kvfs import tls
from kvfs.errors import PermissionDenied
from kvfs.keys import KEY_BYTES
from kvfs.proto import meta_pb2


def owner_seal(key: bytes, full: bytes, index: int, count: int, layout: meta_pb2.BlockLayout, chunk_size: int,
               chunk_id: bytes, hash_slot: int, parent: bytes = b"") -> bytes:
    """The metaserver's seal on a chunk's owner record (ChunkOwner.seal): everything
    in it but the TTL class and the depth, and the chunk id, so a record is good for
    its own chunk only. The hash slot is sealed too: a writer cannot file its chunks
    under another metaserver's slots (where that one's rebuild would take them in);
    and the parent, where there is one (a prompt's first block's seal is as it was
    before records named parents), so a rebuild puts the block back where it was."""
    return tls.seal(key, tls.OWNER, full[:KEY_BYTES], full[KEY_BYTES:], index, count, layout.layers,
                    layout.block_tokens, layout.kv_dim, layout.dtype, chunk_size, chunk_id, hash_slot,
                    *((parent,) if parent else ()))


def owner_sealed(key: bytes, owner: meta_pb2.ChunkOwner, chunk_id: bytes) -> bool:
    return hmac.compare_digest(owner.seal, owner_seal(key, owner.namespace_digest + owner.block_key,
                                                      owner.chunk_index, owner.chunk_count, owner.layout,
                                                      owner.chunk_size, chunk_id, owner.hash_slot, owner.parent))


def require_owner(key: bytes, raw: bytes, chunk_id: bytes) -> None:
    """PERMISSION_DENIED unless `raw` is an owner record the metaserver sealed for
    `chunk_id`: what a worker's write of a chunk must carry (both transports)."""
    owner = parse_owner(raw)
    if owner is None or not owner_sealed(key, owner, chunk_id):
        raise PermissionDenied(f"chunk 0x{chunk_id.hex()[:16]}: no owner record sealed by the metaserver for this "
                               f"chunk id; chunks are written as AllocateBlocks placed them, each with its "
                               f"placement's owner_seal")


def write_receipt(key: bytes, chunk_id: bytes, checksum: int, server_id: str) -> bytes:
    """What a chunkserver hands the writer of a chunk it stored, for CommitBlocks:
    the metaserver commits a block only with one from every server it placed it on."""
    return tls.seal(key, tls.RECEIPT, chunk_id, checksum, server_id)


def owner_record(namespace_digest: bytes, block_key: bytes, index: int, count: int, layout: meta_pb2.BlockLayout,
                 chunk_size: int, seal: bytes, hash_slot: int, ttl_class: str = "", parent: bytes = b"",
                 depth: int = 0) -> bytes:
    """A chunk's owner record as its writer sends it with the chunk: chunk `index`
    of `count` of the block, in the prompt's `hash_slot` (AllocateBlocksReply), under
    its `parent` (the key before it in the prompt, as allocated) at `depth` (its
    place in the prompt), with the seal its placement carried (owner_seal)."""
    return meta_pb2.ChunkOwner(namespace_digest=namespace_digest, block_key=block_key, chunk_index=index,
                               chunk_count=count, layout=layout, ttl_class=ttl_class, chunk_size=chunk_size,
                               seal=seal, hash_slot=hash_slot, parent=parent, depth=depth).SerializeToString()


def parse_owner(raw: bytes) -> meta_pb2.ChunkOwner | None:
    """A chunk's owner record (written by its writer, kept by the chunkserver), or
    None if there is none or it does not parse."""
    if not raw:
        return None
    try:
        return meta_pb2.ChunkOwner.FromString(raw)
    except DecodeError:
        return None


TENANT_ID_BYTES = 8
READ_GRANT_BYTES = KEY_BYTES + TENANT_ID_BYTES + 8 + tls.SEAL_BYTES


class ReadGrant(NamedTuple):
    namespace: bytes  # digest
    tenant: bytes  # tenant_id() of the namespace's tenant


def tenant_id(tenant: str) -> bytes:
    """The 8 bytes that name a tenant in read grants (and the metaserver's per-tenant
    eviction index): a hash, so chunkservers never see tenant names."""
    return xxhash.xxh64_digest(tenant.encode())


def read_grant(key: bytes, namespace_digest: bytes, tenant: str, expires_at: float) -> bytes:
    """A grant to read the chunks of one namespace, `tenant`'s, until `expires_at` (unix seconds)."""
    tid, expires = tenant_id(tenant), struct.pack(">Q", int(expires_at))
    return namespace_digest + tid + expires + tls.seal(key, tls.READ, namespace_digest, tid, expires)


def granted(key: bytes, grant: bytes, now: float) -> ReadGrant | None:
    """What a read grant is good for, or None if it is malformed, not sealed with
    `key`, or expired at `now`."""
    if len(grant) != READ_GRANT_BYTES:
        return None
    at = KEY_BYTES + TENANT_ID_BYTES
    namespace_digest, tid, expires, mac = grant[:KEY_BYTES], grant[KEY_BYTES:at], grant[at : at + 8], grant[at + 8 :]
    if not hmac.compare_digest(mac, tls.seal(key, tls.READ, namespace_digest, tid, expires)):
        return None
    return ReadGrant(namespace_digest, tid) if now <= struct.unpack(">Q", expires)[0] else None


def require_read_grant(key: bytes, grant: bytes, now: float) -> ReadGrant:
    """granted(), or PERMISSION_DENIED saying what a reader must send."""
    good = granted(key, grant, now)
    if good is None:
        raise PermissionDenied("no valid read grant: a read carries the read_grant of the lookup that found its "
                               "chunks, before it expires (read_grant_ttl); look the prompt up again")
    return good


def owner_namespace(raw: bytes) -> bytes:
    """The namespace digest a chunk's stored owner record names (b"" for none).
    Serialized records start with it (field 1, 16 bytes): read without parsing."""
    if raw[:2] == b"\n\x10":
        return raw[2 : 2 + KEY_BYTES]
    owner = parse_owner(raw)
    return owner.namespace_digest if owner is not None else b""
