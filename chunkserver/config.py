"""ChunkserverConfig: a chunkserver's settings (flags, KVFS_CHUNKSERVER_*, [chunkserver] in TOML)."""

from __future__ import annotations

import dataclasses

from kvfs.config import GiB, KiB, MiB, check_choices, check_listen, duration_field, option, size_field
from kvfs.logs import log_format_option
from kvfs.priority import WRITE_NICE


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkserverConfig:
    data_dir: str = option("kvfs-data/chunkserver", "folder for slot files and the chunk index")
    listen: str = option("127.0.0.1:7100", "host:port for gRPC (port 0 picks a free one)")
    metrics_listen: str = option("", "host:port to serve Prometheus metrics on, over plain HTTP at /metrics (port 0 "
                                 "picks a free one); empty: no metrics endpoint")
    id: str = option("cs-1", "this server's id, unique in the cluster")
    failure_domain: str = option("default", "replicas of a chunk go to distinct failure domains")
    capacity: int = size_field(10 * GiB, "most bytes of slot files this server may allocate")
    reserve: int = size_field(64 * MiB, "free space kept on the filesystem for the index")
    io_engine: str = option("auto", "disk reads: io_uring, preadv (thread pool), or auto "
                            "(io_uring, falling back to preadv if the kernel refuses)",
                            ("auto", "io_uring", "preadv"))
    io_mode: str = option("auto", "direct (O_DIRECT), buffered, or auto (direct where the "
                          "filesystem allows it)", ("auto", "direct", "buffered"))
    uring_entries: int = option(256, "io_uring submission queue size")
    max_chunk_size: int = size_field(64 * MiB, "largest chunk accepted")
    max_read_bytes: int = size_field(256 * MiB, "most bytes one read may cost: its ranges widened to the "
                                     "64 KiB checksum blocks that are read and sent")
    max_ranges: int = option(4096, "most ranges one ReadChunks call may ask for")
    scrub_rate: int = size_field(64 * MiB, "background checksum verification of every stored chunk reads at "
                                 "most this many bytes/s (0: no background passes)")
    scrub_interval: float = duration_field(3600.0, "pause between two full scrub passes")
    data_listen: str = option("", "host:port of the bulk data port (default: the gRPC host and a free "
                              "port; 'off' serves reads over gRPC only)")
    data_request_timeout: float = duration_field(10.0, "a data-port request must arrive whole, header and body, "
                                                 "within this long of its first byte, or its connection is closed")
    data_peer_connections: int = option(64, "most data-port connections one client host may hold open (of 256)")
    data_read_buffers: int = size_field(1 << 30, "most bytes of read buffers direct-mode data-port reads hold at "
                                        "once, over all connections; one client host holds at most a quarter "
                                        "of it (a request alone always proceeds); a request waits for room up "
                                        "to data_request_timeout, then is refused")
    data_write_buffers: int = size_field(512 * MiB, "most bytes of buffers data-port writes hold at once while "
                                         "their chunks arrive and are stored, over all connections; one client "
                                         "host holds at most a quarter of it (a write alone always proceeds); a "
                                         "write waits for room up to data_request_timeout, then is refused")
    write_yield: float = duration_field(0.0, "reads first: a chunk write waits up to this long for the client "
                                        "reads in flight on this server to finish before it takes the disk (0: "
                                        "writes never wait)")
    write_nice: int = option(WRITE_NICE, "reads first on the CPU: threads that store chunks (data-port connections "
                             "that write, checksums and disk writes) run this much nicer than the server, so writes "
                             "take the cores restores leave (0-19; 0: the same priority)")
    tenant_read_rate: int = size_field(0, "bytes per second one tenant's reads may take from this server (data "
                                       "port and gRPC; the read grant names the tenant), in bursts of up to a "
                                       "second's worth: past it, that tenant's reads wait; 0: unpaced")
    meta: str = option("", "metaserver host:port to register with; where several metaservers share the hash "
                       "slots, every one of them, comma-separated (empty: standalone)")
    advertise: str = option("", "address clients use to reach this server (default: the bound one)")
    tls_ca: str = option("", "CA certificate (PEM) of the cluster: callers must present a certificate it "
                         "signed (mutual TLS; `kvfs tls` makes one)")
    tls_cert: str = option("", "this chunkserver's certificate (PEM): a server certificate naming this server's "
                           "id, with SANs for every host it is reached by; also presented to the metaserver and "
                           "to other chunkservers")
    tls_key: str = option("", "the certificate's private key (PEM)")
    cluster_key: str = option("", "file holding the secret the metaserver and the chunkservers share (`kvfs "
                              "tls ca` makes one): seals a receipt for every chunk it stores with it; required unless insecure")
    insecure: bool = option(False, "plaintext gRPC: no TLS, no caller identities, no access rules; for a "
                            "trusted lab only (logged loudly at start-up)")
    ready_file: str = option("", "once serving, write the bound address here (for launchers)")
    log_level: str = option("INFO", "logging level")
    log_format: str = log_format_option()

    def __post_init__(self) -> None:
        check_choices(self)
        check_listen("metrics_listen", self.metrics_listen)
        if not 64 * KiB <= self.max_chunk_size <= 64 * MiB:
            raise ValueError("max_chunk_size must be between 64KiB and 64MiB")
        if not 0 <= self.write_nice <= 19:
            raise ValueError(f"write_nice must be 0..19, got {self.write_nice}")
        if self.capacity <= 0:
            raise ValueError("capacity must be positive")
