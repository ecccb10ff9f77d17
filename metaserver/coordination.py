"""Several metaservers on etcd: a lease per metaserver, the shard map, and which
hash slots (kvfs.shards) this metaserver may answer for right now.

etcd holds, under `/kvfs/<cluster>/`:
  - `members/<id>`: the metaserver's address, attached to its lease, so it
    disappears when the metaserver stops renewing (it died, or lost etcd). A
    member key is created only where none exists (a second process with the same
    id waits until the first one's lease is gone);
  - `shardmap`: the shard map (ShardMap.to_json), changed only by compare-and-swap
    on its revision, and only forwards (a higher epoch);
  - `acks/<id>`: the epoch of the newest map the metaserver has taken, on its lease;
  - `ready/<id>`: for a metaserver the map does not list yet, how many chunkservers
    it hears from, on its lease.

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

Handing slots over. A metaserver that has taken a map acknowledges it (its `acks`
key) only after it stopped answering for what the map took from it. A slot a map
gives a metaserver that the map just before did not (or every slot of its, when
it missed a map or holds its first since joining) is *pending*: it answers for it
only once every other member holding a lease has acknowledged that map or a newer
one. So a slot moved from a live metaserver to another is never answered for by
both: the new holder waits for the old one to let go, or for its lease to lapse.

Rebalancing. A metaserver that joins a cluster whose map does not list it is added
to the map by a live owner (ShardMap.adding: about 1/(n+1) of the slots move to it,
taken from the owners that hold the most), once it hears from as many chunkservers
as that owner does (its `ready` key): it rebuilds the slots it gets from their
inventories, and a chunkserver it has not heard from yet would leave blocks out.
The slots it gets are pending until the old holders acknowledge.

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


def cluster_prefix(cluster: str) -> bytes:
    """Where `cluster`'s keys live in etcd."""
    if not cluster or "/" in cluster:
        raise ValueError(f"a cluster name is non-empty and has no '/', got {cluster!r}")
    return f"/kvfs/{cluster}/".encode()


def keys(cluster: str) -> tuple[bytes, bytes]:
    """The shard map's key and the members' prefix for `cluster`."""
    base = cluster_prefix(cluster)
    return base + b"shardmap", base + b"members/"


class MemberKeyHeld(RuntimeError):
    """Another lease holds this metaserver's member key."""


