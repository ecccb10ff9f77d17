"""MetaserverConfig: the metaserver's settings (flags, KVFS_METASERVER_*, [metaserver] in TOML)."""

from __future__ import annotations

import dataclasses

from kvfs.config import (KiB, MiB, check_choices, check_listen, duration_field, option, parse_duration, parse_size,
                         size_field)
from kvfs.logs import log_format_option
from kvfs.priority import COMPACTION_NICE
from kvfs.shards import Owner

from .eviction import DEFAULT_POLICY, POLICIES


def parse_quotas(text: str) -> dict[str, tuple[int, float]]:
    """'acme=2TiB,*=25%' -> {'acme': (2 TiB, 0.0), '*': (0, 0.25)}: per tenant a size,
    or a share of the cache's capacity."""
    quotas: dict[str, tuple[int, float]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, value = part.partition("=")
        tenant, value = tenant.strip(), value.strip()
        if not sep or not tenant or not value:
            raise ValueError(f"tenant_quotas: {part!r} is not tenant=SIZE or tenant=PERCENT%")
        if value.endswith("%"):
            share = float(value[:-1]) / 100
            if not 0 < share <= 1:
                raise ValueError(f"tenant_quotas: {part!r}: a share must be over 0% and at most 100%")
            quotas[tenant] = (0, share)
        else:
            try:
                quotas[tenant] = (parse_size(value), 0.0)
            except ValueError as err:
                raise ValueError(f"tenant_quotas: {part!r}: {err}") from None
            if quotas[tenant][0] <= 0:
                raise ValueError(f"tenant_quotas: {part!r}: a size must be positive")
    return quotas


def parse_ttl_classes(text: str) -> dict[str, float]:
    """'agent=3d,chat=7d' -> {'agent': 259200.0, 'chat': 604800.0}."""
    classes = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"bad TTL class {item!r}: expected name=duration, e.g. chat=7d")
        if len(name.strip().encode()) > 255:
            raise ValueError(f"TTL class name {name.strip()[:20]!r}... is longer than 255 bytes")
        classes[name.strip()] = parse_duration(value)
    if not classes:
        raise ValueError("at least one TTL class is needed")
    return classes


