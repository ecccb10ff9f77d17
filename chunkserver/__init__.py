"""kvfs.chunkserver: stores immutable chunks in preallocated slot files on local disk.

config.py    ChunkserverConfig, the server's settings
store.py     the chunk store: slots, RocksDB index, checksums, crash-safe writes
slots.py     preallocated slot files per size class, O_DIRECT probing
uring.py     batched io_uring reads (and the logged preadv fallback)
dataport.py  the bulk data port: framed reads into the client's buffer, shared memory on one host
scrub.py     background checksum verification at a bounded rate
membership.py registration and heartbeats to the metaserver
service.py   the gRPC servicer; main.py the `kvfs-chunkserver` entry point
"""
