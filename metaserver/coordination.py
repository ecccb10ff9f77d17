"""Several metaservers on etcd: a lease per metaserver, the shard map, and which
hash slots (kvfs.shards) this metaserver may answer for right now.

etcd holds, under `/kvfs/<cluster>/`:
  - `members/<id>`: the metaserver's address, attached to its lease, so it
    disappears when the metaserver stops renewing (it died, or lost etcd);
  - `shardmap`: the shard map (ShardMap.to_json), changed only by compare-and-swap
    on its revision.

A metaserver answers for a slot only while the map gives the slot to it and its
lease is surely alive: it counts the lease's life from the moment it *sent* the
renewal etcd granted (`lease_valid_until`), less a margin for clock rates, so it
stops before etcd can expire the lease. Another metaserver takes a dead one's
slots only after etcd deleted the dead one's member key (the lease expired), in a
transaction that also checks the key is still gone and the map unchanged. So two
metaservers never both answer for one slot, whatever the network does.

No watch streams: every `poll` seconds the session renews its lease, reads the
map, and looks for owners without a member key. A round is a few small requests,
and a missed one is retried at the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aetcd
import grpc
from aetcd import rpc, watcher

from kvfs.shards import Owner, ShardMap

log = logging.getLogger(__name__)

CLOCK_MARGIN = 0.05  # of the TTL: the most two machines' clocks may run apart over one lease


class EtcdClient(aetcd.Client):
    """aetcd's client over a channel to any of several etcd endpoints (gRPC's
    pick_first moves to the next when one fails), plaintext or TLS."""

    def __init__(self, endpoints: list[str], credentials: grpc.ChannelCredentials | None = None,
                 timeout: float = 5.0, authority: str | None = None):
        options = {"grpc.lb_policy_name": "pick_first", "grpc.initial_reconnect_backoff_ms": 200,
                   "grpc.max_reconnect_backoff_ms": 1000}
        if authority:
            options["grpc.ssl_target_name_override"] = authority
        super().__init__(timeout=timeout, options=options)
        if not endpoints:
            raise ValueError("etcd: no endpoints")
        self._target = "ipv4:" + ",".join(endpoints)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            opts = list(self._options.items())
            self.channel = (grpc.aio.secure_channel(self._target, self._credentials, opts) if self._credentials
                            else grpc.aio.insecure_channel(self._target, opts))
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def keys(cluster: str) -> tuple[bytes, bytes]:
    """The shard map's key and the members' prefix for `cluster`."""
    if not cluster or "/" in cluster:
        raise ValueError(f"a cluster name is non-empty and has no '/', got {cluster!r}")
    base = f"/kvfs/{cluster}/".encode()
    return base + b"shardmap", base + b"members/"


class SlotLease:
    """This metaserver's hold on its slots (see the module docstring).

    `start` joins: a lease, the member key, and the shard map (created evenly
    over the members present if there is none yet, when `create_over` says how
    many members to wait for). Then every `poll` seconds it renews, rereads the
    map and hands the slots of owners whose lease lapsed to the others. `serves`
    is the one question the RPCs ask.
    """

    def __init__(self, etcd: EtcdClient, cluster: str, me: Owner, ttl: int = 6, poll: float | None = None,
                 clock: Callable[[], float] = time.monotonic, on_map: Callable[[ShardMap], None] | None = None):
        if ttl < 2:
            raise ValueError(f"a lease TTL is at least 2 s, got {ttl}")
        self.etcd, self.me, self.ttl = etcd, me, ttl
        self.poll = poll if poll is not None else ttl / 4
        self.map_key, self.members_key = keys(cluster)
        self.clock = clock
        self.on_map = on_map
        self.lease_id: int | None = None
        self.lease_valid_until = 0.0  # clock(): the latest moment the lease is surely alive
        self.shard_map: ShardMap | None = None
        self.map_revision = 0
        self._task: asyncio.Task | None = None
        self.takeovers = 0  # maps this session wrote to take dead owners' slots

    # ---- what the RPCs ask ----------------------------------------------

    def serves(self, slot: int) -> bool:
        m = self.shard_map
        return m is not None and self.clock() < self.lease_valid_until and m.owner_of(slot).id == self.me.id

    def serving(self) -> bool:
        """Whether the lease is surely alive (slots aside)."""
        return self.clock() < self.lease_valid_until

    # ---- joining and leaving --------------------------------------------

    async def start(self, create_over: int = 1, deadline: float = 30.0) -> None:
        """Joins; with no map yet, waits for `create_over` members (this one
        included) and writes an even map over them (one of the starters wins)."""
        await self._join()
        end = self.clock() + deadline
        while self.shard_map is None:
            await self._renew()
            if await self._read_map():
                break
            members = await self._members()
            if len(members) >= create_over:
                owners = [Owner(i, members[i]) for i in sorted(members)]
                fresh = ShardMap.even(owners)
                ok, _ = await self.etcd.transaction(
                    compare=[self.etcd.transactions.version(self.map_key) == 0],
                    success=[self.etcd.transactions.put(self.map_key, fresh.to_json().encode())], failure=[])
                if ok:
                    log.info("shard map: created epoch %d over %s", fresh.epoch, ", ".join(sorted(members)))
                continue
            if self.clock() > end:
                raise TimeoutError(f"no shard map in etcd, and {len(members)} of {create_over} metaservers joined")
            await asyncio.sleep(self.poll)
        self._task = asyncio.create_task(self._run())

    async def stop(self, revoke: bool = True) -> None:
        """Stops renewing; `revoke` ends the lease now (a clean stop: the others
        take the slots at once) rather than at its expiry."""
        self.lease_valid_until = 0.0
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if revoke and self.lease_id is not None:
            try:
                await self.etcd.revoke_lease(self.lease_id)
            except Exception as err:  # noqa: BLE001 - etcd gone: the lease ends at its TTL anyway
                log.warning("shard lease: revoking lease %x: %s", self.lease_id, err)
        self.lease_id = None

    async def _join(self) -> None:
        sent = self.clock()
        lease = await self.etcd.lease(self.ttl)
        self.lease_id = lease.id
        await self.etcd.put(self.members_key + self.me.id.encode(), self.me.address.encode(), lease=lease.id)
        self._granted(sent, lease.ttl)
        log.info("shard lease: %s joined with lease %x (TTL %d s)", self.me.id, lease.id, lease.ttl)

    def _granted(self, sent: float, ttl: int) -> None:
        self.lease_valid_until = max(self.lease_valid_until, sent + ttl * (1 - CLOCK_MARGIN))

    # ---- each round -----------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - etcd unreachable or slow: try again next round
                log.warning("shard lease: %s: round failed (%s: %s); serving for %.1f s more at most",
                            self.me.id, type(err).__name__, err, max(0.0, self.lease_valid_until - self.clock()))
            await asyncio.sleep(self.poll)

    async def round(self) -> None:
        await self._renew()
        await self._read_map()
        await self._take_over()

    async def _renew(self) -> None:
        sent = self.clock()
        reply = await asyncio.wait_for(self.etcd.refresh_lease(self.lease_id), timeout=self.ttl / 2)
        if reply is None or reply.TTL <= 0:
            log.warning("shard lease: %s: lease %x expired; joining again", self.me.id, self.lease_id)
            self.lease_valid_until = 0.0
            await self._join()
            return
        self._granted(sent, reply.TTL)

    async def _read_map(self) -> bool:
        got = await self.etcd.get(self.map_key)
        if got is None:
            return False
        if got.mod_revision != self.map_revision:
            fresh = ShardMap.from_json(got.value)
            if self.shard_map is not None and fresh.epoch <= self.shard_map.epoch:
                raise ValueError(f"shard map epoch went from {self.shard_map.epoch} to {fresh.epoch}")
            self.shard_map, self.map_revision = fresh, got.mod_revision
            log.info("shard map: epoch %d: %s", fresh.epoch, fresh.counts())
            if self.on_map is not None:
                self.on_map(fresh)
        return True

    async def _members(self) -> dict[str, str]:
        out = {}
        for kv in await self.etcd.get_prefix(self.members_key):
            out[kv.key[len(self.members_key):].decode()] = kv.value.decode()
        return out

    async def _take_over(self) -> None:
        """Gives the slots of owners with no member key (lease expired) to the members."""
        m = self.shard_map
        if m is None or not self.serving():
            return
        members = await self._members()
        dead = [o.id for o in m.owners if o.id not in members]
        if not dead:
            return
        fresh = m
        for owner_id in dead:
            fresh = fresh.removing(owner_id) if len(fresh.owners) > 1 else fresh
        t = self.etcd.transactions
        ok, _ = await self.etcd.transaction(
            compare=[t.mod(self.map_key) == self.map_revision,
                     *(t.version(self.members_key + d.encode()) == 0 for d in dead)],
            success=[t.put(self.map_key, fresh.to_json().encode())], failure=[])
        if ok:
            self.takeovers += 1
            log.warning("shard map: %s took the slots of %s (lease expired): epoch %d: %s", self.me.id,
                        ", ".join(dead), fresh.epoch, fresh.counts())
        await self._read_map()
