"""kvfs.client: the SDK inference workers import.

Today it holds ChunkClient (one chunkserver); the metaserver issue adds Client,
SyncClient and the restore path on top.
"""

from .chunks import ChunkClient, chunk_checksum

__all__ = ["ChunkClient", "chunk_checksum"]
