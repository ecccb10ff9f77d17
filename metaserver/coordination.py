"""Several metaservers on etcd: a lease per metaserver, the shard map, and which
hash slots (kvfs.shards) this metaserver may answer for right now.

etcd holds, under `/kvfs/<cluster>/`:
  - `members/<id>`: the metaserver's address, attached to its lease, so it
    disappears when the metaserver stops renewing (it died, or lost etcd). A
    member key is created only where none exists (a second process with the same
    id waits until the first one's lease is gone);
  - `shardmap`: the shard map (ShardMap.to_json), changed only by compare-and-swap
    on its revision, and only forwards (a higher epoch).

A metaserver answers for a slot only while (1) the map it holds gives it the slot,
(2) its lease is surely alive: counted from the moment it *sent* the renewal etcd
granted, less a margin for clock rates, so it stops before etcd can expire the
lease, and (3) it read its own member key holding its lease less than a TTL ago
(counted the same way), and the map after it since it last (re)joined. Another
metaserver takes a dead one's slots only after it has seen the dead one's member
key absent for a whole TTL (a key deleted by hand under a live lease: its owner has
stopped by then), in a transaction that also checks the key is still gone and the
map unchanged. All metaservers of a cluster use the same TTL. A metaserver that rejoins puts its member key
back before it reads the map, so a takeover either came first (it reads the new
map) or fails its check. A map it cannot believe (malformed, or older than the one
it holds) stops it answering until a good one is there: fail closed.

No watch streams: renewals run every quarter of the TTL in a task of their own,
and every `poll` seconds another reads the member key and the map and looks for
owners whose member key is gone. Each request has a deadline; a failed one moves
the client to the next etcd endpoint. Requests carry etcd's `hasleader` flag, so a
member cut off from its quorum refuses them rather than answering from its past.
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
    """aetcd's client, connected to one of several etcd endpoints at a time
    (`rotate` moves to the next), plaintext or TLS. Username/password auth is not
    supported here: a cluster's etcd takes client certificates."""

    def __init__(self, endpoints: list[str], credentials: grpc.ChannelCredentials | None = None,
                 timeout: float = 5.0, authority: str | None = None):
        if not endpoints:
            raise ValueError("etcd: no endpoints")
        options = {"grpc.ssl_target_name_override": authority} if authority else {}
        super().__init__(timeout=timeout, options=options)
        self.endpoints = list(endpoints)
        self._at = 0
        self._credentials = credentials
        self._rotating = asyncio.Lock()

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._at]

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await bounded(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            opts = list(self._options.items())
            self.channel = (grpc.aio.secure_channel(self.endpoint, self._credentials, opts) if self._credentials
                            else grpc.aio.insecure_channel(self.endpoint, opts))
            self.metadata = (("hasleader", "true"),)  # a member without a leader refuses
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False

    async def rotate(self) -> None:
        """Drops the connection; the next request goes to the next endpoint. The old
        channel is closed in the background: closing one to a member that stopped
        answering can take as long as it likes."""
        if self._rotating.locked():
            return  # another caller is moving on already
        async with self._rotating:
            channel = self.channel
            self._init_channel_attrs()
            self._connected.clear()
            self._at = (self._at + 1) % len(self.endpoints)
            if channel is not None:
                task = asyncio.get_running_loop().create_task(channel.close())
                task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def bounded(call, timeout: float):
    """The result of `call` (a coroutine), or TimeoutError after `timeout` s. Unlike
    asyncio.wait_for, it does not wait for the abandoned call to finish cancelling:
    a gRPC call to an etcd member that stopped answering (SIGSTOP, a partition) was
    seen to hang in its cancellation."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise TimeoutError(f"etcd did not answer in {timeout:.1f} s")
    if task.cancelled():  # not us: the call's channel was closed under it (rotate)
        raise ConnectionError("etcd call cancelled: its channel was closed")
    return task.result()


def keys(cluster: str) -> tuple[bytes, bytes]:
    """The shard map's key and the members' prefix for `cluster`."""
    if not cluster or "/" in cluster:
        raise ValueError(f"a cluster name is non-empty and has no '/', got {cluster!r}")
    base = f"/kvfs/{cluster}/".encode()
    return base + b"shardmap", base + b"members/"


class MemberKeyHeld(RuntimeError):
    """Another lease holds this metaserver's member key."""


class SlotLease:
    """This metaserver's hold on its slots (see the module docstring). `serves` is
    the one question the RPCs ask."""

    def __init__(self, etcd: EtcdClient, cluster: str, me: Owner, ttl: int = 6, poll: float | None = None,
                 clock: Callable[[], float] = time.monotonic, on_map: Callable[[ShardMap], None] | None = None):
        if ttl < 2:
            raise ValueError(f"a lease TTL is at least 2 s, got {ttl}")
        self.etcd, self.me, self.ttl = etcd, me, ttl
        self.poll = poll if poll is not None else ttl / 4
        self.map_key, self.members_key = keys(cluster)
        self.member_key = self.members_key + me.id.encode()
        self.clock = clock
        self.on_map = on_map
        self.lease_id: int | None = None
        self.lease_valid_until = 0.0  # clock(): the latest moment the lease is surely alive
        self.shard_map: ShardMap | None = None
        self.map_revision = 0
        self.takeovers = 0  # maps this session wrote to take dead owners' slots
        self._confirmed = False  # member key and map read since the last join
        self._checked_until = 0.0  # clock(): a member-key check seen holding our lease counts until then
        self._absent_since: dict[str, float] = {}  # map owners seen without a member key, since when
        self._stopped = False
        self._rejected = 0  # the map revision last refused
        self._join_lock = asyncio.Lock()
        self._joins = 0  # a map round confirms nothing if a join happened during it
        self._tasks: list[asyncio.Task] = []
        self._trouble: dict[str, str] = {}  # per loop, the last error logged (logged again only when it changes)

    # ---- what the RPCs ask ----------------------------------------------

    def serving(self) -> bool:
        """Whether this metaserver may answer for the slots its map gives it."""
        now = self.clock()
        return not self._stopped and self._confirmed and now < self.lease_valid_until and now < self._checked_until

    def serves(self, slot: int) -> bool:
        m = self.shard_map
        return m is not None and self.serving() and m.owner_of(slot).id == self.me.id

    # ---- joining and leaving --------------------------------------------

    async def start(self, create_over: int = 1, deadline: float = 30.0) -> None:
        """Joins and reads the map; with no map yet, waits for `create_over` members
        (this one included) and writes an even map over them (one starter wins)."""
        self._stopped = False
        end = self.clock() + deadline
        try:
            while True:
                try:
                    if self.lease_id is None:
                        await self._join()
                    await self._map_round(create_over=create_over)
                    if self._confirmed:
                        break
                except (MemberKeyHeld, ValueError, OSError, grpc.RpcError, aetcd.ClientError,
                        asyncio.TimeoutError) as err:
                    self._note("start", err)
                    if not isinstance(err, (MemberKeyHeld, ValueError)):
                        await self.etcd.rotate()
                if self.clock() > end:
                    raise TimeoutError(f"{self.me.id}: not serving after {deadline} s "
                                       f"({self._trouble.get('start') or 'no shard map yet'})")
                await asyncio.sleep(self.poll)
        except BaseException:
            await self._revoke()
            raise
        self._tasks = [asyncio.create_task(self._loop(self._renew, self.ttl / 4, "renew")),
                       asyncio.create_task(self._loop(self._map_round, self.poll, "map"))]

    async def stop(self, revoke: bool = True) -> None:
        """Stops answering and renewing; `revoke` ends the lease now (a clean stop:
        the others take the slots at once) rather than at its expiry."""
        self._stopped, self._confirmed, self.lease_valid_until = True, False, 0.0
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if revoke:
            await self._revoke()

    async def _revoke(self) -> None:
        if self.lease_id is None:
            return
        try:
            await bounded(self.etcd.revoke_lease(self.lease_id), timeout=self.ttl / 2)
        except Exception as err:  # noqa: BLE001 - etcd gone: the lease ends at its TTL anyway
            log.warning("shard lease: %s: revoking lease %x: %s", self.me.id, self.lease_id, err)
        self.lease_id = None

    async def _join(self) -> None:
        """A new lease and the member key on it, created only where none is: then the
        map must be read again before anything is served."""
        async with self._join_lock:
            self._confirmed = False
            self.shard_map, self.map_revision = None, 0
            sent = self.clock()
            lease = await bounded(self.etcd.lease(self.ttl), timeout=self.ttl / 2)
            t = self.etcd.transactions
            try:
                ok, _ = await bounded(self.etcd.transaction(
                    compare=[t.version(self.member_key) == 0],
                    success=[t.put(self.member_key, self.me.address.encode(), lease=lease.id)], failure=[]),
                    timeout=self.ttl / 2)
            except BaseException:
                await self._quietly(self.etcd.revoke_lease(lease.id))
                raise
            if not ok:
                await self._quietly(self.etcd.revoke_lease(lease.id))
                raise MemberKeyHeld(f"member key {self.member_key.decode()} is held by another lease (another "
                                    f"process with id {self.me.id}, or this one's lapsed lease not yet expired)")
            self.lease_id = lease.id
            self._joins += 1  # rounds under way confirm nothing, and nothing read before counts:
            self._confirmed = False
            self.shard_map, self.map_revision = None, 0
            self.lease_valid_until = sent + lease.ttl * (1 - CLOCK_MARGIN)
            log.info("shard lease: %s joined with lease %x (TTL %d s)", self.me.id, lease.id, lease.ttl)

    async def _quietly(self, call) -> None:
        try:
            await bounded(call, timeout=self.ttl / 4)
        except Exception as err:  # noqa: BLE001 - best effort: an orphan lease expires on its own
            log.debug("shard lease: %s", err)

    # ---- the loops --------------------------------------------------------

    async def _loop(self, step, every: float, name: str) -> None:
        while True:
            try:
                await step()
                if self._trouble.pop(name, None) is not None:
                    log.info("shard lease: %s: %s works again", self.me.id, name)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - etcd unreachable, slow or refusing: next round
                self._note(name, err)
                if not isinstance(err, (MemberKeyHeld, ValueError)):
                    await self.etcd.rotate()
            await asyncio.sleep(every)

    def _note(self, name: str, err: BaseException) -> None:
        text = f"{type(err).__name__}: {err}"[:300]
        if self._trouble.get(name) != text:
            self._trouble[name] = text
            log.warning("shard lease: %s: %s failed (%s); answering for %.1f s more at most", self.me.id, name,
                        text, max(0.0, self.lease_valid_until - self.clock()) if self.serving() else 0.0)

    async def _renew(self) -> None:
        if self.lease_id is None:
            await self._join()
            return
        sent = self.clock()
        reply = await bounded(self.etcd.refresh_lease(self.lease_id), timeout=self.ttl / 4)
        if reply is None or reply.TTL <= 0:
            log.warning("shard lease: %s: lease %x expired; joining again", self.me.id, self.lease_id)
            self._confirmed, self.lease_id, self.lease_valid_until = False, None, 0.0
            await self._join()
            return
        if not self._stopped and reply.ID == self.lease_id:
            self.lease_valid_until = max(self.lease_valid_until, sent + reply.TTL * (1 - CLOCK_MARGIN))

    async def _map_round(self, create_over: int = 0) -> None:
        """Checks the member key, reads the map (creating it when there is none and
        `create_over` members are there), then takes over dead owners' slots."""
        deadline = self.poll * 2
        joins, sent = self._joins, self.clock()
        got = await bounded(self.etcd.get(self.member_key), timeout=deadline)
        if got is None or got.lease != self.lease_id:
            self._confirmed = False
            lost, self.lease_id = self.lease_id, None
            if lost is not None:  # deleted by hand, or taken under another lease: start over
                log.error("shard lease: %s: member key %s; joining again with a new lease", self.me.id,
                          "is gone" if got is None else f"is on lease {got.lease:x}, not ours ({lost:x})")
                await self._quietly(self.etcd.revoke_lease(lost))
            raise MemberKeyHeld(f"{self.me.id}: no member key on a lease of ours")
        self._checked_until = sent + self.ttl * (1 - CLOCK_MARGIN)
        if not await self._read_map():
            if create_over and await self._create(create_over):
                await self._read_map()
            if self.shard_map is None:
                return
        if self._joins != joins:  # rejoined meanwhile: the map read may predate the new member key
            return
        self._confirmed = True
        await bounded(self._readdress(), timeout=deadline)
        await bounded(self._take_over(), timeout=deadline)

    async def _read_map(self) -> bool:
        got = await bounded(self.etcd.get(self.map_key), timeout=self.poll * 2)
        if got is None:
            return False
        if got.mod_revision == self.map_revision:
            return True
        if got.mod_revision == self._rejected:
            raise ValueError(f"the shard map at revision {got.mod_revision} was refused; waiting for another")
        try:
            fresh = ShardMap.from_json(got.value)
            if self.shard_map is not None and fresh.epoch <= self.shard_map.epoch:
                raise ValueError(f"shard map epoch went from {self.shard_map.epoch} to {fresh.epoch}")
        except ValueError as err:
            self._confirmed = False  # fail closed: answer nothing until a map can be believed
            self._rejected = got.mod_revision
            log.error("shard lease: %s: refusing the shard map at revision %d: %s; answering nothing until a good "
                      "one is written", self.me.id, got.mod_revision, err)
            raise
        self.shard_map, self.map_revision = fresh, got.mod_revision
        log.info("shard map: epoch %d over %d owners; %s holds %d slots", fresh.epoch, len(fresh.owners),
                 self.me.id, fresh.counts().get(self.me.id, 0))
        if self.on_map is not None:
            self.on_map(fresh)
        return True

    async def _create(self, create_over: int) -> bool:
        members = await self._members()
        if len(members) < create_over:
            return False
        fresh = ShardMap.even([Owner(i, members[i]) for i in sorted(members)])
        t = self.etcd.transactions
        ok, _ = await bounded(self.etcd.transaction(
            compare=[t.version(self.map_key) == 0], success=[t.put(self.map_key, fresh.to_json().encode())],
            failure=[]), timeout=self.poll * 2)
        if ok:
            log.info("shard map: created epoch %d over %s", fresh.epoch, ", ".join(sorted(members)))
        return True

    async def _members(self) -> dict[str, str]:
        out = {}
        for kv in await bounded(self.etcd.get_prefix(self.members_key), timeout=self.poll * 2):
            try:
                owner = Owner(kv.key[len(self.members_key):].decode(), kv.value.decode())
            except (UnicodeDecodeError, ValueError) as err:
                log.warning("shard lease: ignoring member key %r: %s", kv.key[:200], err)
                continue
            out[owner.id] = owner.address
        return out

    async def _readdress(self) -> None:
        """Writes this metaserver's address into the map where the map still lists
        another for it (it came back on a new address: clients route by the map).
        Its slots stay where they are."""
        m = self.shard_map
        if m is None or not any(o.id == self.me.id and o.address != self.me.address for o in m.owners):
            return
        fresh = ShardMap(m.epoch + 1, [self.me if o.id == self.me.id else o for o in m.owners], m.slots)
        t = self.etcd.transactions
        ok, _ = await self.etcd.transaction(compare=[t.mod(self.map_key) == self.map_revision],
                                            success=[t.put(self.map_key, fresh.to_json().encode())], failure=[])
        if ok:
            log.info("shard map: %s is at %s now: epoch %d", self.me.id, self.me.address, fresh.epoch)
        await self._read_map()

    async def _take_over(self) -> None:
        """Gives the slots of owners whose member key is gone (lease expired) to the
        live owners, or, when none of the map's owners lives, to every member."""
        m = self.shard_map
        if m is None or not self.serving():
            return
        members = await self._members()
        now = self.clock()
        for o in m.owners:
            if o.id in members:
                self._absent_since.pop(o.id, None)
            else:
                self._absent_since.setdefault(o.id, now)
        # A key can go while its lease lives (deleted by hand); its owner stops within a
        # TTL of its last check that saw the key, so the slots wait a TTL of absence.
        dead = [o.id for o in m.owners if now - self._absent_since.get(o.id, now) >= self.ttl]
        if not dead:
            return
        live = [o.id for o in m.owners if o.id in members]
        if live and self.me.id not in live:
            return  # the map's own live owners do it
        fresh = m.removing(*dead) if live else \
            ShardMap.even([Owner(i, members[i]) for i in sorted(members)], epoch=m.epoch + 1)
        t = self.etcd.transactions
        ok, _ = await self.etcd.transaction(
            compare=[t.mod(self.map_key) == self.map_revision,
                     *(t.version(self.members_key + d.encode()) == 0 for d in dead)],
            success=[t.put(self.map_key, fresh.to_json().encode())], failure=[])
        if ok:
            self.takeovers += 1
            log.warning("shard map: %s gave the slots of %s (lease expired) to %s: epoch %d", self.me.id,
                        ", ".join(dead), ", ".join(o.id for o in fresh.owners), fresh.epoch)
        await self._read_map()
