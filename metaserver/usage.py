"""Per-tenant usage: what a provider bills from.

A hit costs the provider a fraction of a computed token, so what matters per
tenant is tokens served from cache against tokens written, and storage held over
time. One TenantUsage record per tenant (records.py `p`), kept in memory and
written back with the block changes that move it:

- lookups are metered under the tenant the request names, as they are answered;
- blocks written and blocks stored under their namespace's tenant, which the
  metaserver learns when a worker allocates in a namespace (`note`, records.py
  `n`: the namespace digest does not reveal its tenant). Stored figures change in
  the same RocksDB batch as the blocks they count, so they survive a crash as the
  blocks do; lookup figures reach the database with the next write or flush
  (a crash loses at most that second, as it does hits);
- byte-seconds are the integral of bytes stored, brought up to date whenever
  they change and whenever they are read.

Tenants are bounded: past `usage_max_tenants`, new ones are metered together as
"(other)". Blocks of namespaces whose tenant is not on record (rebuilt from
inventories, or written before metering) are metered as "(unknown)".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvfs.grants import tenant_id
from kvfs.proto import meta_pb2

from .db import Batch, MetaDB
from .records import NAMESPACE, USAGE

OTHER = "(other)"
UNKNOWN = "(unknown)"
MAX_CACHED_NAMESPACES = 100_000  # namespace -> tenant lookups kept in memory (cleared past it)


class Usage:
    def __init__(self, db: MetaDB, clock: Callable[[], float], max_tenants: int):
        self.db = db
        self.clock = clock
        self.max_tenants = max_tenants
        self.tenants: dict[str, meta_pb2.TenantUsage] = {
            key[len(USAGE) :].decode(): meta_pb2.TenantUsage.FromString(raw) for key, raw in db.scan(USAGE)}
        self.dirty: set[str] = set()
        self._tenant_of: dict[bytes, str] = {}

    # ---- whose is a namespace ----------------------------------------------

    def note(self, namespace_digest: bytes, tenant: str) -> None:
        """Records that a namespace is `tenant`'s (a worker allocates in it), once."""
        if self._tenant_of.get(namespace_digest) == tenant:
            return
        if self.db.get(NAMESPACE + namespace_digest) is None:
            self.db.put(NAMESPACE + namespace_digest, tenant.encode())
        self._remember(namespace_digest, tenant)

    def tenant_of(self, namespace_digest: bytes) -> str:
        tenant = self._tenant_of.get(namespace_digest)
        if tenant is None:
            raw = self.db.get(NAMESPACE + namespace_digest)
            tenant = raw.decode() if raw is not None else UNKNOWN
            self._remember(namespace_digest, tenant)
        return tenant

    def tenant_id(self, namespace_digest: bytes) -> bytes:
        """8 bytes naming the namespace's tenant in keys (records.py `w`)."""
        return tenant_id(self.tenant_of(namespace_digest))

    def record_of(self, tenant: str) -> meta_pb2.TenantUsage | None:
        """The record `tenant`'s figures go to: its own, or "(other)" past the bound."""
        return self.tenants.get(tenant) or (self.tenants.get(OTHER) if len(self.tenants) >= self.max_tenants
                                            else None)

    def _remember(self, namespace_digest: bytes, tenant: str) -> None:
        if len(self._tenant_of) >= MAX_CACHED_NAMESPACES:
            self._tenant_of.clear()
        self._tenant_of[namespace_digest] = tenant

    # ---- metering ------------------------------------------------------------

    def _entry(self, tenant: str) -> meta_pb2.TenantUsage:
        u = self.tenants.get(tenant)
        if u is None:
            if len(self.tenants) >= self.max_tenants and tenant not in (OTHER, UNKNOWN):
                return self._entry(OTHER)
            now = self.clock()
            u = self.tenants[tenant] = meta_pb2.TenantUsage(tenant=tenant, since=now, as_of=now)
        self.dirty.add(u.tenant)
        return u

    def lookup(self, tenant: str, requested: int, hit: int, block_tokens: int, block_bytes: int) -> None:
        u = self._entry(tenant)
        u.lookups += 1
        u.blocks_requested += requested
        u.blocks_hit += hit
        u.tokens_hit += hit * block_tokens
        u.bytes_hit += hit * block_bytes

    def written(self, namespace_digest: bytes, blocks: int, block_tokens: int, block_bytes: int) -> None:
        u = self._entry(self.tenant_of(namespace_digest))
        u.blocks_written += blocks
        u.tokens_written += blocks * block_tokens
        u.bytes_written += blocks * block_bytes

    def stored(self, namespace_digest: bytes, blocks: int, nbytes: int, footprint: int) -> None:
        """Blocks added (positive) or removed (negative) from the cache: their
        payload bytes and their footprint."""
        u = self._entry(self.tenant_of(namespace_digest))
        _accrue(u, self.clock())
        # a block stored before metering began was never added: removing it stops at zero
        u.blocks_stored = max(0, u.blocks_stored + blocks)
        u.bytes_stored = max(0, u.bytes_stored + nbytes)
        u.cache_bytes = max(0, u.cache_bytes + footprint)

    # ---- persistence and reports ---------------------------------------------

    def stage(self, batch: Batch) -> None:
        """Puts the records changed since the last stage() into `batch`."""
        for tenant in self.dirty:
            batch.put(USAGE + tenant.encode(), self.tenants[tenant].SerializeToString())
        self.dirty.clear()

    def report(self, visible: Callable[[str], bool], names: Iterable[str] = ()) -> list[meta_pb2.TenantUsage]:
        """Copies of the records of `names` (all when empty) that `visible` allows,
        byte-seconds brought up to now, sorted by tenant."""
        now = self.clock()
        wanted = set(names)
        out = []
        for tenant in sorted(self.tenants):
            if (wanted and tenant not in wanted) or not visible(tenant):
                continue
            u = meta_pb2.TenantUsage()
            u.CopyFrom(self.tenants[tenant])
            _accrue(u, now)
            out.append(u)
        return out


def _accrue(u: meta_pb2.TenantUsage, now: float) -> None:
    if now > u.as_of:
        u.byte_seconds += u.bytes_stored * (now - u.as_of)
        u.as_of = now
