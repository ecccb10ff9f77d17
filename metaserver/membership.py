"""Chunkservers: who is in the cluster, who is live, and the chain table.

Small and in memory (one entry per server, not per block). Each server gets a
number for good at its first registration; block rows name servers by number,
so a lookup's reply can carry a block's stored location as it is.

A server is live while it heartbeats within `heartbeat_timeout` and has been
reconciled: one that went silent and checks in again first has its inventory
checked against metadata (repair.py), since copies it holds may have been
re-created elsewhere meanwhile.

Silence is counted only while this process was awake to hear heartbeats: the
stalls the event-loop watcher sees (the loop held by a slow pass, the process
stopped or its VM paused) do not count, so a metaserver that froze for longer
than the timeout does not wake up to find every server dead while their
heartbeats wait in its sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfs.errors import InvalidArgument
from kvfs.proto import meta_pb2

from . import records
from .chains import Chain, Member, build_chains
from .config import MetaserverConfig
from .db import MetaDB

if TYPE_CHECKING:
    from kvfs.serving import LoopStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerState:
    record: meta_pb2.ServerRecord
    last_heartbeat: float
    used_bytes: int = 0
    allocated_bytes: int = 0
    chunk_count: int = 0
    pending_bytes: int = 0  # allocated to writers, not yet seen in heartbeats
    # queued for deletion, or deleted since the last heartbeat: placement counts it as
    # free, or writes right after an eviction would be refused until heartbeats catch up
    freeing_bytes: int = 0
    # False from when a server that had gone silent checks in again until its
    # inventory was reconciled against metadata (stale copies deleted); not live meanwhile
    reconciled: bool = True
    stalled_at: float = 0.0  # Membership.stalled() at the last heartbeat

    @property
    def number(self) -> int:
        return self.record.number


class Membership:
    def __init__(self, cfg: MetaserverConfig, db: MetaDB, clock: Callable[[], float]):
        self.cfg = cfg
        self.db = db
        self.clock = clock
        self.servers: dict[str, ServerState] = {}
        self.by_number: dict[int, ServerState] = {}
        self.chains: list[Chain] = []
        self.live_numbers: frozenset[int] = frozenset()
        self._entries: dict[int, bytes] = {}  # number -> its MatchPrefixReply.servers entry
        self.loop: LoopStats | None = None  # the event-loop watcher's counts, where one runs (watch())
        # this metaserver's share of the servers' capacity: of the hash slots, where there are several
        # metaservers placing on the same servers (sharded.Shards.share); all of it alone
        self.share: Callable[[], float] = lambda: 1.0
        now = clock()
        for _, raw in db.scan(records.SERVER):
            rec = meta_pb2.ServerRecord.FromString(raw)
            # after a restart every known server gets one heartbeat timeout to check in
            self._add(ServerState(rec, now, stalled_at=self.stalled()))
        self._rebuild_chains()

    def watch(self, loop: LoopStats) -> None:
        """Counts silence on the clock less the stalls this loop watcher sees."""
        self.loop = loop

    def stalled(self) -> float:
        """Seconds this process has been stalled so far (0 with no watcher)."""
        return self.loop.stalled_now() if self.loop is not None else 0.0

    def silence(self, state: ServerState) -> float:
        """Seconds since the server's last heartbeat that this process was awake for."""
        return self.clock() - state.last_heartbeat - (self.stalled() - state.stalled_at)

    def _heard(self, state: ServerState) -> None:
        state.last_heartbeat, state.stalled_at = self.clock(), self.stalled()

    def _add(self, state: ServerState) -> None:
        self.servers[state.record.id] = state
        self.by_number[state.number] = state
        self._entries[state.number] = records.server_entry(state.record)

    def register(self, req: meta_pb2.RegisterRequest) -> None:
        if not req.server_id or not req.address:
            raise InvalidArgument("Register needs a server_id and an address")
        known = self.servers.get(req.server_id)
        number = known.number if known is not None else max(self.by_number, default=-1) + 1
        if number > 0xFFFF:
            raise InvalidArgument("this metaserver has numbered 65536 servers; no room for another")
        rec = meta_pb2.ServerRecord(id=req.server_id, address=req.address,
                                    failure_domain=req.failure_domain or "default",
                                    capacity_bytes=req.capacity_bytes, data_address=req.data_address, number=number)
        if known is None or known.record != rec:
            self.db.put(records.SERVER + req.server_id.encode(), rec.SerializeToString())
            log.info("chunkserver %s (#%d) registered at %s (domain %s, capacity %d)", rec.id, number, rec.address,
                     rec.failure_domain, rec.capacity_bytes)
        if known is None:
            known = ServerState(rec, self.clock())
        elif not self.is_live(known) and known.reconciled:
            known.reconciled = False  # a restart after silence: same as a heartbeat after silence
            log.info("chunkserver %s is back; it serves again once its chunks are reconciled", req.server_id)
        known.record = rec
        self._heard(known)
        self._add(known)
        self._rebuild_chains()

    def heartbeat(self, req: meta_pb2.HeartbeatRequest, freeing: int) -> bool:
        state = self.servers.get(req.server_id)
        if state is None:
            return False
        was_live = self.is_live(state)
        self._heard(state)
        state.used_bytes, state.allocated_bytes = req.used_bytes, req.allocated_bytes
        state.chunk_count = req.chunk_count
        state.record.capacity_bytes = req.capacity_bytes or state.record.capacity_bytes
        state.pending_bytes = 0  # what was pending is in used_bytes now, or was abandoned
        state.freeing_bytes = freeing  # the rest is in used_bytes
        if not was_live and state.reconciled:
            # its disk may hold copies re-replicated elsewhere or of blocks dropped meanwhile
            state.reconciled = False
            log.info("chunkserver %s is back; it serves again once its chunks are reconciled", req.server_id)
        return True

    def is_live(self, state: ServerState) -> bool:
        return state.reconciled and self.silence(state) <= self.cfg.heartbeat_timeout

    def _live_now(self) -> frozenset[int]:
        return frozenset(s.number for s in self.servers.values() if self.is_live(s))

    def live_servers(self) -> dict[str, ServerState]:
        return {sid: s for sid, s in self.servers.items() if self.is_live(s)}

    def dead_numbers(self) -> list[int]:
        """Servers not live: silent past the timeout, or back and not reconciled yet."""
        return sorted(n for n in self.by_number if n not in self.live_numbers)

    def to_reconcile(self) -> list[str]:
        """Servers back from silence, heartbeating, waiting for reconciliation."""
        return [sid for sid, s in self.servers.items()
                if not s.reconciled and self.silence(s) <= self.cfg.heartbeat_timeout]

    def reconciled(self, server_id: str) -> None:
        self.servers[server_id].reconciled = True
        log.info("chunkserver %s reconciled; live again", server_id)
        self._rebuild_chains()

    @staticmethod
    def free_bytes(state: ServerState) -> int:
        """Capacity less what the server reported used and what was placed on it since,
        plus what is being deleted from it."""
        return max(0, state.record.capacity_bytes - state.used_bytes - state.pending_bytes + state.freeing_bytes)

    def refresh_liveness(self) -> None:
        """Drops servers that went silent from the chain table (and lookups' replicas)."""
        if self._live_now() != self.live_numbers:
            self._rebuild_chains()

    def _rebuild_chains(self) -> None:
        live = self.live_servers()
        self.live_numbers = frozenset(s.number for s in live.values())
        chains = build_chains([Member(s.record.id, s.record.failure_domain) for s in live.values()],
                              self.cfg.replicas)
        if chains != self.chains:
            self.chains = chains
            log.info("chain table: %d chains of %d over %d live servers", len(chains), self.cfg.replicas, len(live))

    def numbers(self, server_ids) -> list[int]:
        return [self.servers[sid].number for sid in server_ids]

    def ids(self, numbers) -> list[str]:
        return [self.by_number[n].record.id for n in numbers if n in self.by_number]

    def server_table(self, referenced: set[int]) -> bytes:
        """MatchPrefixReply.servers indexed by server number: empty where no block refers,
        and where the server is not live (readers skip replicas there)."""
        if not referenced:
            return b""
        live = self.live_numbers
        return b"".join(self._entries[n] if n in referenced and n in live else records.server_entry(None)
                        for n in range(max(referenced) + 1))

    def capacity_bytes(self) -> int:
        """What blocks may take of the live servers, per replica."""
        total = sum(s.record.capacity_bytes for s in self.live_servers().values()) // self.cfg.replicas
        return total if (share := self.share()) == 1.0 else int(total * share)
