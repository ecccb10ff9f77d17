"""Metaservers' hold on hash slots through real etcd (metaserver/coordination.py):
one map, one owner per slot at every moment, whatever happens to etcd, the member
keys or the map."""

import asyncio
import contextlib
import time

import pytest

from kvfs.metaserver.coordination import CLOCK_MARGIN, EtcdClient, SlotLease, keys
from kvfs.shards import HASH_SLOTS, Owner, ShardMap

from etcd import EtcdCluster
from helpers import until

MAP_KEY, MEMBERS = keys("test")


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path, 3)
    yield cluster
    cluster.stop()


def lease(etcd, name: str, *members: str, ttl: int = 4, rebalance: bool = True) -> SlotLease:
    return SlotLease(EtcdClient(etcd.endpoints(*members), timeout=2), "test", Owner(name, f"{name}.example:7000"),
                     ttl=ttl, rebalance=rebalance)


class NeverTwo:
    """Samples which leases answer for a few slots every millisecond, and records
    any moment when two answer for one slot."""

    def __init__(self, leases, slots):
        self.leases, self.slots, self.both, self.samples = leases, slots, [], 0

    async def run(self):
        while True:
            for s in self.slots:
                holders = [x.me.id for x in self.leases if x.serves(s)]
                if len(holders) > 1:
                    self.both.append((s, holders))
            self.samples += 1
            await asyncio.sleep(0.001)

    @contextlib.asynccontextmanager
    async def watching(self):
        task = asyncio.create_task(self.run())
        try:
            yield self
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert self.samples > 10 and not self.both, self.both[:5]


