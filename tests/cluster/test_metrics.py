"""The metaserver's Prometheus endpoint and `kvfs status --json`, against a real cluster."""

import json
import os
import urllib.request

import grpc
import pytest
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from kvfs import tls
from kvfs.cli.launcher import meta_status
from kvfs.cli.main import main as kvfs
from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2, meta_pb2_grpc

from helpers import credentials, layer_major, tokens_for, wait_until

NS = Namespace("acme", "deepseek-v2-lite")
SMALL = BlockLayout(layers=6, block_tokens=64, kv_dim=64, dtype="bfloat16")  # 48 KiB blocks, one chunk


def scrape(address: str) -> dict:
    """Every sample the endpoint serves: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def state_metrics(samples: dict) -> dict:
    """What the endpoint reports of the metaserver's state, named as in StatusReply."""
    fields = {"blocks": "kvfs_meta_blocks", "block_bytes": "kvfs_meta_block_bytes",
              "cache_bytes": "kvfs_meta_cache_bytes", "cache_capacity_bytes": "kvfs_meta_cache_capacity_bytes",
              "open_allocations": "kvfs_meta_open_allocations", "chains": "kvfs_meta_chains",
              "evicted_blocks": "kvfs_meta_evicted_blocks_total", "expired_blocks": "kvfs_meta_expired_blocks_total",
              "stranded_blocks": "kvfs_meta_stranded_blocks_total", "blocks_lost": "kvfs_meta_blocks_lost_total",
              "replicas_lost": "kvfs_meta_replicas_lost_total", "forgotten_blocks": "kvfs_meta_forgotten_blocks_total",
              "gc_deleted_chunks": "kvfs_meta_gc_deleted_chunks_total"}
    out = {field: samples[(metric, ())] for field, metric in fields.items()}
    out["live"] = samples[("kvfs_meta_servers", (("state", "live"),))]
    out["dead"] = samples[("kvfs_meta_servers", (("state", "dead"),))]
    out["used"] = {labels[0][1]: v for (name, labels), v in samples.items() if name == "kvfs_meta_server_used_bytes"}
    out["stalls"] = {labels[0][1]: v for (name, labels), v in samples.items()
                     if name == "kvfs_meta_loop_stalls_total"}
    out["long_steps"] = {labels: v for (name, labels), v in samples.items() if name == "kvfs_meta_long_steps_total"}
    out["long_busy_steps"] = {labels: v for (name, labels), v in samples.items()
                              if name == "kvfs_meta_long_busy_steps_total"}
    return out


def status_fields(st: meta_pb2.StatusReply) -> dict:
    out = {f: getattr(st, f) for f in ("blocks", "block_bytes", "cache_bytes", "cache_capacity_bytes",
                                       "open_allocations", "chains", "evicted_blocks", "expired_blocks",
                                       "stranded_blocks", "blocks_lost", "replicas_lost", "forgotten_blocks",
                                       "gc_deleted_chunks")}
    out["live"] = sum(s.live for s in st.servers)
    out["dead"] = sum(not s.live for s in st.servers)
    out["used"] = {s.id: s.used_bytes for s in st.servers}
    out["stalls"] = {repr(s.over_s): s.count for s in st.loop_stalls}
    out["long_steps"] = {(("kind", s.kind), ("over_seconds", repr(bound))): n for s in st.steps
                         for bound, n in zip(s.over_s, s.over_count)}
    out["long_busy_steps"] = {(("kind", s.kind), ("over_seconds", repr(bound))): n for s in st.steps
                              for bound, n in zip(s.over_s, s.over_cpu_count)}
    return out


