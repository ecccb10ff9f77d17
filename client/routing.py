"""Which metaserver a client asks: the one there is, or among several the holder of
a prompt's hash slot (kvfs/shards.py: the slot of the prompt's first key).

The shard map comes from any metaserver (the ShardMap RPC) on the first call and is
kept; a metaserver answering "moved" (kvfs.errors.Moved) makes the client read the
map again, from the metaserver it named first, and ask once more. A map is taken
only if it parses whole and is not older than the one held. A cluster of one
metaserver answers with no map: every call goes to it, as before there were several.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvfs import tls
from kvfs.errors import KvfsError, Moved, Unavailable, from_rpc_error
from kvfs.proto import meta_pb2, meta_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS
from kvfs.shards import ShardMap, hash_slot

log = logging.getLogger(__name__)

MOVES = 2  # "moved" answers one call follows (each after reading the map again) before giving up


def seeds_of(metaserver: str) -> list[str]:
    """'host:7000' or 'a:7000,b:7000' -> the addresses, in order."""
    out = [a.strip() for a in metaserver.split(",") if a.strip()]
    if not out:
        raise ValueError(f"no metaserver address in {metaserver!r}")
    return out


class MetaRouter:
    def __init__(self, metaserver: str, credentials: tls.Credentials | None, timeout: float):
        self.seeds = seeds_of(metaserver)
        self.credentials, self.timeout = credentials, timeout
        self.map: ShardMap | None = None
        self.alone: bool | None = None  # None until a metaserver has said whether there are several
        self.refreshes = 0  # maps read, the first one included
        self._stubs: dict[str, meta_pb2_grpc.MetaServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._reading: asyncio.Lock | None = None

    def stub(self, address: str) -> meta_pb2_grpc.MetaServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = tls.aio_channel(address, self.credentials, CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[address] = meta_pb2_grpc.MetaServiceStub(channel)
        return stub

    def address_for(self, first_key: bytes | None) -> str:
        """The metaserver for a prompt starting with `first_key` (None: any will do)."""
        if first_key is None or self.map is None or len(first_key) < 2:
            return self.seeds[0]
        return self.map.owner_of(hash_slot(first_key)).address

    async def call(self, name: str, request, first_key: bytes | None = None):
        """`name` (a MetaService method) at the metaserver for `first_key`; follows
        "moved" answers, reading the map again before each."""
        if first_key is None:
            return await self._any(name, request)
        if self.alone is None:
            await self.refresh()
        for moves in range(MOVES + 1):
            address = self.address_for(first_key)
            try:
                return await getattr(self.stub(address), name)(request, timeout=self.timeout)
            except grpc.aio.AioRpcError as err:
                error = from_rpc_error(err, f"metaserver {address}")
            if moves == MOVES or not isinstance(error, (Moved, Unavailable)):
                raise error
            if isinstance(error, Moved):
                log.info("%s: %s; reading the shard map again", name, error.message)
                await self.refresh(error.address)
                continue
            # unreachable, or holding no lease: where there are several, the slot may have moved on
            if self.map is None:
                raise error
            try:
                await self.refresh(avoid=address)
            except KvfsError:
                raise error from None
            if self.address_for(first_key) == address:
                raise error
            log.info("%s: %s; the shard map now sends it to %s", name, error.message, self.address_for(first_key))
        raise AssertionError("unreachable")

    async def _any(self, name: str, request):
        """`name` at the first metaserver that answers: the seeds, then the map's owners
        (a call about no prompt, such as TenantKey, must not fail because one is down)."""
        known = [o.address for o in self.map.owners] if self.map is not None else []
        error: KvfsError | None = None
        for address in dict.fromkeys([*self.seeds, *known]):
            try:
                return await getattr(self.stub(address), name)(request, timeout=self.timeout)
            except grpc.aio.AioRpcError as err:
                error = from_rpc_error(err, f"metaserver {address}")
            if not isinstance(error, Unavailable):
                break
        raise error

    async def refresh(self, first: str = "", avoid: str = "") -> None:
        """Reads the shard map from `first`, else from the first metaserver that has
        one (the seeds, then the owners of the map held), `avoid` last of all."""
        if self._reading is None:
            self._reading = asyncio.Lock()
        async with self._reading:
            known = [o.address for o in self.map.owners] if self.map is not None else []
            tried, errors = set(), []
            order = [first, *self.seeds, *known]
            for address in [a for a in order if a != avoid] + [avoid]:
                if not address or address in tried:
                    continue
                tried.add(address)
                try:
                    reply = await self.stub(address).ShardMap(meta_pb2.ShardMapRequest(), timeout=self.timeout)
                except grpc.aio.AioRpcError as err:
                    if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # a metaserver from before there were several
                        self.alone = True
                        return
                    errors.append(from_rpc_error(err, f"metaserver {address}"))
                    continue
                self.refreshes += 1
                if not reply.map_json:
                    self.alone, self.map = True, None
                    return
                try:
                    m = ShardMap.from_json(reply.map_json)
                except ValueError as err:
                    errors.append(Unavailable(f"metaserver {address} sent a shard map that does not parse: {err}"))
                    continue
                if self.map is None or m.epoch >= self.map.epoch:
                    self.map = m
                self.alone = False
                return
            if errors:
                first_error: KvfsError = errors[0]
                raise type(first_error)(f"no metaserver gave a shard map: {first_error.message}")

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
