"""--insecure: the servers start and serve plaintext, and say loudly in their logs
that nothing is authenticated; a client with a certificate cannot talk to them."""

from __future__ import annotations

import os

import grpc
import pytest

from kvfs import tls
from kvfs.cli.launcher import LocalCluster
from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2, meta_pb2_grpc

from helpers import credentials, restore_all, tokens_for

LAYOUT = BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")


async def test_insecure_cluster_serves_plaintext_and_warns_at_start_up(tmp_path):
    cluster = LocalCluster(tmp_path / "lab", chunkservers=2, replicas=2, capacity="1GiB", insecure=True)
    with cluster:
        assert cluster.ca is None and not (tmp_path / "lab" / "tls").exists()
        tokens = tokens_for(2, seed=7)
        payload = os.urandom(LAYOUT.buffer_bytes(len(tokens)))
        ns = Namespace("anyone", "m")
        async with Client(cluster.meta_address, insecure=True) as client:
            await client.write(ns, tokens, payload, LAYOUT)
            match = await client.lookup(ns, tokens)
            out, _, _ = await restore_all(client, match, LAYOUT)
            assert bytes(out) == payload
        async with tls.aio_channel(cluster.meta_address, credentials()) as channel:  # TLS to a plaintext port
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await meta_pb2_grpc.MetaServiceStub(channel).Status(meta_pb2.StatusRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        logs = {p.name: p.log_path.read_text() for p in cluster.processes()}
    for name, log in logs.items():
        warning = next((line for line in log.splitlines() if "runs with --insecure" in line), "")
        assert " WARNING " in warning and "NO caller authentication" in warning, (name, log[-2000:])
