"""The metaserver's gRPC face: one servicer over MetaState and Lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging

import grpc
from prometheus_client import CollectorRegistry

from kvfs import tls
from kvfs.auth import check_server_id, check_tenant, tenants_visible
from kvfs.errors import InvalidArgument, PermissionDenied, Unavailable
from kvfs.grants import parse_owner
from kvfs.keys import KEY_BYTES, Namespace
from kvfs.proto import meta_pb2, meta_pb2_grpc
from kvfs.rpc import handles_errors
from kvfs.serving import STALL_BOUNDS, LoopStats
from kvfs.shards import hash_slot

from .lifecycle import Lifecycle
from .metrics import RpcMetrics, timed
from .readsfirst import STEP_BOUNDS
from .repair import Repairer
from .sharded import Shards
from .state import MetaState

log = logging.getLogger(__name__)

# After an eviction, how long a writer's call waits for the deletes to reach the
# chunkservers: its chunk writes should find the space free there, not only in
# metadata. Bounded, so a slow server cannot hold up writes.
DELETE_WAIT = 5.0
MAX_USAGE_NAMES = 1000  # tenants one Usage call may name
MAX_TENANT_NAME = 256


def namespace_digest(msg: meta_pb2.Namespace, context) -> bytes:
    """The namespace's digest, once the caller's certificate allows its tenant."""
    if not msg.tenant or not msg.model:
        raise InvalidArgument("namespace needs a tenant and a model")
    check_tenant(context, msg.tenant)
    return Namespace(msg.tenant, msg.model, msg.cache_format).digest


SERVICE = "kvfs.meta.MetaService"
RAW_REPLIES = {"MatchPrefix"}  # their handlers return the reply already serialized


KEY_FIELD_BYTES = 18  # a 16-byte key in a repeated bytes field: tag, length, key


def request_limits(cfg) -> dict[str, int]:
    """The most bytes a real request of each method needs, where that is far below
    max_request_bytes (the bound gRPC applies to every request): a request's keys as
    max_keys allows and room for the rest. A request just under the gRPC bound
    would otherwise be parsed whole (3.7M keys: 67 MB read, 271 MiB parsed)."""
    keys = cfg.max_keys * KEY_FIELD_BYTES + 64 * 1024
    return {"MatchPrefix": keys, "AllocateBlocks": keys, "ShardMap": 1024}  # ShardMap's request is empty


@dataclasses.dataclass(frozen=True)
class Oversized:
    """What the deserializer hands a method instead of a request past its limit."""

    method: str
    size: int
    limit: int


def _bounded(parse, method: str, limit: int):
    def deserialize(raw: bytes):
        return Oversized(method, len(raw), limit) if len(raw) > limit else parse(raw)

    return deserialize


def _refusing_oversized(handler):
    @functools.wraps(handler)
    async def call(request, context):
        if isinstance(request, Oversized):
            log.warning("refused a %s of %d bytes from %s: at most %d", request.method, request.size,
                        context.peer(), request.limit)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"a {request.method} request of {request.size} bytes is larger than the "
                                f"{request.limit} bytes one of max_keys keys needs; unread")
        return await handler(request, context)

    return call


def add_to_server(servicer: MetaServicer, server) -> None:
    """What the generated add_MetaServiceServicer_to_server does, except that the
    methods in RAW_REPLIES send the bytes their handler returns as they are, and the
    methods in request_limits() refuse requests past their limit unparsed."""
    handlers = {}
    limits = request_limits(servicer.state.cfg)
    for method in meta_pb2.DESCRIPTOR.services_by_name["MetaService"].methods:
        request = getattr(meta_pb2, method.input_type.name)
        reply = getattr(meta_pb2, method.output_type.name)
        handler, parse = getattr(servicer, method.name), request.FromString
        if method.name in limits:
            handler, parse = _refusing_oversized(handler), _bounded(parse, method.name, limits[method.name])
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            handler, request_deserializer=parse,
            response_serializer=bytes if method.name in RAW_REPLIES else reply.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class MetaServicer(meta_pb2_grpc.MetaServiceServicer):
    def __init__(self, state: MetaState, lifecycle: Lifecycle, loop: LoopStats | None = None,
                 rpc_metrics: RpcMetrics | None = None, repairer: Repairer | None = None,
                 shards: Shards | None = None):
        self.state = state
        self.shards = shards or Shards()  # every hash slot, unless among several metaservers
        self.lifecycle = lifecycle
        self.repairer = repairer  # None where none runs (tests of the servicer alone)
        self.loop = loop or LoopStats()
        self.rpc_metrics = rpc_metrics or RpcMetrics(CollectorRegistry())  # a registry nobody serves

    @handles_errors
    async def Register(self, request, context):
        check_server_id(context, request.server_id)
        self.state.register(request)
        await self.state.durable()
        return meta_pb2.RegisterReply(heartbeat_interval_s=self.state.cfg.heartbeat_interval)

    @handles_errors
    async def Heartbeat(self, request, context):
        check_server_id(context, request.server_id)
        known = self.state.heartbeat(request)
        if known and request.lost_chunks:  # an unknown server re-registers and sends them again
            dropped = self.state.chunks_lost(request.server_id,
                                             [(c.chunk_id, parse_owner(c.owner)) for c in request.lost_chunks])
            self.lifecycle.queue_deletes(dropped)
            await self.state.durable()  # the server forgets its reports once acknowledged
        return meta_pb2.HeartbeatReply(register_again=not known, metaservers=self.shards.addresses())

    async def _free_evicted(self, evicted_before: int) -> None:
        if self.state.evicted_blocks != evicted_before:
            await asyncio.wait({self.lifecycle.delete_soon()}, timeout=DELETE_WAIT)

    @handles_errors
    @timed
    async def AllocateBlocks(self, request, context):
        evicted = self.state.evicted_blocks
        digest = namespace_digest(request.namespace, context)
        self.state.blocks.usage.note(digest, request.namespace.tenant)  # its blocks are billed to the tenant
        reply = await self.state.allocate_async(digest, request.keys, request.layout, request.parent,
                                                request.first_key)
        await self.state.durable()
        await self._free_evicted(evicted)
        return reply

    @handles_errors
    @timed
    async def CommitBlocks(self, request, context):
        evicted = self.state.evicted_blocks
        digest = namespace_digest(request.namespace, context)
        committed, already, _ = await self.state.commit_async(digest, request)  # its garbage is queued for deletion
        await self.state.durable()
        await self._free_evicted(evicted)
        return meta_pb2.CommitBlocksReply(committed=committed, already_present=already)

    @handles_errors
    @timed
    async def MatchPrefix(self, request, context):
        # a prompt is in the hash slot of its first key (kvfs/shards.py)
        first = request.joined_keys[:KEY_BYTES] if request.joined_keys else request.keys[0] if request.keys else b""
        slot = hash_slot(first) if len(first) == KEY_BYTES else None  # a malformed key is refused below
        if slot is not None:
            self.shards.check(slot)
        reply = self.state.match_bytes(namespace_digest(request.namespace, context), request.keys,
                                       request.namespace.tenant, request.joined_keys)
        if slot is not None:
            self.shards.check(slot)  # a lease that lapsed while this ran lets no answer out
        return reply

    @handles_errors
    async def ShardMap(self, request, context):
        """The shard map this metaserver holds: empty alone (it answers for every slot)."""
        if self.shards.alone:
            return meta_pb2.ShardMapReply()
        m = self.shards.map()
        if m is None:
            raise Unavailable(f"metaserver {self.shards.me.id} holds no shard map yet (starting, or cut off "
                              f"from etcd); ask another metaserver")
        return meta_pb2.ShardMapReply(map_json=m.to_json(), epoch=m.epoch)

    @handles_errors
    async def TenantKey(self, request, context):
        """The secret a tenant's block keys chain under: a seal of its name under the
        cluster key, so the same on every start and no table to keep. Whoever does not
        hold it (an admin listing owner records, anyone reading them off a disk) cannot
        compute a prompt's keys to test a guess against them."""
        if not request.tenant or len(request.tenant) > MAX_TENANT_NAME:
            raise InvalidArgument(f"TenantKey names one tenant of 1 to {MAX_TENANT_NAME} characters; got "
                                  f"{len(request.tenant)}")
        check_tenant(context, request.tenant)
        key = self.state.key
        return meta_pb2.TenantKeyReply(key=tls.seal(key, tls.TENANT_KEY, request.tenant) if key else b"")

    @handles_errors
    async def Usage(self, request, context):
        names = list(request.tenants)
        if len(names) > MAX_USAGE_NAMES or any(len(n) > MAX_TENANT_NAME for n in names):
            raise InvalidArgument(f"Usage names at most {MAX_USAGE_NAMES} tenants of at most {MAX_TENANT_NAME} "
                                  f"characters; got {len(names)}")
        visible = tenants_visible(context)
        hidden = sorted(n for n in names if not visible(n))
        if hidden:
            raise PermissionDenied(f"the caller may not see the usage of tenant {hidden[0]!r}")
        return meta_pb2.UsageReply(tenants=self.state.blocks.usage.report(visible, names), at=self.state.clock())

    @handles_errors
    async def Status(self, request, context):
        return self.status()

    def status(self) -> meta_pb2.StatusReply:
        """What Status answers; the metrics' snapshot too (metrics.py)."""
        st = self.state
        now = st.clock()
        reply = meta_pb2.StatusReply(blocks=st.blocks.blocks, block_bytes=st.blocks.payload_bytes,
                                     replicas=st.cfg.replicas, chains=len(st.chains),
                                     open_allocations=len(st.allocations.open), expired_blocks=st.expired_blocks,
                                     gc_deleted_chunks=st.gc_deleted_chunks, blocks_lost=st.blocks_lost,
                                     replicas_lost=st.replicas_lost, evicted_blocks=st.evicted_blocks,
                                     stranded_blocks=st.stranded_blocks, forgotten_blocks=st.blocks.forgotten,
                                     cache_bytes=st.cache_bytes,
                                     cache_capacity_bytes=st.capacity_bytes(),
                                     loop_longest_stall_s=self.loop.longest)
        if self.repairer is not None:
            r = self.repairer
            reply.repair_backlog, reply.repair_copied_chunks = r.under_replicated, r.copied_chunks
            reply.repair_copied_bytes, reply.repair_failed_copies = r.copied_bytes, r.failed_copies
        for bound, n, busy, waiting in zip(STALL_BOUNDS, self.loop.over, self.loop.over_busy, self.loop.over_waiting):
            reply.loop_stalls.add(over_s=bound, count=n, busy_count=busy, waiting_count=waiting)
        for kind, (n, seconds, over, cpu, over_cpu) in sorted(st.reads.steps.kinds.items()):
            reply.steps.add(kind=kind, count=n, seconds=seconds, over_s=STEP_BOUNDS, over_count=over,
                            cpu_seconds=cpu, over_cpu_count=over_cpu)
        for sid in sorted(st.servers):
            s = st.servers[sid]
            reply.servers.add(id=sid, address=s.record.address, failure_domain=s.record.failure_domain,
                              live=st.is_live(s), capacity_bytes=s.record.capacity_bytes, used_bytes=s.used_bytes,
                              allocated_bytes=s.allocated_bytes, chunk_count=s.chunk_count,
                              heartbeat_age_s=now - s.last_heartbeat, data_address=s.record.data_address)
        return reply

    @handles_errors
    async def Rebuild(self, request, context):
        return await self.lifecycle.rebuild()

    @handles_errors
    async def RunLifecycle(self, request, context):
        return await self.lifecycle.run_once()
