"""`kvfs-bench vllm`: time to first token in a real vLLM with kvfs as its KV store,
a miss (computed, then saved) beside a hit (a fresh engine loading the prefix).

Needs the `vllm` extra. Runs vLLM in-process on the CPU (CPU_MLA attention,
vLLM's own prefix cache off) with a tiny random DeepSeek-V2 built here, on a local
kvfs cluster. The helpers are shared with tests/vllm.
"""

from __future__ import annotations

import gc
import os
import pathlib
import time

import torch

from .io import percentile


def build_tiny_model(path: str | os.PathLike, max_positions: int = 8192) -> str:
    """A random 2-layer DeepSeek-V2 (no MoE) whose MLA cache is the real 576 wide
    (the CPU MLA backends take nothing else), saved in bf16 at `path`."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=2,  # no MoE
                           n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=64,
                           num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=None,  # 512 + 64 = 576
                           qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                           max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _tls_config(folder) -> dict:
    """The connector's certificate settings: the local cluster's worker certificate."""
    if folder is None:
        return {}
    return {"tls_ca": f"{folder}/ca.pem", "tls_cert": f"{folder}/worker.pem", "tls_key": f"{folder}/worker.key"}


def make_llm(model: str, meta: str, tenant: str, tls_dir=None, log_stats: bool = False, max_len: int = 8192):
    """An engine with KvfsConnector on the metaserver `meta` (vLLM's own prefix cache off)
    for prompts up to `max_len` tokens; `log_stats`: vLLM's stat loggers on (its log
    lines and `LLM.get_metrics()`), as `vllm serve` has them."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # the tiny model's cache is 2 layers x 576 bf16 values a token: room for two such prompts
    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, attention_backend="CPU_MLA",
               enable_prefix_caching=False, max_model_len=max_len,
               kv_cache_memory_bytes=max(64 << 20, 2 * max_len * 2 * 576 * 2),
               disable_log_stats=not log_stats,
               kv_transfer_config=KVTransferConfig(
                   kv_connector="KvfsConnector", kv_connector_module_path="kvfs.integrations.vllm",
                   kv_role="kv_both", kv_load_failure_policy="recompute",
                   kv_connector_extra_config={"meta": meta, "tenant": tenant,
                                                              **_tls_config(tls_dir)}))


