"""A metaserver cut off from etcd (issue 19): two metaservers, each in a network
namespace of its own on a bridge, etcd's three members on the host behind an
address of their own. Routes in one metaserver's namespace drop everything it sends
to etcd while workers still reach it: it must stop answering for its slots before
the other takes them (a sampler asks both every few milliseconds), then answer
UNAVAILABLE, and once the partition heals, send callers on to the new holder.
Needs root (`ip netns`)."""

import asyncio
import time

import grpc
import pytest

from kvfs.cli.hosts import Hosts, ip
from kvfs.cli.launcher import start_metaserver
from kvfs.keys import Namespace, block_keys
from kvfs.proto import meta_pb2, meta_pb2_grpc
from kvfs.shards import HASH_SLOTS, ShardMap, hash_slot

from etcd import EtcdCluster
from helpers import until

pytestmark = pytest.mark.root

NS = Namespace("t", "partition")
NS_MSG = meta_pb2.Namespace(tenant=NS.tenant, model=NS.model)
TTL = 3


@pytest.fixture
def hosts():
    with Hosts(2) as h:
        yield h


async def test_a_metaserver_cut_off_from_etcd_stops_answering_before_its_slots_move(hosts, tmp_path):
    etcd_at = f"{hosts.subnet}.2"  # etcd's own address on the bridge: routes can drop it alone
    ip("addr", "add", f"{etcd_at}/24", "dev", hosts.bridge)
    etcd = EtcdCluster(tmp_path / "etcd", 3, host=etcd_at)
    metas = []
    try:
        flags = ["--insecure", "--etcd", ",".join(etcd.endpoints()), "--cluster-name", "p", "--expect-metaservers",
                 "2", "--lease-ttl", str(TTL)]
        metas = await asyncio.gather(*(asyncio.to_thread(
            start_metaserver, tmp_path / n / "data", listen=f"{hosts.address(i)}:0", run_dir=tmp_path / n,
            netns=hosts.names[i], extra=[*flags, "--metaserver-id", n], timeout=60)
            for i, n in enumerate(("ms-a", "ms-b"))))
        channels = [grpc.aio.insecure_channel(m.address) for m in metas]
        a, b = (meta_pb2_grpc.MetaServiceStub(c) for c in channels)
        m = ShardMap.from_json((await b.ShardMap(meta_pb2.ShardMapRequest(), timeout=10)).map_json)
        keys = next(k for s in range(10_000) if m.owner_of(hash_slot((k := block_keys(NS, [s] * 8, 4))[0])).id == "ms-a")
        lookup = meta_pb2.MatchPrefixRequest(namespace=NS_MSG, keys=keys)
        answers: dict[str, list[tuple[float, float, str]]] = {"ms-a": [], "ms-b": []}  # (sent, answered, outcome)

        async def sample(name, stub):
            while True:
                t0 = time.monotonic()
                try:
                    await stub.MatchPrefix(lookup, timeout=2)
                    outcome = "ok"
                except grpc.aio.AioRpcError as err:
                    outcome = err.code().name
                answers[name].append((t0, time.monotonic(), outcome))
                await asyncio.sleep(0.003)

        samplers = [asyncio.create_task(sample("ms-a", a)), asyncio.create_task(sample("ms-b", b))]
        try:
            await until(lambda: len(answers["ms-a"]) > 20, timeout=10, what="samples before the cut")
            assert {o for _, _, o in answers["ms-a"]} == {"ok"}
            assert {o for _, _, o in answers["ms-b"]} == {"FAILED_PRECONDITION"}  # moved: ms-a holds it
            ip("-n", hosts.names[0], "route", "add", "blackhole", f"{etcd_at}/32")  # ms-a loses etcd, not workers
            cut = time.monotonic()
            await until(lambda: any(o == "ok" for _, _, o in answers["ms-b"]), timeout=60,
                        what="ms-b answering for ms-a's slot")
            last_a = max(t1 for _, t1, o in answers["ms-a"] if o == "ok")
            first_b = min(t0 for t0, _, o in answers["ms-b"] if o == "ok")
            print(f"\npartition: ms-a's last answer {last_a - cut:.2f} s after the cut, ms-b's first "
                  f"{first_b - cut:.2f} s after (lease TTL {TTL} s)")
            assert last_a < first_b  # never both: ms-a had stopped before ms-b began
            assert last_a - cut < TTL  # it stopped within its lease, counted from a renewal before the cut
            assert any(o == "UNAVAILABLE" and t0 > last_a for t0, _, o in answers["ms-a"])  # answers nothing now

            ip("-n", hosts.names[0], "route", "del", "blackhole", f"{etcd_at}/32")  # healed
            healed = len(answers["ms-a"])
            await until(lambda: any(o == "FAILED_PRECONDITION" for _, _, o in answers["ms-a"][healed:]), timeout=60,
                        what="ms-a rejoined, sending callers to ms-b")
            assert not any(o == "ok" for _, _, o in answers["ms-a"][healed:])  # the slots stay with ms-b
            rejoined = ShardMap.from_json((await a.ShardMap(meta_pb2.ShardMapRequest(), timeout=10)).map_json)
            assert rejoined.counts().get("ms-b") == HASH_SLOTS and rejoined.epoch > m.epoch
        finally:
            for t in samplers:
                t.cancel()
            await asyncio.gather(*samplers, return_exceptions=True)
            for c in channels:
                await c.close()
    finally:
        for s in metas:
            s.kill()
        etcd.stop()
