"""KvfsConnector in a real vLLM (CPU, tiny random DeepSeek-V2 built here) on a
real local kvfs cluster: an engine saves a prompt's prefix, a fresh engine
loads it byte for byte, and corrupted stored bytes make vLLM recompute.

Output equality is no oracle with a random model (a prefix cache can flip
near-tied tokens); the checks are the bytes, the matched-token count and the
first token's logprobs (within LOGPROB_TOL of a full recompute). What the
connector did must also reach vLLM's own stats: its Prometheus metrics
(`LLM.get_metrics()`) and its "KV Transfer metrics" log lines."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvfs.bench import vllm as bench
from kvfs.bench.vllm import build_tiny_model, close
from kvfs.client import SyncClient
from kvfs.keys import Namespace

from helpers import flip_stored_byte, wait_until

pytestmark = pytest.mark.vllm

LOGPROB_TOL = 0.02
PROMPT = [(37 * i + 11) % 1000 + 10 for i in range(200)]  # 3 full kvfs blocks + 8 tokens
MATCHED = 192  # 3 kvfs blocks; also (200 - 1) // 16 * 16, the most vLLM may load
SHORT = [(13 * i + 5) % 900 + 10 for i in range(40)]  # under one kvfs block: neither looked up nor saved
TENANT = "acme"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-dsv2"))


@pytest.fixture(params=[False, True], ids=["in-process", "multiprocess"])
def multiprocess(request, monkeypatch) -> bool:
    import vllm.envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if request.param else "0")
    # collective_rpc ships the probe functions to the worker process with cloudpickle
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    vllm.envs.disable_envs_cache()  # an in-process engine caches the environment
    yield request.param
    vllm.envs.disable_envs_cache()


class TransferLog(logging.Handler):
    """The messages of vLLM's stat logger, which runs in this (the frontend) process in both modes."""

    LOGGER = "vllm.v1.metrics.loggers"

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def watch(self, llm):
        # after LLM(): vLLM's logging setup (dictConfig) empties the handlers of its loggers' children
        logging.getLogger(self.LOGGER).addHandler(self)
        return llm

    def totals(self) -> dict[str, float]:
        """The "KV Transfer metrics: k=v, ..." lines so far, summed per key (meaningful for counters)."""
        totals: dict[str, float] = {}
        for line in self.lines:
            _, found, pairs = line.partition("KV Transfer metrics: ")
            for pair in pairs.split(", ") if found else ():
                key, value = pair.split("=")
                totals[key] = totals.get(key, 0) + float(value)
        return totals


@pytest.fixture
def transfer_log():
    log = TransferLog()
    yield log
    logging.getLogger(TransferLog.LOGGER).removeHandler(log)