def first_token(llm, prompt: list[int], salt: str | None = None):
    """(token, {token: logprob} of the top 5, num_cached_tokens, seconds) of a one-token
    generation; `salt`: the request's cache_salt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    request = TokensPrompt(prompt_token_ids=prompt)
    if salt is not None:
        request["cache_salt"] = salt
    out = llm.generate([request],
                       SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    logprobs = {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
    return out.outputs[0].token_ids[0], logprobs, out.num_cached_tokens, seconds


def bare_restores(worker, prompt: list[int], rounds: int = 5) -> dict:
    """The same prefix restored by the connector's own worker-side SDK client alone
    (lookup + read into its staging pool, on its kvfs thread), with no forward pass
    beside it: the rate its loads inside vLLM are held to (median of `rounds`)."""

    async def once() -> tuple[int, float]:
        t0 = time.perf_counter()
        match = await worker._client.lookup(worker.namespace, prompt)
        buf = worker._pool.get(worker.layout.buffer_bytes(match.tokens))
        stats = await worker._client.read(match, buf).wait()
        seconds = time.perf_counter() - t0
        worker._pool.put(buf)
        return stats.bytes, seconds

    runs = [worker._loop.submit(once()).result() for _ in range(rounds)]
    median = percentile([s for _, s in runs], 0.5)
    return {"bytes": runs[0][0], "seconds": median, "gbps": runs[0][0] / median / 1e9}


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


SALT = "user-1"
PHASES = (("miss", None), ("hit", None), ("salted miss", SALT), ("salted hit", SALT))
# vLLM's CPU MLA prefill cannot be chunked (vLLM turns chunked prefill off for MLA on CPU) and
# holds the whole prompt's attention: a 32K-token miss here wanted over 24 GB and was killed.
# Past this many tokens the misses are written by the SDK instead (random KV, the connector's
# keys and layout), so the hits still load real blocks, but no first tokens are compared.
LONGEST_PREFILL = 8192


def run_vllm(root: pathlib.Path, tokens: int, chunkservers: int = 3, rounds: int = 5, log=print) -> dict:
    """A miss, a fresh engine's hit and then `rounds` more hits of the same prompt in
    that engine (vLLM's own prefix cache is off: each loads from kvfs again), then the
    same under a cache_salt; the SDK's restore of the same blocks alone beside them."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: the worker's connector is reachable here
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvfs.client import SyncClient
    from kvfs.keys import Namespace
    from kvfs.cli.launcher import LocalCluster

    max_len = max(8192, -(-(tokens + 64) // 1024) * 1024)
    model = build_tiny_model(root / "model", max_positions=max_len)
    cluster = LocalCluster(root / "cluster", chunkservers=chunkservers, replicas=2, capacity="4GiB").start()
    tenant = "bench"
    prompt = [(37 * i + 11) % 1000 + 10 for i in range(tokens)]
    warm = [(13 * i + 5) % 900 + 10 for i in range(40)]  # under one kvfs block: neither loads nor saves
    rows = {}
    try:
        worker = cluster.worker  # issues worker.pem in the cluster's CA folder
        with SyncClient(cluster.meta_address, credentials=worker) as client:
            # then the same prompt as one end user's (vLLM's cache_salt): it must not hit the unsalted
            # blocks, is written back under its salt, and a fresh engine hits that
            for phase, salt in PHASES:
                if phase.endswith("miss") and tokens > LONGEST_PREFILL:
                    rows[phase] = _written_miss(client, Namespace(tenant, model), prompt, salt)
                    log(f"{phase}: {tokens} tokens written by the SDK in {rows[phase]['write_s']:.2f}s "
                        f"(past {LONGEST_PREFILL}, vLLM's CPU prefill does not fit in memory)")
                    continue
                llm = make_llm(model, cluster.meta_address, tenant, cluster.ca.folder, max_len=max_len)
                for _ in range(2):  # the first steps of an engine are slow: not what is measured
                    first_token(llm, warm)
                worker = get_kv_transfer_group()
                before = dict(worker.stats)
                token, logprobs, cached, ttft = first_token(llm, prompt, salt)
                if phase.endswith("miss"):  # the write-back runs in the background: wait for it
                    deadline = time.monotonic() + 120
                    while client.lookup(Namespace(tenant, model), prompt, salt=salt).matched < tokens // 64:
                        if time.monotonic() > deadline:
                            raise RuntimeError("the miss's blocks were not saved within 120 s")
                        time.sleep(0.05)
                delta = _since(before, worker.stats)
                t0 = time.perf_counter()
                client.lookup(Namespace(tenant, model), prompt, salt=salt)  # the scheduler side's, once per request
                lookup = time.perf_counter() - t0
                rows[phase] = {"ttft_s": ttft, "num_cached_tokens": cached, "token": token,
                               "bytes_loaded": delta("loaded_bytes"), "worker_load_s": delta("load_seconds"),
                               "worker_restore_s": delta("restore_seconds"),
                               "forward_waited_s": delta("load_wait_seconds"),
                               "worker_snapshot_s": delta("snapshot_seconds"), "saved_blocks": delta("saved_blocks"),
                               "scheduler_lookup_s": lookup, "logprobs": {str(k): v for k, v in logprobs.items()}}
                log(f"{phase}: first token in {ttft:.3f}s, {cached} tokens from kvfs")
                if phase == "hit":  # the same engine again: what a serving engine's hits look like
                    repeats = rows[phase]["repeats"] = []
                    for _ in range(rounds):
                        before = dict(worker.stats)
                        _, _, cached, ttft = first_token(llm, prompt)
                        delta = _since(before, worker.stats)
                        repeats.append({"ttft_s": ttft, "num_cached_tokens": cached,
                                        "bytes_loaded": delta("loaded_bytes"),
                                        "worker_restore_s": delta("restore_seconds")})
                    median_ttft = percentile([r["ttft_s"] for r in repeats], 0.5)
                    log(f"hit again x{rounds}: first token in {median_ttft:.3f}s (median)")
                    bare = bare_restores(worker, prompt, rounds=max(5, rounds))
                close(llm)

    finally:
        cluster.stop()
    miss, hit = rows["miss"], rows["hit"]
    computed = "logprobs" in miss
    common = miss["logprobs"].keys() & hit["logprobs"].keys() if computed else ()
    for r in (hit, rows["salted hit"], *hit["repeats"]):  # the worker's restore beside the SDK's, same bytes
        r["restore_gbps"] = r["bytes_loaded"] / r["worker_restore_s"] / 1e9 if r["worker_restore_s"] else 0.0
        r["restore_over_sdk"] = r["restore_gbps"] / bare["gbps"]
    if hit["repeats"]:
        hit["repeat_restore_gbps"] = percentile([r["restore_gbps"] for r in hit["repeats"]], 0.5)
        hit["repeat_restore_over_sdk"] = hit["repeat_restore_gbps"] / bare["gbps"]
    return {"tokens": tokens, "rounds": rounds, **rows, "sdk_restore": bare, "misses_computed": computed,
            "speedup": miss["ttft_s"] / hit["ttft_s"] if computed else None,
            "salted_speedup": rows["salted miss"]["ttft_s"] / rows["salted hit"]["ttft_s"] if computed else None,
            "max_logprob_diff": max(abs(miss["logprobs"][k] - hit["logprobs"][k]) for k in common) if common else None}


def _since(before: dict, stats: dict):
    """A lookup of how much each of the worker's counters grew since `before`."""
    after = dict(stats)
    return lambda key: after[key] - before[key]


def _written_miss(client, namespace, prompt: list[int], salt: str | None) -> dict:
    """A miss's blocks written through the SDK as the connector would save them."""
    from kvfs.client import BlockLayout

    layout = BlockLayout(2, 64, 576, "bfloat16")  # the tiny model's: 2 layers of 576-wide bf16
    torch.manual_seed(1)
    kv = torch.randn(layout.layers, len(prompt), 576).to(torch.bfloat16)
    t0 = time.perf_counter()
    res = client.write(namespace, prompt, kv, layout, "chat", salt=salt)
    return {"ttft_s": None, "num_cached_tokens": 0, "written_by_sdk": True, "write_s": time.perf_counter() - t0,
            "saved_blocks": res.committed}
