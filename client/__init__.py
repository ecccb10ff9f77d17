"""kvfs.client: the SDK inference workers import.

    from kvfs import Namespace
    from kvfs.client import Client, SyncClient, BufferPool

Client (asyncio) and SyncClient (blocking) look up the longest cached prefix of a
prompt, restore it layer by layer into a buffer, and write new blocks back.
ChunkClient talks to one chunkserver.
"""

from kvfs.keys import Namespace, block_keys
from kvfs.layout import BlockLayout

from .chunks import ChunkClient, chunk_checksum
from .client import Client, PrefixMatch, SyncClient, WriteResult
from .metrics import ClientMetrics
from .pool import BufferPool
from .restore import Restore, RestoreStats

__all__ = ["BlockLayout", "BufferPool", "ChunkClient", "Client", "ClientMetrics", "Namespace", "PrefixMatch", "Restore",
           "RestoreStats", "SyncClient", "WriteResult", "block_keys", "chunk_checksum"]