async def test_metaserver_metrics_count_lookups_calls_and_report_its_state(local_cluster):
    cluster = local_cluster(chunkservers=2)
    address = cluster.meta.metrics_address
    assert address.startswith("127.0.0.1:")
    before = scrape(address)
    tokens = tokens_for(8, seed=11)
    payloads = [os.urandom(SMALL.payload_bytes) for _ in range(4)]
    async with Client(cluster.meta_address) as client:
        assert (await client.write(NS, tokens[: 4 * 64], layer_major(SMALL, payloads), SMALL)).committed == 4
        assert (await client.lookup(NS, tokens[: 4 * 64])).matched == 4  # all hit
        assert (await client.lookup(NS, tokens)).matched == 4  # 8 asked, the first 4 cached
        assert (await client.lookup(NS, tokens_for(3, seed=12))).matched == 0  # a miss
    with tls.channel(cluster.meta_address, credentials()) as channel:
        with pytest.raises(grpc.RpcError) as err:  # a bad key: an error, timed and counted by its code
            meta_pb2_grpc.MetaServiceStub(channel).MatchPrefix(meta_pb2.MatchPrefixRequest(
                namespace=meta_pb2.Namespace(tenant="acme", model="m"), keys=[b"short"]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(address)

    assert moved(before, after, "kvfs_meta_lookups_total") == 3  # answered ones
    assert moved(before, after, "kvfs_meta_lookup_blocks_requested_total") == 4 + 8 + 3
    assert moved(before, after, "kvfs_meta_lookup_blocks_matched_total") == 4 + 4 + 0
    assert moved(before, after, "kvfs_meta_rpc_seconds_count", method="MatchPrefix") == 4
    assert moved(before, after, "kvfs_meta_rpc_seconds_bucket", method="MatchPrefix", le="+Inf") == 4
    assert moved(before, after, "kvfs_meta_rpc_seconds_sum", method="MatchPrefix") > 0
    assert moved(before, after, "kvfs_meta_rpc_errors_total", method="MatchPrefix", code="INVALID_ARGUMENT") == 1
    assert moved(before, after, "kvfs_meta_rpc_seconds_count", method="AllocateBlocks") == 1
    assert moved(before, after, "kvfs_meta_rpc_seconds_count", method="CommitBlocks") == 1
    assert not any(name == "kvfs_meta_rpc_errors_total" and dict(labels)["method"] != "MatchPrefix"
                   for name, labels in after)
    assert after[("process_resident_memory_bytes", ())] > 0
    # the write's steps: its allocation's and its commit's, each counted with the time it held the loop
    # and the loop thread's CPU time in it
    for kind in ("allocate", "commit"):
        assert moved(before, after, "kvfs_meta_steps_total", kind=kind) >= 1
        assert moved(before, after, "kvfs_meta_steps_seconds_total", kind=kind) > 0
        assert moved(before, after, "kvfs_meta_steps_cpu_seconds_total", kind=kind) > 0

    def same_as_status():  # the state metrics come from a snapshot at most a second old
        status = meta_status(cluster.meta_address, credentials=cluster.admin)
        return status if state_metrics(scrape(address)) == status_fields(status) else None

    status = wait_until(same_as_status, 15, "the state metrics to equal Status")
    assert (status.blocks, status.block_bytes) == (4, 4 * SMALL.payload_bytes)
    assert status_fields(status)["live"] == 2


def test_status_json_is_the_status_reply(local_cluster, capsys):
    cluster = local_cluster(chunkservers=2, metrics=False)
    assert cluster.meta.metrics_address == ""  # off unless asked for
    env = os.environ
    assert kvfs(["status", "--json", "--meta", cluster.meta_address, "--tls-ca", env["KVFS_CLIENT_TLS_CA"],
                 "--tls-cert", env["KVFS_CLIENT_TLS_CERT"], "--tls-key", env["KVFS_CLIENT_TLS_KEY"]]) == 0
    printed = json.loads(capsys.readouterr().out)
    reply = json_format.ParseDict(printed, meta_pb2.StatusReply())
    status = meta_status(cluster.meta_address, credentials=cluster.admin)
    assert (reply.blocks, reply.replicas, reply.chains) == (status.blocks, status.replicas, status.chains)
    assert (reply.blocks, reply.replicas) == (0, 2)
    assert [(s.id, s.address, s.live, s.capacity_bytes) for s in reply.servers] == \
        [(s.id, s.address, s.live, s.capacity_bytes) for s in status.servers]
    assert printed["blocks"] == "0" and "cache_capacity_bytes" in printed  # every field, by its proto name