def spread(m: ShardMap) -> list[int]:
    """A few slots of every owner: first, middle, last."""
    out = []
    for o in m.owners:
        mine = m.slots_of(o.id)
        out += [mine[0], mine[len(mine) // 2], mine[-1]]
    return out


async def stop_all(*leases):
    for x in leases:
        await x.stop()
        await x.etcd.close()


@contextlib.asynccontextmanager
async def started(*leases):
    """The leases started together (the map made over all of them), stopped after."""
    try:
        await asyncio.gather(*(x.start(create_over=len(leases)) for x in leases))
        yield leases
    finally:
        await stop_all(*leases)


async def test_starters_agree_on_one_even_map_and_a_clean_stop_hands_its_slots_over(etcd):
    async with started(lease(etcd, "m0"), lease(etcd, "m1")) as (a, b):
        assert a.shard_map == b.shard_map and a.shard_map.epoch == 1
        assert a.shard_map.counts() == {"m0": HASH_SLOTS // 2, "m1": HASH_SLOTS // 2}
        assert all(sum(x.serves(s) for x in (a, b)) == 1 for s in range(HASH_SLOTS))
        async with NeverTwo([a, b], spread(a.shard_map)).watching():
            await a.stop()  # revokes: its member key goes at once
            await until(lambda: all(b.serves(s) for s in range(HASH_SLOTS)), timeout=15, what="m1 serving all")
        assert not any(a.serves(s) for s in range(HASH_SLOTS))
        assert b.shard_map.epoch == 2 and [o.id for o in b.shard_map.owners] == ["m1"] and b.takeovers == 1


async def test_an_owner_cut_off_from_etcd_stops_answering_before_another_takes_its_slots(etcd):
    # m0 reaches etcd only through e0; freezing e0 cuts it off while e1 and e2 keep a quorum
    async with started(lease(etcd, "m0", "e0", ttl=3), lease(etcd, "m1", "e1", "e2", ttl=3)) as (a, b):
        slot = a.shard_map.slots_of("m0")[0]
        assert a.serves(slot) and not b.serves(slot)
        async with NeverTwo([a, b], spread(a.shard_map)).watching():
            etcd.pause("e0")
            await until(lambda: b.serves(slot), timeout=30, what="m1 taking m0's slots")
            assert not a.serving() and b.takeovers == 1
            assert all(b.serves(s) for s in range(HASH_SLOTS))
            etcd.resume("e0")  # back: its lease is gone, it joins again, and the map gives it nothing
            await until(lambda: a.serving(), timeout=20, what="m0 holding a lease and the map again")
        assert a.shard_map.epoch == b.shard_map.epoch == 2
        assert not any(a.serves(s) for s in range(HASH_SLOTS))


async def test_a_member_key_deleted_under_a_live_lease_is_put_back_and_nobody_takes_its_slots(etcd):
    async with started(lease(etcd, "m0"), lease(etcd, "m1")) as (a, b):
        old = a.lease_id
        async with NeverTwo([a, b], spread(a.shard_map)).watching():
            await a.etcd.delete(MEMBERS + b"m0")  # an operator's mistake; m0's lease lives on
            await until(lambda: not a.serving(), timeout=10, what="m0 noticing its key gone")
            mine = a.shard_map.slots_of("m0")[0]
            await until(lambda: a.serves(mine) and a.lease_id != old, timeout=20, what="m0 joined again")
        # m0 was back within a TTL of its key going, so m1 never took its slots
        assert b.takeovers == 0 and a.shard_map.epoch == 1


async def test_a_second_process_with_the_same_id_never_serves_beside_the_first(etcd):
    a, twin = lease(etcd, "m0"), lease(etcd, "m0")
    try:
        await a.start()
        with pytest.raises(TimeoutError, match="held by another lease"):
            await twin.start(deadline=3)
        assert a.serves(0) and not twin.serving()
    finally:
        await stop_all(a, twin)


async def test_when_every_owner_in_the_map_is_gone_the_members_left_take_all_slots(etcd):
    a = lease(etcd, "m0", rebalance=False)  # leaves members the map does not list out of it: standbys
    late = lease(etcd, "m9")  # joins after the map exists: not in it
    try:
        await a.start()
        await late.start()
        assert late.serving() and not any(late.serves(s) for s in range(HASH_SLOTS))
        async with NeverTwo([a, late], [0, HASH_SLOTS - 1]).watching():
            await a.stop()
            await until(lambda: all(late.serves(s) for s in range(HASH_SLOTS)), timeout=15, what="m9 taking all")
        assert [o.id for o in late.shard_map.owners] == ["m9"] and late.shard_map.epoch == 2
    finally:
        await stop_all(a, late)


async def test_a_metaserver_joining_a_running_cluster_gets_a_share_without_two_answering_for_a_slot(etcd):
    async with started(lease(etcd, "m0"), lease(etcd, "m1")) as (a, b):
        before = a.shard_map
        c = lease(etcd, "m2")
        try:
            async with NeverTwo([a, b, c], range(0, HASH_SLOTS, 7)).watching():
                await c.start()  # joins; a live owner adds it to the map
                await until(lambda: c.shard_map is not None and len(c.shard_map.owners) == 3 and not c.pending,
                            timeout=20, what="m2 added and its slots handed over")
            m = c.shard_map
            assert m.epoch == before.epoch + 1 and a.additions + b.additions == 1
            counts = m.counts()
            assert counts["m2"] == HASH_SLOTS // 3 and sorted(counts.values()) == [5461, 5461, 5462]
            moved = before.moves(m)
            assert {(frm, to) for _, _, frm, to in moved} == {("m0", "m2"), ("m1", "m2")}
            assert all(c.serves(s) and not a.serves(s) and not b.serves(s)
                       for first, last, _, _ in moved for s in range(first, last + 1))
            assert all(sum(x.serves(s) for x in (a, b, c)) == 1 for s in range(HASH_SLOTS))
        finally:
            await stop_all(c)


async def test_slots_moved_from_an_owner_cut_off_from_etcd_wait_until_its_lease_has_lapsed(etcd):
    # m0 reaches etcd only through e0: frozen, it cannot take (or acknowledge) the map that
    # adds m2, and keeps answering for its slots until its lease runs out
    async with started(lease(etcd, "m0", "e0", ttl=3), lease(etcd, "m1", "e1", "e2", ttl=3)) as (a, b):
        before = a.shard_map
        c = lease(etcd, "m2", "e1", "e2", ttl=3)
        try:
            async with NeverTwo([a, b, c], range(0, HASH_SLOTS, 7)).watching() as watch:
                etcd.pause("e0")
                await c.start()
                await until(lambda: c.shard_map is not None and any(o.id == "m2" for o in c.shard_map.owners),
                            timeout=20, what="m2 in the map")
                from_m0 = next(f for f, _, frm, to in before.moves(c.shard_map) if (frm, to) == ("m0", "m2"))
                assert c.pending and not c.serves(from_m0)
                await until(lambda: c.serves(from_m0), timeout=30, what="m2 serving a slot moved from m0")
                assert not a.serving()
                etcd.resume("e0")
            assert watch.samples > 100
        finally:
            etcd.resume("e0")
            await stop_all(c)


async def test_a_map_written_wrong_or_older_stops_every_owner_until_a_good_one_is_back(etcd):
    async with started(lease(etcd, "m0"), lease(etcd, "m1")) as (a, b):
        good = a.shard_map
        # a map deleted and written again from scratch (epoch 1 over others): no owner may believe it
        restarted = ShardMap.even([Owner("m1", "m1.example:7000"), Owner("m0", "m0.example:7000")], epoch=1)
        async with NeverTwo([a, b], spread(good)).watching():
            for bad in (b"not json", restarted.to_json().encode()):
                await a.etcd.put(MAP_KEY, bad)
                await until(lambda: not a.serving() and not b.serving(), timeout=15, what="both refusing")
                assert a.shard_map == good
            newer = ShardMap(good.epoch + 5, good.owners, good.slots)
            await a.etcd.put(MAP_KEY, newer.to_json().encode())
            await until(lambda: a.serving() and b.serving(), timeout=15, what="both serving the newer map")
        assert a.shard_map == newer == b.shard_map


async def test_a_stopped_lease_started_again_reads_the_map_before_answering(etcd):
    async with started(lease(etcd, "m0"), lease(etcd, "m1")) as (a, b):
        await a.stop(revoke=False)  # its lease runs out in etcd; m1 takes its slots
        async with NeverTwo([a, b], spread(a.shard_map)).watching():
            await until(lambda: all(b.serves(s) for s in range(HASH_SLOTS)), timeout=20, what="m1 serving all")
            await a.start()
        assert a.shard_map.epoch == b.shard_map.epoch and not any(a.serves(s) for s in range(HASH_SLOTS))


async def test_a_metaserver_back_on_another_address_writes_it_into_the_map_and_keeps_its_slots(etcd):
    async with started(lease(etcd, "m0"), lease(etcd, "m1")) as (a, b):
        before = a.shard_map
        await a.stop()  # a clean stop; back well within a TTL, so m1 takes nothing
        moved = SlotLease(EtcdClient(etcd.endpoints(), timeout=2), "test", Owner("m0", "m0.elsewhere:7100"), ttl=4)
        try:
            await moved.start()
            await until(lambda: b.shard_map.epoch > before.epoch, timeout=15, what="m1 reading the new map")
            m = moved.shard_map
            assert m == b.shard_map and m.epoch == before.epoch + 1
            assert {o.id: o.address for o in m.owners} == {"m0": "m0.elsewhere:7100", "m1": "m1.example:7000"}
            assert m.slots == before.slots  # the same slots, at the new address
            assert moved.serves(m.slots_of("m0")[0])
        finally:
            await stop_all(moved)


async def test_a_frozen_endpoint_is_left_for_another(etcd):
    a = lease(etcd, "m0", "e0", "e1", "e2")
    try:
        await a.start()
        etcd.pause("e0")
        paused = time.monotonic()
        # a renewal sent after the pause was granted: through e1 or e2
        await until(lambda: a.lease_valid_until > paused + a.ttl * (1 - CLOCK_MARGIN), timeout=15,
                    what="a renewal sent after the pause, granted")
        assert a.etcd.endpoint != etcd.endpoint("e0") and a.serves(0)
    finally:
        etcd.resume("e0")
        await stop_all(a)


def test_cluster_names_are_checked():
    with pytest.raises(ValueError, match="cluster name"):
        keys("a/b")
    with pytest.raises(ValueError, match="cluster name"):
        keys("")
