"""kvfs as vLLM's KV store: a KV connector for vLLM 0.32 and MLA models.

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvfsConnector", kv_connector_module_path="kvfs.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"meta": "10.0.0.1:7000", "tenant": "acme"}))

vLLM runs the connector twice, usually in two processes that share nothing but
the metadata built each step. The scheduler side asks the metaserver once per
new request how much of its prompt is cached (MatchPrefix) and tells the worker
which vLLM blocks to fill and which computed blocks to save. The worker side
looks the prefix up again, restores it layer by layer into a staging buffer
`[layer][tokens][576]` and copies each layer into the paged cache as soon as it
lands; it snapshots newly computed full kvfs blocks layer by layer and writes
them back in the background. A failed or short restore is reported through
`get_block_ids_with_load_errors`, so vLLM recomputes those blocks (with
`kv_load_failure_policy="recompute"`). Both roles report what they did through
vLLM's KV-connector stats (integrations/vllm_metrics.py). See docs/vllm.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole)

from kvfs.client import BlockLayout, BufferPool, Client, Namespace, SyncClient
from kvfs.integrations.vllm_metrics import COUNTERS, TIMINGS, KvfsPromMetrics, KvfsStats
from kvfs.tls import Credentials

log = logging.getLogger(__name__)

KV_DIM = 576  # MLA: kv_lora_rank 512 + qk_rope_head_dim 64 values per token per layer


@dataclass
class LoadSpec:
    """Fill `block_ids` (the request's vLLM blocks `first`, `first + 1`, ...)
    from the first `kvfs_blocks` kvfs blocks of `token_ids`."""

    req_id: str
    token_ids: list[int]
    kvfs_blocks: int
    first: int
    block_ids: list[int]
    salt: str | None = None  # the request's cache_salt


@dataclass
class SaveSpec:
    """Write kvfs blocks `first_block` .. of `token_ids` (whole kvfs blocks), held
    in the vLLM blocks `block_ids` (all of them, from token 0)."""

    req_id: str
    token_ids: list[int]
    first_block: int
    block_ids: list[int]
    salt: str | None = None  # the request's cache_salt


@dataclass
class KvfsMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """Scheduler side: a running request's prompt, blocks and how many of its
    kvfs blocks are known to be stored."""

    token_ids: list[int]
    block_ids: list[int]
    saved: int
    salt: str | None


@dataclass(slots=True)
class _Load:
    """Worker side: one request's restore in this step."""

    spec: LoadSpec
    staging: torch.Tensor | None = None
    restore: Any = None
    usable: int = 0  # vLLM blocks of the request (from block 0) the restore covers
    started: float = 0.0
    seconds: float = 0.0  # from start_load_kv until the last layer was in the paged cache
    waited: float = 0.0  # of it, what the forward pass spent blocked on this restore's layers


class _Loop:
    """An asyncio loop on its own thread: the worker's kvfs Client lives there,
    so restores and write-backs progress while the forward pass runs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvfs-vllm", daemon=True)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else 0


class KvfsConnector(KVConnectorBase_V1):
    """kv_connector_extra_config: `meta` (metaserver address, required),
    `tenant` ("default"), `ttl_class` ("chat"), `model` (namespace model name;
    default vLLM's model), `block_tokens` (kvfs block size, 64), and the worker
    certificate: `tls_ca`, `tls_cert`, `tls_key` (PEM files; default: the SDK's
    KVFS_CLIENT_TLS_* variables) or `insecure` (a cluster started with --insecure);
    `staging_bytes` (the worker's restore buffers, 1 GiB) and `warm_bytes` (of them,
    touched at start: default one longest prompt's; 0: none)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("meta"):
            raise ValueError('KvfsConnector needs the metaserver address: kv_connector_extra_config={"meta": '
                             '"host:port", ...}')
        self.meta_address = str(extra["meta"])
        self.insecure = str(extra.get("insecure", "")).lower() in ("1", "true", "yes")
        self.credentials = (Credentials.from_files(extra.get("tls_ca"), extra.get("tls_cert"), extra.get("tls_key"))
                            if extra.get("tls_cert") else None)
        self.ttl_class = str(extra.get("ttl_class", "chat"))
        self.block_tokens = int(extra.get("block_tokens", 64))
        self.vblock = vllm_config.cache_config.block_size
        if self.block_tokens % self.vblock:
            raise ValueError(f"kvfs stores {self.block_tokens}-token blocks, not a multiple of vLLM's block size "
                             f"{self.vblock}: run vLLM with a block_size that divides {self.block_tokens} "
                             f"(e.g. block_size=16 or 64; attention_backend='CPU_MLA' uses 16)")
        self.per = self.block_tokens // self.vblock  # vLLM blocks per kvfs block
        if kv_cache_config is None:
            raise ValueError("KvfsConnector needs vLLM >= 0.32 (the connector is built with a kv_cache_config)")
        groups = kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec if groups else None
        if len(groups) != 1 or getattr(spec, "head_size", None) != KV_DIM:
            raise ValueError(f"KvfsConnector stores MLA caches ({KV_DIM} values per token, one KV-cache "
                             f"group); this model has {len(groups)} group(s) of {spec}")
        self.layer_names = sorted(groups[0].layer_names, key=_layer_index)
        self.dtype = spec.dtype  # the cache's dtype (an fp8 cache stores fp8)
        dtype_name = str(self.dtype).removeprefix("torch.")
        self.layout = BlockLayout(len(self.layer_names), self.block_tokens, KV_DIM, dtype_name)
        cache_format = {"bfloat16": "mla-bf16", "float16": "mla-fp16"}.get(dtype_name, f"mla-{dtype_name}")
        self.namespace = Namespace(str(extra.get("tenant", "default")),
                                   str(extra.get("model", vllm_config.model_config.model)), cache_format)
        # scheduler side
        self._sync: SyncClient | None = None
        self._hits: dict[str, tuple[int, int]] = {}  # req id -> (kvfs blocks matched, local tokens)
        self._pending_loads: dict[str, LoadSpec] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._salts: dict[str, str | None] = {}  # req id -> its cache_salt
        # worker side
        self._loop: _Loop | None = None
        self._client: Client | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._loads: list[_Load] = []
        self._begun: concurrent.futures.Future | None = None
        self._saves: list[tuple[SaveSpec, torch.Tensor]] | None = None
        self._writes: set[concurrent.futures.Future] = set()
        self._writer = True
        # totals since start (tests and benchmarks read the worker's through collective_rpc), and this
        # interval's for vLLM; write-backs record from the kvfs thread, vLLM takes them from its own
        self.stats: dict[str, Any] = {key: 0 for key in COUNTERS} | {key: 0.0 for key in TIMINGS}
        self.stats["loaded_block_ids"] = []
        self._interval = KvfsStats()
        self._stats_lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._sync = SyncClient(self.meta_address, block_tokens=self.block_tokens, credentials=self.credentials,
                                    insecure=self.insecure)
            # the first request's lookup then finds the channel and the tenant's key ready
            self._warming = self._sync.warm_up([self.namespace.tenant], reads=False, wait=False)
            self._warming.add_done_callback(self._warmed)
        else:
            self._loop = _Loop()
            # staging buffers: pinned with CUDA; without, in a shared arena chunkservers on this host write into
            self._pool = BufferPool(max_bytes=int(extra.get("staging_bytes", 1 << 30)),
                                    arena_bytes=int(extra.get("staging_bytes", 1 << 30)))
            self._client = self._loop.submit(self._make_client()).result()
            # while vLLM starts: the first hit then finds its connections open (after the arena exists)
            # and its staging pages touched (one longest prompt's worth, `warm_bytes` to change)
            longest = self.layout.buffer_bytes(vllm_config.model_config.max_model_len)
            self._warming = self._loop.submit(self._warm_up(int(extra.get("warm_bytes", longest))))
            self._warming.add_done_callback(self._warmed)
            try:  # the MLA latent is replicated over TP ranks: only rank 0 writes it back
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                self._writer = get_tensor_model_parallel_rank() == 0
            except Exception:
                self._writer = True

    async def _make_client(self) -> Client:
        return Client(self.meta_address, block_tokens=self.block_tokens, credentials=self.credentials,
                      insecure=self.insecure)

    async def _warm_up(self, staging_bytes: int) -> int:
        await asyncio.to_thread(self._pool.prefault, staging_bytes)
        return await self._client.warm_up([self.namespace.tenant])

    def _warmed(self, fut: concurrent.futures.Future) -> None:
        err = fut.exception()
        if err is not None:  # lookups and restores open what they need, or fail to the recompute path
            log.warning("kvfs: warming connections to %s failed (the first request opens them): %s",
                        self.meta_address, err)
        elif self._client is not None:
            log.info("kvfs: opened data connections to %d chunkservers ahead of the first restore", fut.result())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never an error

    # ---- stats (both roles) ----------------------------------------------

    def _record(self, **values: float) -> None:
        with self._stats_lock:
            self._interval.record(**values)
            for key, value in values.items():
                self.stats[key] += value

    def get_kv_connector_stats(self) -> KvfsStats | None:
        """What this side did since vLLM last asked (it asks every step)."""
        with self._stats_lock:
            interval, self._interval = self._interval, KvfsStats()
        return None if interval.is_empty() else interval

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvfsStats:
        return KvfsStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvfsPromMetrics:
        return KvfsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side --------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = request.prompt_token_ids or []
        rid = request.request_id
        # one MatchPrefix per request: vLLM may ask again (e.g. while the batch is full)
        # vLLM's per-request salt isolates users within one tenant: kvfs chains it into the keys
        self._salts[rid] = getattr(request, "cache_salt", None)
        matched = self._hits[rid][0] if rid in self._hits else self._lookup(rid, tokens, self._salts[rid])
        self._hits[rid] = (matched, num_computed_tokens)
        limit = (len(tokens) - 1) // self.vblock * self.vblock  # leave a token to compute
        return max(0, min(matched * self.block_tokens, limit) - num_computed_tokens), False

    def _lookup(self, req_id: str, tokens: list[int], salt: str | None) -> int:
        if len(tokens) <= self.block_tokens:  # nothing loadable: a token must be left to compute
            return 0
        t0 = time.perf_counter()
        try:
            matched = self._sync.lookup(self.namespace, tokens, salt=salt).matched
        except Exception as err:
            self._record(lookup_failures=1)
            log.warning("kvfs: lookup failed, computing request %s in full: %s", req_id, err)
            return 0
        seconds = time.perf_counter() - t0
        self._record(lookup_seconds=seconds, lookup_blocks=len(tokens) // self.block_tokens, matched_blocks=matched)
        log.debug("kvfs: lookup of %d tokens: %d blocks in %.2f ms", len(tokens), matched, seconds * 1e3)
        return matched

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        matched, local = self._hits[request.request_id]
        end = local + num_external_tokens
        kvfs_blocks = -(-end // self.block_tokens)
        ids = blocks.get_block_ids()[0]
        self._pending_loads[request.request_id] = LoadSpec(
            request.request_id, list(request.prompt_token_ids[: kvfs_blocks * self.block_tokens]), kvfs_blocks,
            local // self.vblock, list(ids[local // self.vblock : end // self.vblock]),
            self._salts.get(request.request_id))

    def build_connector_meta(self, scheduler_output) -> KvfsMetadata:
        meta = KvfsMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for r in scheduler_output.scheduled_new_reqs:
            matched = self._hits.get(r.req_id, (0, 0))[0]
            self._tracked[r.req_id] = _Tracked(list(r.prompt_token_ids or []), list(r.block_ids[0]), matched,
                                               self._salts.get(r.req_id))
            self._queue_save(r.req_id, r.num_computed_tokens + num_scheduled[r.req_id], meta.saves)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            new = cached.new_block_ids[i]
            if new is not None:
                t.block_ids = list(new[0]) if req_id in cached.resumed_req_ids else t.block_ids + list(new[0])
            self._queue_save(req_id, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0), meta.saves)
        return meta

    def _queue_save(self, req_id: str, computed: int, saves: list[SaveSpec]) -> None:
        """Saves the prompt's kvfs blocks that are fully computed after this step."""
        t = self._tracked[req_id]
        full = min(len(t.token_ids), computed) // self.block_tokens
        if full > t.saved:
            saves.append(SaveSpec(req_id, t.token_ids[: full * self.block_tokens], t.saved,
                                  t.block_ids[: full * self.per], t.salt))
            t.saved = full

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for d in (self._hits, self._pending_loads, self._tracked, self._salts):
            d.pop(request.request_id, None)
        return False, None  # saves are snapshots: the blocks can go at once

    # ---- worker side -----------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, t in kv_caches.items():  # [num_blocks, 1, block_size, 576] on CPU: drop the head dim
            self.kv_caches[name] = t.view(t.shape[0], self.vblock, t.shape[-1])
        if sorted(self.kv_caches, key=_layer_index) != self.layer_names:
            raise ValueError(f"KV caches {sorted(self.kv_caches)} do not match the layers {self.layer_names}")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvfsMetadata) or not meta.loads:
            return
        self._loads = [_Load(spec) for spec in meta.loads]
        self._begun = self._loop.submit(self._begin(self._loads))

    async def _begin(self, loads: list[_Load]) -> None:
        """The worker's own lookup (it shares nothing with the scheduler), then the restores."""
        for ld in loads:
            ld.started = time.perf_counter()
            try:
                match = await self._client.lookup(self.namespace, ld.spec.token_ids, salt=ld.spec.salt)
                blocks = min(match.matched, ld.spec.kvfs_blocks)
                if blocks < ld.spec.kvfs_blocks:
                    log.warning("kvfs: request %s: %d of %d promised blocks are still cached; the rest is "
                                "recomputed", ld.spec.req_id, blocks, ld.spec.kvfs_blocks)
                if blocks == 0:
                    continue
                if match.layout != self.layout:
                    raise ValueError(f"stored layout {match.layout} is not this model's {self.layout}")
                nbytes = self.layout.buffer_bytes(blocks * self.block_tokens)
                ld.staging = self._pool.get(nbytes).view(self.dtype).view(self.layout.layers, -1, KV_DIM)
                ld.restore = self._client.read(match, ld.staging, blocks=blocks)
                ld.usable = blocks * self.per
            except Exception as err:
                log.warning("kvfs: restore of request %s failed to start, recomputing: %s", ld.spec.req_id, err)
                ld.usable, ld.restore = 0, None

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads:
            return
        if self._begun is not None:
            self._begun.result()
            self._begun = None
        layer = self.layer_names.index(layer_name)
        kv = self.kv_caches[layer_name]
        for ld in self._loads:
            if ld.restore is None:
                continue
            try:
                w0 = time.perf_counter()
                self._loop.submit(ld.restore.layer_ready(layer)).result()
                ld.waited += time.perf_counter() - w0
            except Exception as err:
                log.warning("kvfs: restore of request %s failed at layer %d, recomputing: %s",
                            ld.spec.req_id, layer, err)
                ld.usable, ld.restore = 0, None
                continue
            n = max(0, min(len(ld.spec.block_ids), ld.usable - ld.spec.first))
            if n:
                src = ld.staging.view(self.layout.layers, -1, self.vblock, KV_DIM)[layer]
                idx = torch.tensor(ld.spec.block_ids[:n], dtype=torch.long, device=kv.device)
                kv.index_copy_(0, idx, src[ld.spec.first : ld.spec.first + n].to(kv.device))
            ld.seconds = time.perf_counter() - ld.started

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if not self._writer or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvfsMetadata) or not meta.saves:
            return
        if self._saves is None:  # first layer of this step
            self._saves = [(s, torch.empty((self.layout.layers, len(s.token_ids), KV_DIM), dtype=self.dtype))
                           for s in meta.saves]
        t0 = time.perf_counter()
        layer = self.layer_names.index(layer_name)
        kv = kv_layer.view(kv_layer.shape[0], self.vblock, kv_layer.shape[-1])
        for spec, buf in self._saves:  # a copy now: the paged blocks may be reused once the request ends
            first = spec.first_block * self.per
            dst = buf.view(self.layout.layers, -1, self.vblock, KV_DIM)[layer, first:]
            idx = torch.tensor(spec.block_ids[first:], dtype=torch.long, device=kv.device)
            dst.copy_(kv.index_select(0, idx))
        self._record(snapshot_seconds=time.perf_counter() - t0)

    def wait_for_save(self) -> None:
        saves, self._saves = self._saves, None
        for spec, buf in saves or ():
            fut = self._loop.submit(self._write(spec, buf))
            self._writes.add(fut)
            fut.add_done_callback(self._writes.discard)

    async def _write(self, spec: SaveSpec, buf: torch.Tensor) -> None:
        try:
            res = await self._client.write(self.namespace, spec.token_ids, buf, self.layout, self.ttl_class,
                                           first_block=spec.first_block, salt=spec.salt)
            self._record(saved_blocks=res.committed, saved_bytes=res.bytes_written, save_seconds=res.seconds)
            log.info("kvfs: request %s: saved %d blocks (%d already stored, %d bytes) in %.1f ms", spec.req_id,
                     res.committed, res.already_present, res.bytes_written, res.seconds * 1e3)
        except Exception as err:  # a cache: the request goes on, the prefix just stays uncached
            self._record(save_failures=1)
            log.warning("kvfs: write-back of request %s failed, prefix not cached: %s", spec.req_id, err)

    def get_block_ids_with_load_errors(self) -> set[int]:
        loads, self._loads = self._loads, []
        if self._begun is not None:  # no layer waited (should not happen): settle the lookups first
            self._begun.result()
            self._begun = None
        failed: set[int] = set()
        for ld in loads:
            if ld.restore is not None and ld.restore.done():  # failed restores may still be writing: drop those
                self._pool.put(ld.staging.view(torch.uint8).view(-1))
            elif ld.restore is not None:
                self._loop.loop.call_soon_threadsafe(ld.restore.cancel)
            ok = min(len(ld.spec.block_ids), max(0, ld.usable - ld.spec.first))
            failed.update(ld.spec.block_ids[ok:])
            if ok:
                tokens, seconds = ok * self.vblock, ld.seconds
                nbytes = tokens * self.layout.layers * self.layout.row_bytes
                # the restore's own time: the worker's lookup, then the read until its last byte
                restored = ld.restore.stats.finished_at - ld.started
                self._record(loaded_tokens=tokens, loaded_bytes=nbytes, load_seconds=seconds,
                             restore_seconds=restored, load_wait_seconds=ld.waited)
                self.stats["loaded_block_ids"] = ld.spec.block_ids[:ok]
                log.info("kvfs: request %s: loaded %d tokens (%d bytes) in %.1f ms", ld.spec.req_id, tokens,
                         nbytes, seconds * 1e3)
        if failed:
            self._record(load_failed_blocks=len(failed))
            log.warning("kvfs: %d vLLM blocks failed to load; vLLM recomputes them", len(failed))
        return failed

    def wait_for_writes(self, timeout: float | None = None) -> bool:
        """Blocks until the background write-backs are done; False on timeout."""
        _, not_done = concurrent.futures.wait(list(self._writes), timeout=timeout)
        return not not_done

    def shutdown(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        if self._loop is not None:
            if not self.wait_for_writes(timeout=30):
                log.warning("kvfs: write-backs still running at shutdown are dropped")
            self._loop.submit(self._client.close()).result(timeout=10)
            self._loop.close()
            self._loop = None