def vllm_metrics(llm) -> dict:
    """vLLM's Prometheus metrics of the kvfs connector by short name (counter -> value, histogram ->
    its Histogram), and vLLM's own count of prompt tokens supplied by the connector."""
    from vllm.v1.metrics.reader import Histogram

    return {m.name.removeprefix("vllm:").removeprefix("kvfs_"): m if isinstance(m, Histogram) else m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:kvfs_") or m.name == "vllm:external_prefix_cache_hits"}


def make_llm(model: str, meta: str):
    t0 = time.perf_counter()
    llm = bench.make_llm(model, meta, TENANT, log_stats=True)
    print(f"  LLM() in {time.perf_counter() - t0:.1f}s")
    return llm


def first_token(llm, prompt=PROMPT, salt=None):
    return bench.first_token(llm, prompt, salt)


def worker_probe():
    """Functions run inside the worker process through collective_rpc (defined in
    a closure so cloudpickle ships them by value)."""

    def stats(worker):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return dict(get_kv_transfer_group().stats)

    def paged_rows(worker, block_ids):
        """The paged cache rows of these vLLM blocks, as [layer][tokens][576] bytes."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        c = get_kv_transfer_group()
        idx = torch.tensor(block_ids, dtype=torch.long)
        rows = [c.kv_caches[n].index_select(0, idx).reshape(-1, 576) for n in c.layer_names]
        return torch.stack(rows).contiguous().view(torch.uint8).numpy().tobytes()

    def find_rows(worker, payload: bytes, layers: int, tokens: int, block: int):
        """How many of the payload's (layer, vLLM block) rows appear somewhere in the paged cache."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        c = get_kv_transfer_group()
        want = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).view(layers, tokens // block, block, 576)
        found = 0
        for layer, name in enumerate(c.layer_names):
            kv = c.kv_caches[name].view(torch.int16)
            for b in range(tokens // block):
                found += bool((kv == want[layer, b].view(torch.int16)).all(-1).all(-1).any())
        return found

    return stats, paged_rows, find_rows


STATS, PAGED_ROWS, FIND_ROWS = worker_probe()


def stored(meta: str, model: str, salt: str | None = None) -> tuple[int, bytes]:
    """kvfs's own view: matched blocks of PROMPT and their payload bytes, [layer][tokens][576]."""
    with SyncClient(meta) as client:
        match = client.lookup(Namespace(TENANT, model), PROMPT, salt=salt)
        if not match.matched:
            return 0, b""
        out = bytearray(match.layout.buffer_bytes(match.tokens))
        client.read(match, out)
        return match.matched, bytes(out)


def vllm_saw_the_save(llm, transfer_log: TransferLog, stored_bytes: int) -> None:
    """The miss's lookup and write-back, in vLLM's metrics and log."""
    # the write-back finishes after the request did: its numbers go out with the next step's
    wait_until(lambda: llm.collective_rpc(STATS)[0]["saved_blocks"] == 3, timeout=30, what="the write-back counted")
    first_token(llm, SHORT)
    saw, own = vllm_metrics(llm), llm.collective_rpc(STATS)[0]
    llm.llm_engine.do_log_stats()
    said = transfer_log.totals()
    print(f"  engine 1 in vLLM's log: {[line for line in transfer_log.lines if 'KV Transfer' in line]}")
    assert saw["lookup_seconds"].count == 1 and saw["lookup_blocks"] == 3 and saw["matched_blocks"] == 0
    assert saw["saved_blocks"] == 3 and saw["saved_bytes"] == stored_bytes and saw["save_failures"] == 0
    assert saw["save_seconds"].count == 1 and saw["save_seconds"].sum == pytest.approx(own["save_seconds"])
    assert saw["loaded_tokens"] == 0 and saw["load_seconds"].count == 0
    assert said["saved_blocks"] == 3 and said["saved_bytes"] == stored_bytes and said["lookups"] == 1


def vllm_saw_the_load(llm, transfer_log: TransferLog, stored_bytes: int, stats: dict) -> None:
    """The hit's lookup and restore, in vLLM's metrics and log: the bytes kvfs holds for the prefix,
    the tokens vLLM counted as the connector's; the restore alone within the load, and the forward's
    wait for it within that."""
    load_seconds = stats["load_seconds"]
    assert 0 < stats["restore_seconds"] <= load_seconds and 0 <= stats["load_wait_seconds"] <= load_seconds
    saw = vllm_metrics(llm)
    llm.llm_engine.do_log_stats()
    said = transfer_log.totals()
    print(f"  engine 2 in vLLM's log: {[line for line in transfer_log.lines if 'KV Transfer' in line]}")
    assert saw["loaded_bytes"] == stored_bytes
    assert saw["loaded_tokens"] == MATCHED == saw["external_prefix_cache_hits"]
    assert saw["lookup_seconds"].count == 1 and saw["lookup_blocks"] == 3 and saw["matched_blocks"] == 3
    assert saw["load_seconds"].count == 1 and saw["load_seconds"].sum == pytest.approx(load_seconds)
    assert saw["restore_seconds"].count == 1 and saw["restore_seconds"].sum == pytest.approx(stats["restore_seconds"])
    assert saw["load_failed_blocks"] == 0 and saw["saved_blocks"] == 0
    assert said["loaded_bytes"] == stored_bytes and said["loaded_tokens"] == MATCHED and said["loads"] == 1
    assert said["restores"] == 1  # vLLM's reader truncates counters to ints: seconds are checked in its log
    assert said.get("load_wait_seconds", 0) == pytest.approx(stats["load_wait_seconds"], abs=1e-4)
    assert said["matched_blocks"] == 3 and said["block_hit_ratio"] == 1


def save_then_load(local_cluster, model, transfer_log):
    cluster = local_cluster(chunkservers=3, replicas=2)
    meta = cluster.meta_address
    print(f"cluster at {meta}; prompt of {len(PROMPT)} tokens")

    llm = transfer_log.watch(make_llm(model, meta))
    tok1, lp1, cached1, ttft1 = first_token(llm)
    print(f"engine 1 (miss): token {tok1}, num_cached_tokens {cached1}, {ttft1 * 1e3:.0f} ms")
    assert cached1 == 0
    blocks = wait_until(lambda: stored(meta, model)[0] == 3 and 3, timeout=30, what="3 blocks saved in kvfs")
    matched, payload = stored(meta, model)
    found = llm.collective_rpc(FIND_ROWS, args=(payload, 2, MATCHED, 16))[0]
    print(f"  kvfs holds {blocks} blocks ({len(payload)} bytes); {found}/24 of their (layer, 16-token) rows are "
          f"in engine 1's paged cache, byte for byte")
    assert found == 2 * MATCHED // 16
    vllm_saw_the_save(llm, transfer_log, len(payload))
    close(llm)
    transfer_log.lines.clear()

    llm = transfer_log.watch(make_llm(model, meta))
    tok2, lp2, cached2, ttft2 = first_token(llm)
    stats = llm.collective_rpc(STATS)[0]
    loaded = llm.collective_rpc(PAGED_ROWS, args=(stats["loaded_block_ids"],))[0]
    diff = max(abs(lp1[t] - lp2[t]) for t in lp1.keys() & lp2.keys())
    print(f"engine 2 (hit): token {tok2}, num_cached_tokens {cached2}, {ttft2 * 1e3:.0f} ms; loaded "
          f"{stats['loaded_tokens']} tokens / {stats['loaded_bytes']} bytes into blocks {stats['loaded_block_ids']}; "
          f"max first-token logprob diff {diff:.5f}")
    assert cached2 == MATCHED
    assert stats["loaded_tokens"] == MATCHED and stats["load_failed_blocks"] == 0
    assert loaded == payload, "the paged blocks engine 2 loaded differ from the bytes engine 1 saved"
    assert lp1.keys() & lp2.keys() and diff <= LOGPROB_TOL
    vllm_saw_the_load(llm, transfer_log, len(payload), stats)
    close(llm)
    transfer_log.lines.clear()
    return cluster, meta, lp1


def test_fresh_engine_loads_the_saved_prefix(local_cluster, tiny_model, multiprocess, transfer_log):
    print(f"multiprocessing {'on' if multiprocess else 'off'}")
    save_then_load(local_cluster, tiny_model, transfer_log)


def test_corrupt_blocks_are_recomputed(local_cluster, tiny_model, monkeypatch, transfer_log):
    import vllm.envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm.envs.disable_envs_cache()
    cluster, meta, lp1 = save_then_load(local_cluster, tiny_model, transfer_log)

    with SyncClient(meta) as client:
        match = client.lookup(Namespace(TENANT, tiny_model), PROMPT)
        out = bytearray(match.layout.buffer_bytes(match.tokens))
        client.read(match, out)
    # block 1's first chunk, cut out of the layer-major read-back
    chunk = match.blocks[1].chunks[0]
    layout = match.layout
    assert chunk.offset == 0 and chunk.length % layout.layer_bytes == 0
    stride = match.tokens * layout.row_bytes
    chunk_bytes = b"".join(out[layer * stride + layout.layer_bytes : layer * stride + 2 * layout.layer_bytes]
                           for layer in range(chunk.length // layout.layer_bytes))
    flipped = sum(flip_stored_byte(cluster.root / f"cs-{i}", chunk_bytes, 5000) is not None for i in range(3))
    print(f"injected: flipped a byte of block 1's chunk on {flipped} replicas")
    assert flipped == 2

    llm = make_llm(tiny_model, meta)
    tok3, lp3, cached3, ttft3 = first_token(llm)
    stats = llm.collective_rpc(STATS)[0]
    diff = max(abs(lp1[t] - lp3[t]) for t in lp1.keys() & lp3.keys())
    print(f"engine 3 (corrupt): token {tok3}, {stats['load_failed_blocks']} vLLM blocks reported as load errors, "
          f"loaded {stats['loaded_tokens']} tokens; max first-token logprob diff vs engine 1 {diff:.5f}")
    assert stats["load_failed_blocks"] > 0 and stats["loaded_tokens"] == 0
    assert lp1.keys() & lp3.keys() and diff <= LOGPROB_TOL
    saw = vllm_metrics(llm)  # the recompute, as vLLM's metrics count it
    assert saw["load_failed_blocks"] == stats["load_failed_blocks"] and saw["loaded_bytes"] == 0
    close(llm)
    vllm.envs.disable_envs_cache()


def test_requests_with_another_cache_salt_neither_hit_nor_see_the_saved_prefix(local_cluster, tiny_model,
                                                                               monkeypatch):
    import vllm.envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm.envs.disable_envs_cache()
    cluster = local_cluster(chunkservers=3, replicas=2)
    meta = cluster.meta_address
    llm = make_llm(tiny_model, meta)
    assert first_token(llm, salt="alice")[2] == 0
    wait_until(lambda: stored(meta, tiny_model, "alice")[0] == 3, timeout=30, what="alice's 3 blocks saved")
    assert stored(meta, tiny_model)[0] == 0 and stored(meta, tiny_model, "bob")[0] == 0
    close(llm)
    llm = make_llm(tiny_model, meta)  # a fresh engine: only kvfs can supply a prefix
    assert first_token(llm, salt="bob")[2] == 0  # the same prompt from another user: a miss
    assert llm.collective_rpc(STATS)[0]["loaded_tokens"] == 0
    close(llm)
    llm = make_llm(tiny_model, meta)
    cached = first_token(llm, salt="alice")[2]
    loaded = llm.collective_rpc(STATS)[0]["loaded_tokens"]
    close(llm)
    vllm.envs.disable_envs_cache()
    print(f"bob: a miss; alice in a fresh engine: {cached} tokens cached, {loaded} loaded from kvfs")
    assert cached == MATCHED and loaded == MATCHED  # alice's own prefix, from kvfs


def test_block_size_rule_and_missing_metaserver_are_refused():
    from types import SimpleNamespace as S

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfs.integrations.vllm import KvfsConnector

    def build(block_size, extra):
        transfer = KVTransferConfig(kv_connector="KvfsConnector", kv_role="kv_both", kv_connector_extra_config=extra)
        cfg = S(kv_transfer_config=transfer, cache_config=S(block_size=block_size), model_config=S(model="m"))
        return KvfsConnector(cfg, KVConnectorRole.SCHEDULER, S(kv_cache_groups=[]))

    with pytest.raises(ValueError, match="64-token blocks, not a multiple of vLLM's block size 128") as err:
        build(128, {"meta": "127.0.0.1:1"})
    print(f"block_size 128: {err.value}")
    with pytest.raises(ValueError, match="metaserver address") as err:
        build(16, {})
    print(f"no meta: {err.value}")


def test_vllm_bench_reports_miss_and_hit(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "vllm.json"
    proc = subprocess.run([sys.executable, "-m", "kvfs.bench.main", "vllm", "--tokens", "200", "--rounds", "3",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())["results"]
    assert r["miss"]["num_cached_tokens"] == 0 and r["hit"]["num_cached_tokens"] == MATCHED
    # under a salt the unsalted blocks are not found; its own write-back is
    assert r["salted miss"]["num_cached_tokens"] == 0 and r["salted hit"]["num_cached_tokens"] == MATCHED
    assert r["salted hit"]["bytes_loaded"] == r["hit"]["bytes_loaded"]
    assert r["hit"]["bytes_loaded"] == 2 * MATCHED * 576 * 2  # layers x tokens x 576 x bf16
    assert r["hit"]["saved_blocks"] == 0 and r["max_logprob_diff"] <= LOGPROB_TOL  # a hit writes nothing again
    assert abs(r["speedup"] - r["miss"]["ttft_s"] / r["hit"]["ttft_s"]) < 1e-9
    # the same engine's next hits load the prefix again each time (vLLM's own prefix cache is off)
    repeats = r["hit"]["repeats"]
    assert r["rounds"] == len(repeats) == 3
    assert all(x["num_cached_tokens"] == MATCHED and x["bytes_loaded"] == r["hit"]["bytes_loaded"] for x in repeats)
    assert r["hit"]["repeat_restore_gbps"] == sorted(x["restore_gbps"] for x in repeats)[1] > 0
    print(f"saw: kvfs-bench vllm miss {r['miss']['ttft_s']:.3f}s, hit {r['hit']['ttft_s']:.3f}s")


def test_vllm_bench_past_the_longest_cpu_prefill_writes_its_misses_and_still_loads(tmp_path):
    import json
    import subprocess
    import sys

    from kvfs.bench.vllm import LONGEST_PREFILL

    tokens = LONGEST_PREFILL + 64
    out = tmp_path / "vllm.json"
    proc = subprocess.run([sys.executable, "-m", "kvfs.bench.main", "vllm", "--tokens", str(tokens), "--rounds", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())["results"]
    assert not r["misses_computed"] and r["speedup"] is None and r["max_logprob_diff"] is None
    for phase in ("miss", "salted miss"):
        assert r[phase]["written_by_sdk"] and r[phase]["saved_blocks"] == tokens // 64
    loaded = tokens - 16  # all but the last vLLM block: a token is left to compute
    for hit in (r["hit"], r["salted hit"], *r["hit"]["repeats"]):
        assert hit["num_cached_tokens"] == loaded and hit["bytes_loaded"] == 2 * loaded * 576 * 2
    assert r["sdk_restore"]["bytes"] == 2 * tokens * 576 * 2 and r["sdk_restore"]["gbps"] > 0