class SlotLease:
    """This metaserver's hold on its slots (see the module docstring). `serves` is
    the one question the RPCs ask."""

    def __init__(self, etcd: EtcdClient, cluster: str, me: Owner, ttl: int = 6, poll: float | None = None,
                 clock: Callable[[], float] = time.monotonic, on_map: Callable[[ShardMap], None] | None = None,
                 rebalance: bool = True):
        if ttl < 2:
            raise ValueError(f"a lease TTL is at least 2 s, got {ttl}")
        self.etcd, self.me, self.ttl = etcd, me, ttl
        self.poll = poll if poll is not None else ttl / 4
        self.map_key, self.members_key = keys(cluster)
        self.member_key = self.members_key + me.id.encode()
        self.acks_key = cluster_prefix(cluster) + b"acks/"  # acks/<id>: an epoch
        self.ready_key = cluster_prefix(cluster) + b"ready/"  # ready/<id>: a count of chunkservers
        self.live_servers: Callable[[], int] = lambda: 0  # chunkservers this metaserver hears from
        self.members: dict[str, str] = {}  # id -> address of every member, as last read
        self.clock = clock
        self.on_map = on_map  # hears every map taken, before it is answered by
        self.on_settled: Callable[[], None] = lambda: None  # hears that no slot is pending any more
        self.rebalance = rebalance  # adds members the map does not list (off: they wait as standbys)
        self.pending: set[int] = set()  # slots the map gives us that we wait for the others to let go of
        self.acked = 0  # the epoch of the last map we acknowledged (on this lease)
        self.additions = 0  # maps this session wrote to add members
        self._announced = -1  # the chunkserver count last written to our ready key (on this lease)
        self._waits_noted: dict[str, int] = {}  # members not added yet: the count last logged for each
        self._waits_logged = 0  # the epoch whose wait for acknowledgements was logged
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
        return m is not None and self.serving() and m.owner_of(slot).id == self.me.id and slot not in self.pending

    # ---- joining and leaving --------------------------------------------

    async def start(self, create_over: int = 1, deadline: float = 30.0) -> None:
        """Joins and reads the map; with no map yet, waits for `create_over` members
        (this one included) and writes an even map over them (one starter wins).
        Returns once it answers for its slots: the others acknowledged the map (or,
        should one of them not within two TTLs, with those slots still pending)."""
        self._stopped = False
        end = self.clock() + deadline
        confirmed_at = None
        try:
            while True:
                try:
                    if self.lease_id is None:
                        await self._join()
                    await self._map_round(create_over=create_over)
                    if self._confirmed:
                        confirmed_at = confirmed_at or self.clock()
                        if not self.pending or self.clock() > confirmed_at + 2 * self.ttl:
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
            self.shard_map, self.map_revision, self.acked, self._announced = None, 0, 0, -1
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
        await bounded(self._acknowledge(), timeout=deadline)
        await bounded(self._settle(), timeout=deadline)
        await bounded(self._readdress(), timeout=deadline)
        await bounded(self._take_over(), timeout=deadline)
        await bounded(self._add_members(), timeout=deadline)
        await bounded(self._acknowledge(), timeout=deadline)  # a map this round wrote
        await bounded(self._announce(), timeout=deadline)

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
        before, mine = self.shard_map, fresh.slots_of(self.me.id) if self._listed(fresh) else []
        if before is not None and fresh.epoch == before.epoch + 1 and self._listed(before):
            held = set(before.slots_of(self.me.id))
            gained = {s for s in mine if s not in held}
        else:
            gained = set(mine)  # a map missed, or the first since joining: who held what meanwhile is unknown
        self.pending = (self.pending & set(mine)) | gained
        self.shard_map, self.map_revision = fresh, got.mod_revision
        log.info("shard map: epoch %d over %d owners; %s holds %d slots%s", fresh.epoch, len(fresh.owners),
                 self.me.id, len(mine), f", {len(self.pending)} of them pending their handover" if self.pending else "")
        if self.on_map is not None:
            self.on_map(fresh)
        return True

    def _listed(self, m: ShardMap) -> bool:
        return any(o.id == self.me.id for o in m.owners)

    async def _acknowledge(self) -> None:
        """Tells the others this metaserver took the map it holds: it answers for
        nothing the map does not give it (the RPCs check the map on every call)."""
        m = self.shard_map
        if m is None or m.epoch <= self.acked:
            return
        await self.etcd.put(self.acks_key + self.me.id.encode(), str(m.epoch).encode(), lease=self.lease_id)
        self.acked = m.epoch

    async def _settle(self) -> None:
        """Ends the wait on pending slots once every other member holding a lease has
        acknowledged this map or a newer one (a member without an ack key has not)."""
        m = self.shard_map
        if m is None or not self.pending:
            return
        members = await self._members()  # before the acks: a member joining after reads this map or a newer
        acks = await self._numbers(self.acks_key)
        waiting = sorted(i for i in members if i != self.me.id and acks.get(i, 0) < m.epoch)
        if waiting:
            if self._waits_logged != m.epoch:
                self._waits_logged = m.epoch
                log.info("shard map: %s waits for %s to take epoch %d before it answers for %d slots handed to it",
                         self.me.id, ", ".join(waiting), m.epoch, len(self.pending))
            return
        if self.shard_map is not m:
            return  # another map came meanwhile: the next round settles that one
        log.info("shard map: epoch %d acknowledged by every member; %s answers for its %d new slots", m.epoch,
                 self.me.id, len(self.pending))
        self.pending = set()
        self.on_settled()

    async def _announce(self) -> None:
        """While the map does not list this metaserver: how many chunkservers it hears
        from, for the owners to decide when to add it."""
        m = self.shard_map
        live = self.live_servers()
        if m is None or self._listed(m) or live == self._announced:
            return
        await self.etcd.put(self.ready_key + self.me.id.encode(), str(live).encode(), lease=self.lease_id)
        self._announced = live

    async def _add_members(self) -> None:
        """Adds to the map a member it does not list that hears from as many chunkservers
        as this metaserver does (one at a time: the next round adds the next). Only a
        serving owner does."""
        m = self.shard_map
        if not self.rebalance or m is None or not self.serves_any() or self.pending:
            return
        members = self.members  # as _take_over read them this round
        new = sorted(i for i in members if not any(o.id == i for o in m.owners))
        if not new:
            return
        ready = await self._numbers(self.ready_key)
        want = self.live_servers()
        ripe = [i for i in new if ready.get(i, -1) >= want]
        for i in new:
            if i not in ripe and self._waits_noted.get(i) != ready.get(i, -1):
                self._waits_noted[i] = ready.get(i, -1)
                log.info("shard map: metaserver %s joined; it is added once it hears from %d chunkservers, as %s "
                         "does (it hears from %s)", i, want, self.me.id, ready.get(i, "none yet"))
        if not ripe:
            return
        fresh = m.adding(Owner(ripe[0], members[ripe[0]]))
        t = self.etcd.transactions
        ok, _ = await self.etcd.transaction(
            compare=[t.mod(self.map_key) == self.map_revision,
                     t.version(self.members_key + ripe[0].encode()) > 0],
            success=[t.put(self.map_key, fresh.to_json().encode())], failure=[])
        if ok:
            self.additions += 1
            log.warning("shard map: %s added metaserver %s at %s: %d slots move to it, epoch %d", self.me.id,
                        ripe[0], members[ripe[0]], fresh.counts()[ripe[0]], fresh.epoch)
        await self._read_map()

    async def _numbers(self, prefix: bytes) -> dict[str, int]:
        """Member id -> the number under `prefix` (acks/, ready/); keys that do not parse are ignored."""
        out: dict[str, int] = {}
        for kv in await self.etcd.get_prefix(prefix):
            try:
                out[kv.key[len(prefix):].decode()] = int(kv.value)
            except (UnicodeDecodeError, ValueError):
                log.warning("shard lease: ignoring key %r", kv.key[:200])
        return out

    def serves_any(self) -> bool:
        m = self.shard_map
        return m is not None and self.serving() and self._listed(m)

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
        self.members = out
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
