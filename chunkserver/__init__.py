"""kvfs.chunkserver: stores immutable chunks in preallocated slot files on local disk.

store.py holds the chunk store (slots, index, checksums, crash-safe writes),
uring.py the batched io_uring reader, service.py the gRPC servicer and main.py
the `kvfs-chunkserver` entry point.
"""
