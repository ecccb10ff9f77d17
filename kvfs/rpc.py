"""gRPC settings every kvfs server and client shares."""

from __future__ import annotations

from kvfs.config import MiB

# Chunks are up to 64 MiB and a ReadChunks reply up to 256 MiB; gRPC's default
# receive limit is 4 MiB.
MAX_MESSAGE = 320 * MiB

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]