@dataclasses.dataclass(frozen=True, slots=True)
class MetaserverConfig:
    data_dir: str = option("kvfs-data/metaserver", "folder for the metadata RocksDB")
    listen: str = option("127.0.0.1:7000", "host:port for gRPC (port 0 picks a free one)")
    metrics_listen: str = option("", "host:port to serve Prometheus metrics on, over plain HTTP at /metrics (port 0 "
                                 "picks a free one); empty: no metrics endpoint")
    replicas: int = option(2, "copies of every chunk, on servers in distinct failure domains")
    chunk_size: int = size_field(1 * MiB, "blocks are cut into chunks of at most this size")
    ttl_classes: str = option("agent=3d,chat=7d", "TTL classes, name=duration; refreshed on every hit")
    default_ttl_class: str = option("chat", "class of blocks committed without one")
    heartbeat_interval: float = duration_field(2.0, "how often chunkservers heartbeat")
    heartbeat_timeout: float = duration_field(10.0, "a server silent this long is not live")
    allocation_timeout: float = duration_field(60.0, "an allocation not committed by then is garbage")
    lifecycle_interval: float = duration_field(30.0, "how often expiry and orphan GC run")
    gc_grace: float = duration_field(600.0, "an unreferenced chunk younger than this is left alone")
    repair_interval: float = duration_field(2.0, "how often servers back from silence are reconciled and "
                                            "chunks short of copies re-replicated")
    hit_flush_delay: float = duration_field(10.0, "lookups' hits (last use, hit counts) are written into the "
                                            "blocks' rows once they waited this long, coalesced: a hot prompt's "
                                            "rows are rewritten once per this, not per lookup; a crash loses at "
                                            "most this much of them (ranking and TTL precision, never data)")
    repair_rate: int = size_field(256 * MiB, "re-replication copies at most this many bytes per second")
    cache_size: int = size_field(256 * MiB, "RocksDB block cache: metadata kept in memory beyond the OS page "
                                 "cache (the metaserver holds nothing per block besides)")
    compaction_nice: int = option(COMPACTION_NICE, "lookups first on the CPU: RocksDB's compaction threads run "
                                  "this much nicer than the server (Linux; 0-19, 0: the same priority)")
    max_keys: int = option(100_000, "most keys in one MatchPrefix or AllocateBlocks")
    read_grant_ttl: float = duration_field(300.0, "how long the read grant a lookup returns stays good: a "
                                           "restore must start within it (chunkservers need clocks within "
                                           "seconds of the metaserver's)")
    max_request_bytes: int = size_field(64 * MiB, "largest gRPC request the metaserver reads; a larger one is "
                                        "refused (RESOURCE_EXHAUSTED) before it is read. The largest real one, a "
                                        "CommitBlocks of max_keys MLA blocks, is about 25 MB")
    tenant_quotas: str = option("", "most of the cache one tenant's blocks may take (whole slots per replica, "
                                "as eviction counts), as tenant=SIZE or tenant=PERCENT% of the cache capacity, "
                                "comma-separated, * for every tenant not named; empty: none. A write past it evicts the tenant's own blocks, lowest "
                                "rank first, down to evict_low of its quota; one larger than the quota is "
                                "refused")
    tenant_write_rate: int = size_field(0, "bytes of new blocks (payload) one tenant may allocate per second, "
                                        "in bursts of a second's worth; an AllocateBlocks past it is refused "
                                        "(RESOURCE_EXHAUSTED, saying when to retry) before anything is evicted "
                                        "for it; 0: unlimited")
    usage_max_tenants: int = option(10_000, "tenants metered one by one (kvfs usage); past it, new tenants are "
                                    "metered together as \"(other)\"")
    max_layers: int = option(1024, "most layers in the block layout of an AllocateBlocks")
    max_block_bytes: int = size_field(256 * MiB, "largest block (a layout's payload bytes) an AllocateBlocks may "
                                      "ask for")
    eviction_policy: str = option(DEFAULT_POLICY, "which cached blocks capacity eviction drops first, leaves "
                                  "before their parents: arc (adaptive replacement: a recent and a frequent segment, "
                                  "their split learnt), lfuda (least frequently used, aged) or lru",
                                  tuple(POLICIES))
    evict_high: float = option(0.90, "capacity eviction starts when cached blocks would pass this share of "
                               "the live servers' capacity divided by replicas")
    evict_low: float = option(0.80, "and evicts until cached blocks take this share of it")
    rebuild: bool = option(False, "rebuild block metadata from chunkserver inventories after "
                           "servers register (see rebuild_after)")
    rebuild_after: float = duration_field(5.0, "with rebuild: wait this long for servers to register")
    etcd: str = option("", "etcd endpoints (host:port, comma-separated) of a cluster of several metaservers: "
                       "etcd holds the shard map of hash slots and each metaserver's lease, and this one answers "
                       "only for the slots it holds (docs/operations.md); empty: the only metaserver, answering "
                       "for every slot, no etcd")
    cluster_name: str = option("kvfs", "with etcd: the cluster's name; its keys live under /kvfs/<name>/")
    metaserver_id: str = option("", "with etcd: this metaserver's name in the shard map ([A-Za-z0-9._-], at most "
                                "128); empty: its advertised address, ':' written '-'")
    advertise: str = option("", "with etcd: the host:port workers and other metaservers reach this one at, as "
                            "the shard map lists it; empty: the bound listen address")
    lease_ttl: float = duration_field(6.0, "with etcd: this metaserver's lease; after a crash its slots move to "
                                      "the others about this long later (whole seconds, at least 2; the same "
                                      "on every metaserver of a cluster)")
    expect_metaservers: int = option(1, "with etcd, in a new cluster (no shard map yet): wait for this many "
                                     "metaservers before writing the first map over them")
    etcd_ca: str = option("", "with etcd: the CA certificate (PEM) etcd's members' certificates chain to; "
                          "empty: tls_ca. etcd is spoken to over TLS unless insecure")
    etcd_cert: str = option("", "with etcd: the client certificate (PEM) presented to etcd (its "
                            "--client-cert-auth); empty: tls_cert")
    etcd_key: str = option("", "with etcd: that certificate's private key (PEM); empty: tls_key")
    tls_ca: str = option("", "CA certificate (PEM) of the cluster: callers must present a certificate it "
                         "signed (mutual TLS; `kvfs tls` makes one)")
    tls_cert: str = option("", "the metaserver's certificate (PEM): a server certificate with SANs for every host "
                           "it is reached by; also presented to chunkservers it calls")
    tls_key: str = option("", "the certificate's private key (PEM)")
    cluster_key: str = option("", "file holding the secret the metaserver and the chunkservers share (`kvfs "
                              "tls ca` makes one): seals owner records and checks chunkservers' write receipts with it; required unless insecure")
    insecure: bool = option(False, "plaintext gRPC: no TLS, no caller identities, no access rules; for a "
                            "trusted lab only (logged loudly at start-up)")
    ready_file: str = option("", "once serving, write the bound address here (for launchers)")
    log_level: str = option("INFO", "logging level")
    log_format: str = log_format_option()

    def __post_init__(self) -> None:
        check_choices(self)
        check_listen("metrics_listen", self.metrics_listen)
        parse_quotas(self.tenant_quotas)
        classes = parse_ttl_classes(self.ttl_classes)
        if self.default_ttl_class not in classes:
            raise ValueError(f"default_ttl_class {self.default_ttl_class!r} is not one of "
                             f"{', '.join(classes)}")
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if not 0 <= self.compaction_nice <= 19:
            raise ValueError(f"compaction_nice must be 0..19, got {self.compaction_nice}")
        if not 64 * KiB <= self.chunk_size <= 64 * MiB:
            raise ValueError("chunk_size must be between 64KiB and 64MiB")
        if self.etcd:
            for endpoint in self.etcd.split(","):
                check_listen("etcd", endpoint.strip())
            if not self.cluster_name or "/" in self.cluster_name:
                raise ValueError(f"cluster_name is non-empty and has no '/', got {self.cluster_name!r}")
            if self.metaserver_id:
                Owner(self.metaserver_id, "x:1")  # ValueError on a bad id
            if self.advertise:
                check_listen("advertise", self.advertise)
            if not 2 <= self.lease_ttl == int(self.lease_ttl):
                raise ValueError(f"lease_ttl is whole seconds, at least 2; got {self.lease_ttl}")
            if self.expect_metaservers < 1:
                raise ValueError("expect_metaservers must be at least 1")
        if not 0.0 < self.evict_low <= self.evict_high <= 1.0:
            raise ValueError(f"watermarks need 0 < evict_low <= evict_high <= 1, got evict_low={self.evict_low} "
                             f"evict_high={self.evict_high}")

    @property
    def ttls(self) -> dict[str, float]:
        return parse_ttl_classes(self.ttl_classes)

    def quota_bytes(self, tenant: str, capacity: int) -> int | None:
        """The most bytes of cache `tenant`'s blocks may take (None: no quota), given
        the cache's capacity in bytes."""
        quotas = parse_quotas(self.tenant_quotas)  # a few names: cheaper to parse than to cache (frozen)
        size, share = quotas.get(tenant) or quotas.get("*") or (0, 0.0)
        return size or (int(share * capacity) if share else None)
