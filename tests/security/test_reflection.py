"""Server reflection against a real secure cluster, from raw stubs: a caller
without a certificate of the cluster's CA learns nothing (mutual TLS refuses it
before any call), any
caller with one (worker, admin, server) gets the published services and their
messages, and no more: no file outside the protos, and every method it then finds
still answers by its own rule."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvfs import tls
from kvfs.proto import meta_pb2, meta_pb2_grpc

from test_attacks import NS_A, refused, write_and_restore

SERVICES = {"meta": "kvfs.meta.MetaService", "chunk": "kvfs.chunk.ChunkService"}
ALWAYS = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


async def ask(channel, *requests: reflection_pb2.ServerReflectionRequest) -> list:
    stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter(requests), timeout=10)
    return [reply async for reply in stream]


LIST = reflection_pb2.ServerReflectionRequest(list_services="")


def targets(cluster) -> dict[str, str]:
    return {"meta": cluster.meta_address, "chunk": cluster.chunkservers[0].address}


async def test_reflection_is_refused_without_a_certificate_of_the_cluster_ca(cluster, who):
    for name, address in targets(cluster).items():
        channels = [grpc.aio.insecure_channel(address),
                    grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=who.worker_a.ca)),
                    tls.aio_channel(address, tls.Credentials(who.worker_a.ca, who.foreign.cert, who.foreign.key))]
        for channel in channels:
            async with channel:
                await refused(ask(channel, LIST), grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    await write_and_restore(cluster, who.worker_a, NS_A, seed=131)  # the legitimate path beside it


async def test_every_role_lists_the_services_and_reads_their_messages(cluster, who):
    for name, address in targets(cluster).items():
        for creds in (who.worker_a, who.admin, who.rogue_server):
            async with tls.aio_channel(address, creds) as channel:
                (listed,) = await ask(channel, LIST)
                assert {s.name for s in listed.list_services_response.service} == {SERVICES[name]} | ALWAYS
                (found,) = await ask(channel, reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol=SERVICES[name]))
                files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                         for raw in found.file_descriptor_response.file_descriptor_proto]
                service = SERVICES[name].rsplit(".", 1)[1]
                assert any(s.name == service for f in files for s in f.service), (name, [f.name for f in files])


async def test_reflection_serves_descriptors_only_and_the_methods_it_shows_keep_their_rules(cluster, who):
    async with tls.aio_channel(cluster.meta_address, who.worker_a) as channel:
        replies = await ask(channel, *(reflection_pb2.ServerReflectionRequest(file_by_filename=path)
                                       for path in ("/etc/passwd", "../../pyproject.toml", "kvfs-data")))
        assert [r.error_response.error_code for r in replies] == [grpc.StatusCode.NOT_FOUND.value[0]] * 3
        assert not any(r.HasField("file_descriptor_response") for r in replies)
        # what reflection showed the worker, it still may not call
        await refused(meta_pb2_grpc.MetaServiceStub(channel).RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=5),
                      grpc.StatusCode.PERMISSION_DENIED)
