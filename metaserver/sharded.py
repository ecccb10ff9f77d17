"""Which hash slots (kvfs/shards.py) this metaserver answers for, as its RPCs ask it.

Alone (no `etcd` setting) a metaserver answers for every slot and nothing here talks
to anyone. Among several, its coordination.SlotLease on etcd decides: a lookup, an
allocation or a commit of a prompt in a slot it does not hold now is refused, with
"moved" (FAILED_PRECONDITION, naming the holder in the trailing metadata) where its
map gives the slot to another, and UNAVAILABLE where it cannot vouch for its map at
all (cut off from etcd, or starting). The check is made again just before a reply
goes out: a lease that lapsed while a call ran must not let that answer out.

Its share of the cache is its share of the slots: every metaserver places chunks on
the same chunkservers, so each evicts against that share of their capacity.

Slots change hands when a metaserver dies (the others take its slots) or joins
(rebalancing gives it a share). The new holder rebuilds a slot's blocks from the
chunkservers' inventories once the old holder has let go of it (the lease's
handover); the old holder forgets the slot's rows without deleting a chunk: the
chunks are the new holder's now. Until a slot's rebuild is done its lookups find
what is rebuilt so far, and orphan GC leaves it alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvfs import tls
from kvfs.errors import Moved, Unavailable
from kvfs.shards import HASH_SLOTS, Owner, ShardMap

from .config import MetaserverConfig

log = logging.getLogger(__name__)


def default_id(address: str) -> str:
    """A metaserver's id from its advertised address ('10.0.0.5:7000' -> '10.0.0.5-7000')."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in address)[:128]


class Shards:
    """The RPCs' view of the slots. `lease` is None for a metaserver alone."""

    def __init__(self, lease=None, me: Owner | None = None):
        self.lease, self.me = lease, me
        self._share = (None, 1.0)  # (the map it was counted from, this metaserver's share of the slots)
        # hears the slots each new map gives this metaserver that the one before did not (taken
        # from a metaserver that died or left): the blocks there are rebuilt from the chunkservers
        self.on_gain: Callable[[set[int]], None] = lambda slots: None
        # hears the slots a new map took from this metaserver: their rows are forgotten
        self.on_lose: Callable[[set[int]], None] = lambda slots: None
        self._held: set[int] | None = None  # the slots of the last map read; None before the first
        self.rebuilding: set[int] = set()  # slots taken over whose rebuild has not finished
        self._to_rebuild: set[int] = set()  # gained, waiting for the old holders to let go
        if lease is not None:
            lease.on_map = self._on_map
            lease.on_settled = self._on_settled

    def _on_map(self, m: ShardMap) -> None:
        mine = set(m.slots_of(self.me.id)) if any(o.id == self.me.id for o in m.owners) else set()
        held, self._held = self._held, mine
        if held is None:
            return
        if lost := held - mine:
            log.info("metaserver %s no longer answers for %d hash slots (shard map epoch %d): forgetting their "
                     "blocks (their chunks are the new holder's)", self.me.id, len(lost), m.epoch)
            self.rebuilding -= lost
            self._to_rebuild -= lost
            self.on_lose(lost)
        if gained := mine - held:
            log.info("metaserver %s now answers for %d more hash slots (shard map epoch %d): once their holders "
                     "let go, rebuilding their blocks from the chunkservers; meanwhile their lookups find nothing "
                     "cached", self.me.id, len(gained), m.epoch)
            self.rebuilding |= gained
            self._to_rebuild |= gained
        if not self.lease.pending:
            self._on_settled()

    def _on_settled(self) -> None:
        """No slot waits for its old holder any more: the ones gained are rebuilt."""
        if gained := self._to_rebuild:
            self._to_rebuild = set()
            self.on_gain(gained)

    def rebuilt(self, slots: set[int]) -> None:
        """The rebuild of these slots is done: their blocks are known here now."""
        self.rebuilding -= slots

    @property
    def alone(self) -> bool:
        return self.lease is None

    def owns(self, slot: int) -> bool:
        """Whether this metaserver answers for `slot` right now, and knows its blocks:
        a slot taken over is not until its rebuild is done. Orphan GC and stale-copy
        deletion go by this: until then, a chunk there is not known garbage."""
        return self.lease is None or (self.lease.serves(slot) and slot not in self.rebuilding)

    def answers(self, slot: int) -> bool:
        """Whether this metaserver answers for `slot` right now (rebuilt or not): only
        then may it delete the chunks of that slot's blocks."""
        return self.lease is None or self.lease.serves(slot)

    def check(self, slot: int) -> None:
        """Nothing if this metaserver answers for `slot` now; else Moved or Unavailable."""
        if self.lease is None or self.lease.serves(slot):
            return
        m: ShardMap | None = self.lease.shard_map
        if m is not None and self.lease.serving() and slot in self.lease.pending:
            raise Unavailable(f"hash slot {slot} is being handed over to metaserver {self.me.id} (shard map epoch "
                              f"{m.epoch}): it answers once the old holder has let go; ask again shortly")
        if m is not None and self.lease.serving():
            owner = m.owner_of(slot)
            raise Moved(f"moved: hash slot {slot} is answered for by metaserver {owner.id} at {owner.address} "
                        f"(shard map epoch {m.epoch}), not by {self.me.id}", slot, owner.address, m.epoch)
        raise Unavailable(f"metaserver {self.me.id} answers for no hash slot now: it holds no confirmed lease and "
                          f"shard map on etcd (starting, or cut off from etcd); ask again, or another metaserver")

    def map(self) -> ShardMap | None:
        return self.lease.shard_map if self.lease is not None else None

    def addresses(self) -> list[str]:
        """Every metaserver of the cluster: the map's owners, then members it does not
        list yet (a metaserver joining, waiting for chunkservers to register with it).
        Empty alone."""
        m = self.map()
        if m is None:
            return []
        return list(dict.fromkeys([*(o.address for o in m.owners), *self.lease.members.values()]))

    def share(self) -> float:
        """This metaserver's share of the slots in the map it holds (1 alone; 0 while it holds none)."""
        if self.lease is None:
            return 1.0
        m = self.lease.shard_map
        if m is None or not self.lease.serving():
            return 0.0
        counted, share = self._share
        if counted is not m:
            share = m.counts().get(self.me.id, 0) / HASH_SLOTS
            self._share = (m, share)
        return share


