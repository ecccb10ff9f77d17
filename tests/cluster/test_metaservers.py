"""Several metaservers (issue 19): real kvfs-metaserver processes on three real etcd
members split the hash slots (kvfs/shards.py), answer for their own, and send a
caller asking for another's to its holder ("moved", with its address in the
trailing metadata); a clean stop hands its slots to the other at once."""

import asyncio
import os
import subprocess
import sys

import aetcd
import grpc
import pytest

from kvfs.cli.launcher import start_metaserver
from kvfs.client import Client
from kvfs.errors import Moved, Unavailable, from_rpc_error
from kvfs.keys import Namespace, block_keys
from kvfs.metaserver.coordination import EtcdClient
from kvfs.proto import meta_pb2, meta_pb2_grpc
from kvfs.shards import HASH_SLOTS, ShardMap, hash_slot

from etcd import EtcdCluster
from helpers import free_port, until

NS = Namespace("t", "sharded")
NS_MSG = meta_pb2.Namespace(tenant=NS.tenant, model=NS.model)
LAYOUT_MSG = meta_pb2.BlockLayout(layers=2, block_tokens=4, kv_dim=8, dtype="bfloat16")


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path / "etcd", 3)
    yield cluster
    cluster.stop()


def metaserver_flags(etcd, name: str, expect: int = 2) -> list[str]:
    return ["--insecure", "--etcd", ",".join(etcd.endpoints()), "--cluster-name", "t", "--metaserver-id", name,
            "--expect-metaservers", str(expect), "--lease-ttl", "4"]


async def start_metaservers(tmp_path, etcd, names):
    """Started together: each waits for the others before the first map is written."""
    return await asyncio.gather(*(asyncio.to_thread(start_metaserver, tmp_path / n / "data", run_dir=tmp_path / n,
                                                    extra=metaserver_flags(etcd, n, len(names)), timeout=60)
                                  for n in names))


def tokens_in(owner_slots: set[int], seed: int) -> list[int]:
    """The tokens of a 4-block prompt whose first key's hash slot is in `owner_slots`."""
    for s in range(seed, seed + 10_000):
        if hash_slot(block_keys(NS, [s] * 16, 4)[0]) in owner_slots:
            return [s] * 16
    raise AssertionError("no such prompt in 10,000 tries")


def prompt_in(owner_slots: set[int], seed: int) -> list[bytes]:
    """The keys of a prompt whose first key's hash slot is in `owner_slots`."""
    return block_keys(NS, tokens_in(owner_slots, seed), 4)


async def shard_map(stub) -> ShardMap:
    reply = await stub.ShardMap(meta_pb2.ShardMapRequest(), timeout=10)
    m = ShardMap.from_json(reply.map_json)
    assert m.epoch == reply.epoch
    return m


async def refused(call, code) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value


