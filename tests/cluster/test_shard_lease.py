"""Metaservers' hold on hash slots through real etcd (metaserver/coordination.py):
one map, one owner per slot, and a silent owner stops answering before anyone
else starts answering for its slots."""

import asyncio
import time

import pytest

from kvfs.metaserver.coordination import EtcdClient, SlotLease, keys
from kvfs.shards import HASH_SLOTS, Owner, ShardMap

from etcd import EtcdCluster
from helpers import until


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path, 3)
    yield cluster
    cluster.stop()


def lease(etcd, name: str, *members: str, **kw) -> SlotLease:
    return SlotLease(EtcdClient(etcd.endpoints(*members), timeout=2), "test", Owner(name, f"{name}.example:7000"),
                     **kw)


def served_by(leases) -> list[list[str]]:
    return [[s.me.id for s in leases if s.serves(slot)] for slot in range(HASH_SLOTS)]


async def stop_all(*leases):
    for s in leases:
        await s.stop()
        await s.etcd.close()


async def test_starters_agree_on_one_even_map_and_a_clean_stop_hands_its_slots_over(etcd):
    a, b = lease(etcd, "m0", ttl=2), lease(etcd, "m1", ttl=2)
    try:
        await asyncio.gather(a.start(create_over=2), b.start(create_over=2))
        assert a.shard_map == b.shard_map and a.shard_map.epoch == 1
        assert a.shard_map.counts() == {"m0": HASH_SLOTS // 2, "m1": HASH_SLOTS // 2}
        assert all(len(owners) == 1 for owners in served_by([a, b]))  # every slot, exactly one server

        await a.stop()  # revokes: its member key goes at once
        await until(lambda: all(b.serves(s) for s in range(HASH_SLOTS)), timeout=10, what="m1 serving every slot")
        assert not any(a.serves(s) for s in range(HASH_SLOTS))
        assert b.shard_map.epoch == 2 and [o.id for o in b.shard_map.owners] == ["m1"] and b.takeovers == 1
    finally:
        await stop_all(a, b)


async def test_an_owner_cut_off_from_etcd_stops_answering_before_another_takes_its_slots(etcd):
    # m0 reaches etcd only through e0; freezing e0 cuts it off while e1 and e2 keep a quorum
    a, b = lease(etcd, "m0", "e0", ttl=2), lease(etcd, "m1", "e1", "e2", ttl=2)
    try:
        await asyncio.gather(a.start(create_over=2), b.start(create_over=2))
        slot = a.shard_map.slots_of("m0")[0]
        assert a.serves(slot) and not b.serves(slot)
        etcd.pause("e0")
        last_a = first_b = None
        deadline = time.monotonic() + 30
        while first_b is None and time.monotonic() < deadline:
            now = time.monotonic()
            if a.serves(slot):
                last_a = now
            if b.serves(slot):
                first_b = now
            await asyncio.sleep(0.005)
        assert last_a is not None and first_b is not None, (last_a, first_b)
        assert first_b > last_a  # never both
        assert not a.serving() and b.takeovers == 1
        assert all(b.serves(s) for s in range(HASH_SLOTS))

        etcd.resume("e0")  # back: its lease is gone, it joins again, and the map gives it nothing
        await until(lambda: a.serving(), timeout=15, what="m0 holding a lease again")
        await until(lambda: a.shard_map.epoch == b.shard_map.epoch, timeout=10, what="m0 reading the new map")
        assert not any(a.serves(s) for s in range(HASH_SLOTS))
    finally:
        etcd.resume("e0")
        await stop_all(a, b)


async def test_a_map_written_wrong_in_etcd_is_not_believed_and_the_owner_keeps_serving(etcd):
    a = lease(etcd, "m0", ttl=2)
    try:
        await a.start()
        good = a.shard_map
        map_key, _ = keys("test")
        older = ShardMap.even([Owner("m1", "x:1")], epoch=0).to_json().encode()
        for bad, message in ((b"not json", "not a shard map"), (older, "epoch went from 1 to 0")):
            await a.etcd.put(map_key, bad)
            with pytest.raises(ValueError, match=message):
                await a.round()
            assert a.shard_map == good and a.serves(0)
    finally:
        await stop_all(a)


def test_cluster_names_are_checked():
    with pytest.raises(ValueError, match="cluster name"):
        keys("a/b")
    with pytest.raises(ValueError, match="cluster name"):
        keys("")