def etcd_credentials(cfg: MetaserverConfig) -> tls.Credentials | None:
    """What the metaserver presents to etcd and checks etcd's members against: the
    etcd_* files, each defaulting to the metaserver's own TLS file; None (plaintext)
    only with insecure. ValueError when a file is missing."""
    if cfg.insecure:
        return None
    return tls.Credentials.from_files(cfg.etcd_ca or cfg.tls_ca, cfg.etcd_cert or cfg.tls_cert,
                                      cfg.etcd_key or cfg.tls_key)


def among_several(cfg: MetaserverConfig, address: str) -> Shards:
    """For a metaserver among several (cfg.etcd): its lease on etcd, not started (it
    answers for nothing until `start`); a Shards over every slot where cfg.etcd is empty."""
    if not cfg.etcd:
        return Shards()
    from .coordination import EtcdClient, SlotLease  # aetcd only where etcd is used

    advertised = cfg.advertise or address
    me = Owner(cfg.metaserver_id or default_id(advertised), advertised)
    creds = etcd_credentials(cfg)
    etcd = EtcdClient([e.strip() for e in cfg.etcd.split(",")], credentials=creds.channel() if creds else None)
    log.info("metaserver %s: etcd at %s, %s", me.id, cfg.etcd, f"mutual TLS as {creds.identity}" if creds else
             "plaintext (insecure)")
    return Shards(SlotLease(etcd, cfg.cluster_name, me, ttl=int(cfg.lease_ttl)), me)


async def start(shards: Shards, cfg: MetaserverConfig) -> None:
    """Joins the cluster on etcd: returns once the lease and the shard map are held."""
    if shards.alone:
        return
    lease = shards.lease
    await lease.etcd.connect()
    await lease.start(create_over=cfg.expect_metaservers, deadline=max(30.0, 5 * cfg.lease_ttl))
    log.info("metaserver %s at %s joined cluster %r on etcd %s: shard map epoch %d, %d of %d slots here",
             shards.me.id, shards.me.address, cfg.cluster_name, cfg.etcd, lease.shard_map.epoch,
             lease.shard_map.counts().get(shards.me.id, 0), HASH_SLOTS)