async def test_two_metaservers_split_the_slots_and_send_callers_to_the_holder(tmp_path, etcd):
    servers = await start_metaservers(tmp_path, etcd, ["ms-a", "ms-b"])
    channels = [grpc.aio.insecure_channel(s.address) for s in servers]
    client = None
    try:
        a, b = (meta_pb2_grpc.MetaServiceStub(c) for c in channels)
        m = await shard_map(a)
        assert (await shard_map(b)).to_json() == m.to_json()  # one map, read by both
        assert m.counts() == {"ms-a": HASH_SLOTS // 2, "ms-b": HASH_SLOTS // 2}
        assert {o.id: o.address for o in m.owners} == {"ms-a": servers[0].address, "ms-b": servers[1].address}
        mine = {"ms-a": set(m.slots_of("ms-a")), "ms-b": set(m.slots_of("ms-b"))}
        in_a = prompt_in(mine["ms-a"], 0)

        def lookup(keys):
            return meta_pb2.MatchPrefixRequest(namespace=NS_MSG, joined_keys=b"".join(keys))

        assert (await a.MatchPrefix(lookup(in_a), timeout=10)).matched == 0  # its own slot: answered
        err = await refused(b.MatchPrefix(lookup(in_a), timeout=10), grpc.StatusCode.FAILED_PRECONDITION)
        assert f"hash slot {hash_slot(in_a[0])} is answered for by metaserver ms-a" in err.details()
        moved = from_rpc_error(err)  # what the SDK makes of it
        assert isinstance(moved, Moved) and moved.address == servers[0].address and moved.epoch == m.epoch
        # writes too: a prompt's first blocks, and a continuation naming its first key
        alloc = b.AllocateBlocks(meta_pb2.AllocateBlocksRequest(namespace=NS_MSG, keys=in_a[:2], layout=LAYOUT_MSG),
                                 timeout=10)
        assert "moved" in (await refused(alloc, grpc.StatusCode.FAILED_PRECONDITION)).details()
        alloc = b.AllocateBlocks(meta_pb2.AllocateBlocksRequest(
            namespace=NS_MSG, keys=in_a[2:4], layout=LAYOUT_MSG, parent=in_a[1], first_key=in_a[0]), timeout=10)
        assert "moved" in (await refused(alloc, grpc.StatusCode.FAILED_PRECONDITION)).details()
        # the holder goes on to place them (and says it has no chunkservers, here)
        alloc = a.AllocateBlocks(meta_pb2.AllocateBlocksRequest(namespace=NS_MSG, keys=in_a[:2], layout=LAYOUT_MSG),
                                 timeout=10)
        assert "no live chunkservers" in (await refused(alloc, grpc.StatusCode.UNAVAILABLE)).details()

        # the SDK, told of ms-b only, reads the map and asks each prompt's holder
        client = Client(servers[1].address, insecure=True, block_tokens=4)
        for tokens in (tokens_in(mine["ms-a"], 0), tokens_in(mine["ms-b"], 0)):
            assert (await client.lookup(NS, tokens)).matched == 0
        assert client.router.refreshes == 1 and client.router.map.epoch == m.epoch

        # a clean stop revokes ms-a's lease: ms-b holds every slot soon after, in a newer map
        await asyncio.to_thread(servers[0].stop)

        async def all_at_b():  # in the map, and answered for (the handover over)
            try:
                return (await shard_map(b)).counts().get("ms-b") == HASH_SLOTS and \
                    (await b.MatchPrefix(lookup(in_a), timeout=10)).matched == 0  # nothing of ms-a's: not cached
            except grpc.aio.AioRpcError:
                return False

        await until(all_at_b, timeout=30, what="ms-b holding and answering for every slot")
        assert (await shard_map(b)).epoch > m.epoch
        # the SDK's map still sends ms-a's prompts to ms-a, which is gone: it reads the map again
        assert (await client.lookup(NS, tokens_in(mine["ms-a"], 0))).matched == 0
        assert client.router.refreshes == 2 and client.router.map.counts() == {"ms-b": HASH_SLOTS}
    finally:
        if client is not None:
            await client.close()
        for c in channels:
            await c.close()
        for s in servers:
            s.stop()


async def test_a_metaserver_answers_for_nothing_until_it_holds_its_lease(tmp_path, etcd):
    # it waits for a second metaserver that never comes: no map is written, so nothing is answered
    port = free_port()
    log = open(tmp_path / "ms-a.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvfs.metaserver", "--data-dir", str(tmp_path / "data"),
                             "--listen", f"127.0.0.1:{port}", *metaserver_flags(etcd, "ms-a", expect=2)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = meta_pb2_grpc.MetaServiceStub(channel)
            keys = block_keys(NS, [1] * 8, 4)

            async def answered():
                try:
                    await stub.MatchPrefix(meta_pb2.MatchPrefixRequest(namespace=NS_MSG, keys=keys), timeout=2)
                    return "answered"
                except grpc.aio.AioRpcError as err:
                    return err if err.code() != grpc.StatusCode.UNAVAILABLE or "answers for no hash slot" in \
                        err.details() else None  # None: not listening yet

            outcome = await until(answered, timeout=30, what="the metaserver listening")
            assert isinstance(outcome, grpc.aio.AioRpcError), outcome  # never an answer
            assert outcome.code() == grpc.StatusCode.UNAVAILABLE
            assert isinstance(from_rpc_error(outcome), Unavailable)
            err = await refused(stub.ShardMap(meta_pb2.ShardMapRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE)
            assert "holds no shard map yet" in err.details()
            err = await refused(stub.AllocateBlocks(meta_pb2.AllocateBlocksRequest(
                namespace=NS_MSG, keys=keys[:1], layout=LAYOUT_MSG), timeout=5), grpc.StatusCode.UNAVAILABLE)
            assert "answers for no hash slot" in err.details()
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


async def test_a_local_cluster_of_two_metaservers_serves_the_sdk(tmp_path):
    # `kvfs cluster up --metaservers 2`'s cluster: a local etcd, mutual TLS, every chunkserver on both
    from kvfs.cli.launcher import LocalCluster, meta_status
    from kvfs.layout import BlockLayout

    from helpers import layer_major, restore_all, tokens_for

    layout = BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")
    with LocalCluster(tmp_path, chunkservers=3, metaservers=2) as cluster:
        assert cluster.etcd.alive() and len(cluster.meta_addresses.split(",")) == 2
        prompts = [tokens_for(2, seed=s) for s in range(12)]
        async with Client(cluster.meta_addresses, credentials=cluster.worker) as client:
            payloads = []
            for tokens in prompts:
                payloads.append(layer_major(layout, [os.urandom(layout.payload_bytes) for _ in range(2)]))
                await client.write(NS, tokens, payloads[-1], layout)
            for tokens, payload in zip(prompts, payloads):
                match = await client.lookup(NS, tokens)
                assert match.matched == 2
                assert (await restore_all(client, match, layout))[0] == payload
            owners = {client.router.map.route((await client.keys(NS, t))[0]).id for t in prompts}
        assert owners == {"metaserver", "metaserver-1"}  # the prompts spread over both
        statuses = [meta_status(m.address, credentials=cluster.admin) for m in cluster.metas]
        assert sum(st.blocks for st in statuses) == 2 * len(prompts) and all(st.blocks for st in statuses)
        assert all(sum(s.live for s in st.servers) == 3 for st in statuses)  # each chunkserver on both
        # etcd (the shard map, the leases) takes only its own CA's clients: not the cluster's worker
        etcd_root = cluster.etcd_ca.authority.cert
        for creds in (cluster.worker, cluster.admin):
            client = EtcdClient([cluster.etcd.address], timeout=3, credentials=grpc.ssl_channel_credentials(
                root_certificates=etcd_root, private_key=creds.key, certificate_chain=creds.cert))
            try:
                with pytest.raises(aetcd.ClientError):
                    await client.put(b"/kvfs/local/shardmap", b"{}")
            finally:
                await client.close()
        metaserver_log = (tmp_path / "metaserver.log").read_text()
        assert "etcd at" in metaserver_log and "mutual TLS as 'metaserver'" in metaserver_log
    assert not cluster.etcd.alive()


async def test_a_metaserver_added_to_a_running_cluster_takes_a_share_and_serves_its_prompts(tmp_path):
    # rebalancing: a third metaserver joins a cluster of two holding cached prompts. The
    # chunkservers learn of it from heartbeats, the map gives it a third of the slots, it
    # rebuilds their blocks from the chunkservers, the old holders forget theirs (and
    # delete no chunk), and a worker that knows only the first two restores every prompt
    from kvfs.cli.launcher import LocalCluster, meta_status
    from kvfs.layout import BlockLayout

    from helpers import layer_major, restore_all, tokens_for

    layout = BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")
    prompts = [tokens_for(2, seed=s) for s in range(30)]
    with LocalCluster(tmp_path, chunkservers=3, metaservers=2) as cluster:
        first_two = cluster.meta_addresses
        async with Client(first_two, credentials=cluster.worker) as client:
            payloads = []
            for tokens in prompts:
                payloads.append(layer_major(layout, [os.urandom(layout.payload_bytes) for _ in range(2)]))
                await client.write(NS, tokens, payloads[-1], layout)
            before = client.router.map
            firsts = [(await client.keys(NS, t))[0] for t in prompts]

        def statuses():
            return [meta_status(m.address, credentials=cluster.admin) for m in cluster.metas]

        chunks = 2 * len(prompts) * cluster.replicas  # a block is one chunk here (16 KiB)
        await until(lambda: sum(s.chunk_count for s in statuses()[0].servers) == chunks, timeout=30,
                    what="heartbeats counting every chunk")
        third = cluster.add_metaserver()
        assert third.address not in first_two
        # every chunkserver registers with it (named in the others' heartbeat replies)
        cluster.wait_until(lambda st: sum(s.live for s in st.servers) == 3, timeout=30,
                           what="the chunkservers registered with the new metaserver", address=third.address)

        async def map_of_three():
            async with Client(first_two, credentials=cluster.worker) as c:
                await c.router.refresh()
                return c.router.map if len(c.router.map.owners) == 3 else None

        after = await until(map_of_three, timeout=30, interval=0.2, what="the map giving the new metaserver slots")
        assert after.epoch == before.epoch + 1
        moved = [i for i, k in enumerate(firsts) if after.route(k).address == third.address]
        assert moved, "no prompt landed in the slots that moved (30 prompts, a third of the slots)"
        assert all(before.route(firsts[i]).address != third.address for i in moved)
        # rebuilt there, forgotten where they were: every block is on exactly one metaserver
        cluster.wait_until(lambda st: st.blocks == 2 * len(moved), timeout=60, what="the moved prompts rebuilt",
                           address=third.address)
        await until(lambda: sum(st.blocks for st in statuses()) == 2 * len(prompts), timeout=60,
                    what="the old holders forgetting the moved prompts")
        assert sum(st.forgotten_blocks for st in statuses()) == 2 * len(moved)
        assert all(st.gc_deleted_chunks == 0 for st in statuses())
        assert sum(s.chunk_count for s in statuses()[0].servers) == chunks
        async with Client(first_two, credentials=cluster.worker) as client:
            for tokens, payload in zip(prompts, payloads):
                match = await client.lookup(NS, tokens)
                assert match.matched == 2
                assert (await restore_all(client, match, layout))[0] == payload
            assert client.router.map.epoch == after.epoch
