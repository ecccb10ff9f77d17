"""`kvfs-bench`: measurements that print ratios taken side by side in one run
and write JSON (validated for shape by the tests, never for speed)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table




console = Console(width=None if sys.stdout.isatty() else 170)


def _io(args) -> int:
    from .io import run_io

    console.print(f"kvfs-bench io: a {args.tokens}-token MLA prefix ({args.layers} layers) on {args.chunkservers} "
                  f"local chunkservers; transports {args.transport}; {args.cache}; concurrency {args.concurrency}; "
                  f"{'--insecure (plaintext gRPC)' if args.insecure else 'mutual TLS on gRPC and the data port over TCP'}")
    report = asyncio.run(run_io(args.tokens, args.layers, args.transport.split(","), args.cache.split(","),
                                args.rounds, args.concurrency, args.chunkservers, log=console.print,
                                insecure=args.insecure, vs_insecure=args.vs_insecure))
    table = Table(title=f"restores of {report['prefix_bytes'] / 1e9:.2f} GB in {report['blocks']} blocks of "
                        f"{report['block_bytes']} bytes (medians; ratios from this run)")
    columns = ("cache", "transport", "restore GB/s", "/ raw disk", "/ socket", "/ redis", f"x{args.concurrency} GB/s",
               "block p50 ms", "block p99 ms") + (("TLS / insecure",) if args.vs_insecure else ())
    for col in columns:
        table.add_column(col, justify="right")
    cost = {(cache, c["transport"]): c["tls_over_insecure"] for cache, e in report["modes"].items()
            for c in e.get("tls_cost", [])}
    for cache, entry in report["modes"].items():
        for r in entry["transports"]:
            table.add_row(cache, r["transport"], f"{r['restore_gbps_median']:.2f}", f"{r['over_raw']:.2f}",
                          f"{r['over_socket']:.2f}", f"{r['over_redis']:.2f}" if "over_redis" in r else "-",
                          f"{r['concurrent_gbps']:.2f}", f"{r['block_p50_ms']:.1f}", f"{r['block_p99_ms']:.1f}",
                          *([f"{cost[cache, r['transport']]:.2f}"] if args.vs_insecure else []))
    console.print(table)
    writes = Table(title="the prefix written through the cluster once per write path, one after the other "
                         "(2 replicas)")
    for col in ("cache", "path", "write GB/s (payload)", "to disks GB/s", "raw disk write GB/s", "/ raw write"):
        writes.add_column(col, justify="right")
    for cache, e in report["modes"].items():
        for w in e["writes"]:
            writes.add_row(cache, w["path"], f"{w['write_gbps']:.2f}", f"{w['write_disk_gbps']:.2f}",
                           f"{e['raw_write_gbps']:.2f}", f"{w['write_over_raw']:.2f}")
    console.print(writes)
    base = f"baselines: socket {report['socket_gbps']:.2f} GB/s"
    base += "".join(f", raw disk {c} {e['raw_gbps']:.2f} GB/s" for c, e in report["modes"].items())
    if report["redis"]:
        base += (f", redis GET {report['redis']['gbps']:.2f} GB/s (block p50 {report['redis']['block_p50_ms']:.1f} "
                 f"ms, p99 {report['redis']['block_p99_ms']:.1f} ms)")
    console.print(base)
    _write_json(args.json, {"bench": "io", **_host(), "config": {
        "tokens": args.tokens, "layers": args.layers, "transports": args.transport.split(","),
        "caches": args.cache.split(","), "rounds": args.rounds, "concurrency": args.concurrency,
        "chunkservers": args.chunkservers, "insecure": args.insecure, "vs_insecure": args.vs_insecure},
        "results": report})
    return 0


def _prefix(args) -> int:
    from .prefix import run_prefix

    with _scratch(args.data_dir) as root:
        console.print(f"kvfs-bench prefix: a {args.tokens}-token MLA prefix on {args.chunkservers} local "
                      f"chunkservers, {args.replicas} replicas, {args.rounds} rounds, data in {root}")
        report = asyncio.run(run_prefix(root, args.tokens, args.rounds, args.lookup_blocks, args.chunkservers,
                                        args.replicas, log=console.print))
    table = Table(title="one long prefix through the cluster (medians)")
    for col in ("restore GB/s", "raw io_uring GB/s", "restore / raw", "write-back GB/s",
                f"MatchPrefix {args.lookup_blocks} blocks p50 ms"):
        table.add_column(col, justify="right")
    table.add_row(f"{report['restore_gbps_median']:.2f}", f"{report['raw_gbps_median']:.2f}",
                  f"{report['restore_over_raw']:.2f}", f"{report['write_gbps']:.2f}",
                  f"{report['lookup_rpc_ms_p50']:.1f}")
    console.print(table)
    _write_json(args.json, {"bench": "prefix", **_host(), "config": {
        "tokens": args.tokens, "rounds": args.rounds, "lookup_blocks": args.lookup_blocks,
        "chunkservers": args.chunkservers, "replicas": args.replicas}, "results": report})
    return 0


def _ttft(args) -> int:
    from .ttft import run_ttft

    lengths = [int(x) for x in args.tokens.split(",")]
    console.print(f"kvfs-bench ttft: the {args.preset} model, prompts of {lengths} tokens, "
                  f"{args.chunkservers} local chunkservers")
    report = asyncio.run(run_ttft(args.preset, lengths, args.chunkservers, log=console.print, rounds=args.rounds))
    table = Table(title=f"time to first token, recompute vs restore ({args.preset} model; "
                        f"hits: medians of {args.rounds})")
    for col in ("tokens", "recompute s", "restore s", "speedup", "restored MB", "restore GB/s", "SDK alone GB/s",
                "/ SDK", "hidden"):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        table.add_row(str(r["tokens"]), f"{r['ttft_recompute_s']:.2f}", f"{r['ttft_restore_s']:.3f}",
                      f"{r['speedup']:.1f}x", f"{r['bytes_restored'] / 1e6:.0f}", f"{r['restore_gbps']:.2f}",
                      f"{r['sdk_restore_gbps']:.2f}", f"{r['restore_over_sdk']:.2f}", f"{r['hidden_fraction']:.0%}")
    console.print(table)
    _write_json(args.json, {"bench": "ttft", **_host(), "config": {"preset": args.preset, "tokens": lengths,
                                                                    "chunkservers": args.chunkservers,
                                                                    "rounds": args.rounds},
                            "results": report})
    return 0


def _restore(args) -> int:
    from rich.progress import Progress

    from kvfs.engine import ModelConfig
    from kvfs.engine.simulated import simulated
    from kvfs.keys import Namespace
    from .restore import make_workload, merge_passes, prompt_maker, run_policy, warm_up

    sim = simulated(args.compute, args.compute_scale) if args.compute else None
    cfg = sim.shapes if sim else ModelConfig.preset(args.preset)
    model = f"SIMULATED COMPUTE {sim.label} ({sim.source}), every byte of I/O real" if sim else \
        f"the {args.preset} model"
    network = _network_label(args)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [None]
    policies = args.policy.split(",")
    workload = make_workload(args.prompt_tokens, args.hit_ratio, args.requests, args.seed)
    hits = sum(r.hit for r in workload)
    amount = (f"{len(workload)} requests ({hits} hits)" if args.duration is None else
              f"{args.duration:g} s per policy cycling {len(workload)} requests ({hits} hits)")
    load = f"Poisson arrivals at {args.rates} requests/s, at most {args.concurrency} in service" if args.rates \
        else f"concurrency {args.concurrency}"
    console.print(f"kvfs-bench restore: {amount}, lengths {args.prompt_tokens}, {load}, {model}, {network}, "
                  f"policies {', '.join(policies)}")
    ns = Namespace("bench", f"restore-{sim.name if sim else args.preset}-{args.seed}")
    results = []
    with _cluster(args) as meta, Progress(console=console, transient=True) as progress:
        task = progress.add_task("warm-up: writing the hits' prefixes", total=len(workload))
        asyncio.run(warm_up(meta, cfg, workload, prompt_maker(cfg, workload, args.seed, 0), ns,
                            lambda: progress.advance(task), simulated=sim))
        # passes alternate the order (A B C, C B A, ...) so that drift on a shared machine
        # (page cache, other load) does not favour whichever policy runs first
        run = 0
        for rate in rates:
            passes: dict[str, list[dict]] = {p: [] for p in policies}
            for k in range(args.repeat):
                for policy in policies if k % 2 == 0 else policies[::-1]:
                    run += 1
                    task = progress.add_task(f"pass {k + 1}: policy {policy}" + (f" at {rate:g}/s" if rate else ""),
                                             total=len(workload) if args.duration is None else None)
                    passes[policy].append(asyncio.run(run_policy(
                        meta, cfg, policy, workload, prompt_maker(cfg, workload, args.seed, run), args.concurrency,
                        ns, args.duration, lambda t=task: progress.advance(t), simulated=sim, rate=rate,
                        seed=args.seed)))
            at_rate = [merge_passes(passes[p]) for p in policies]
            if rate:
                console.print(f"offered load {rate:g} requests/s")
            console.print(_policy_table(at_rate))
            results += at_rate
    config = {"preset": None if sim else args.preset, "compute": None if sim is None else {
                  "name": sim.name, "simulated": True, "scale": sim.scale, "tokens_per_s": sim.tokens_per_s,
                  "attention_context": sim.attention_context, "decode_s": sim.decode_s, "source": sim.source},
              "prompt_tokens": args.prompt_tokens, "hit_ratio": args.hit_ratio,
              "requests": args.requests, "duration": args.duration, "concurrency": args.concurrency,
              "rates": rates if args.rates else None, "policies": policies, "seed": args.seed, "hits": hits,
              "chunkservers": args.chunkservers, "repeat": args.repeat, "meta": args.meta,
              "network": args.network}
    _write_json(args.json, {"bench": "restore", **_host(), "config": config, "results": results})
    title = f"kvfs-bench restore: {args.prompt_tokens} tokens, hit ratio {args.hit_ratio}, " + \
        (f"simulated compute {sim.label}, real I/O" if sim else f"the {args.preset} model") + f", {network}"
    if args.plot and args.rates:
        from .plot import load_sweep

        load_sweep(results, args.plot, title)
        console.print(f"wrote {args.plot}")
    else:
        _plot(args.plot, results, f"{title}, concurrency {args.concurrency}")
    return 0


def _plot(path: str | None, results: list[dict], title: str) -> None:
    if path:
        from .plot import ttft_cdfs

        ttft_cdfs(results, path, title)
        console.print(f"wrote {path}")


def _mixed(args) -> int:
    from .mixed import run_mixed

    config = {"restore_tokens": args.restore_tokens, "write_tokens": args.write_tokens, "writers": args.writers,
              "restorers": args.restorers, "seconds": args.seconds, "transport": args.transport,
              "chunkservers": args.chunkservers, "io_mode": args.io_mode,
              "write_yields": args.write_yield.split(","),
              "write_nices": [int(x) for x in args.write_nice.split(",")], "disk_probe": args.disk_probe}
    report = run_mixed(**config)
    _write_json(args.json, {"bench": "mixed", **_host(), "config": config, "results": report})
    return 0


def _tenants(args) -> int:
    from kvfs.config import parse_size

    from .tenants import run_tenants

    configs = run_tenants(parse_size(args.rate), args.a_tokens, args.b_tokens, args.flood, args.samples,
                          args.a_interval, args.transport, args.chunkservers)
    _write_json(args.json, {"bench": "tenants", **_host(), "config": {
        "rate": parse_size(args.rate), "a_tokens": args.a_tokens, "b_tokens": args.b_tokens, "flood": args.flood,
        "samples": args.samples, "a_interval": args.a_interval, "transport": args.transport,
        "chunkservers": args.chunkservers}, "results": configs})
    return 0


def _faults(args) -> int:
    from .faults import run_faults

    console.print(f"kvfs-bench faults: {args.gib} GiB of MLA prompts on {args.chunkservers} local chunkservers, "
                  f"{args.concurrency} restore workers; one chunkserver SIGKILLed after {args.steady}s")
    with _scratch() as root:
        report = asyncio.run(run_faults(root, args.chunkservers, args.gib, args.prompt_blocks, args.concurrency,
                                        args.steady, log=console.print))
    table = Table(title=f"restores of {report['prompt_blocks']}-block prompts while cs-1 dies (seconds)")
    for col in ("window", "restores", "failed", "p50", "p99", "max"):
        table.add_column(col, justify="right")
    for name, w in report["windows"].items():
        table.add_row(name, str(w["count"]), str(w["failed"]), f"{w.get('p50', 0):.3f}", f"{w.get('p99', 0):.3f}",
                      f"{max(w.get('p999', 0), w.get('p99', 0)):.3f}")
    console.print(table)
    console.print(f"detected after {report['detect_s']:.1f}s; every chunk on 2 live servers after "
                  f"{report['replicated_s']:.1f}s; p99 during the fault / steady p99: "
                  f"{report['p99_fault_over_steady'] or 0:.2f}")
    _write_json(args.json, {"bench": "faults", **_host(), "config": {
        "gib": args.gib, "chunkservers": args.chunkservers, "prompt_blocks": args.prompt_blocks,
        "concurrency": args.concurrency, "steady_s": args.steady}, "results": report})
    return 0


def _vllm(args) -> int:
    from .vllm import run_vllm

    console.print(f"kvfs-bench vllm: a {args.tokens}-token prompt through a real vLLM (CPU, tiny DeepSeek-V2) "
                  f"with KvfsConnector on {args.chunkservers} local chunkservers: a miss, then a fresh engine's hit "
                  f"and {args.rounds} more in it; then the same under a cache_salt (one end user's), which must miss "
                  f"the unsalted blocks")
    with _scratch() as root:
        report = run_vllm(root, args.tokens, args.chunkservers, args.rounds, log=console.print)
    table = Table(title=f"time to first token in vLLM, {args.tokens}-token prompt (seconds, bytes)")
    for col in ("", "first token s", "tokens from kvfs", "bytes loaded", "worker load s", "of it restore s",
                "forward waited s", "worker snapshot s", "scheduler MatchPrefix s"):
        table.add_column(col, justify="right")
    for phase in ("miss", "hit", "salted miss", "salted hit"):
        r = report[phase]
        if r.get("written_by_sdk"):
            table.add_row(phase, "-", "0", "-", f"written by the SDK in {r['write_s']:.2f} s", "", "", "", "")
            continue
        table.add_row(phase, f"{r['ttft_s']:.3f}", str(r["num_cached_tokens"]), str(r["bytes_loaded"]),
                      f"{r['worker_load_s']:.4f}", f"{r['worker_restore_s']:.4f}", f"{r['forward_waited_s']:.4f}",
                      f"{r['worker_snapshot_s']:.4f}", f"{r['scheduler_lookup_s']:.4f}")
    console.print(table)
    sdk, hit, salted = report["sdk_restore"], report["hit"], report["salted hit"]
    console.print(f"the worker's restore: {hit['restore_gbps']:.2f} GB/s (salted {salted['restore_gbps']:.2f}); "
                  f"the worker's SDK client alone (no forward pass), same blocks and buffers: {sdk['gbps']:.2f} GB/s ({sdk['seconds'] * 1e3:.1f} ms), "
                  f"so {hit['restore_over_sdk']:.2f} of it (salted {salted['restore_over_sdk']:.2f})")
    if hit["repeats"]:
        console.print(f"the same engine's next {args.rounds} hits: the worker's restore {hit['repeat_restore_gbps']:.2f} "
                      f"GB/s (median), {hit['repeat_restore_over_sdk']:.2f} of the SDK alone")
    if report["misses_computed"]:
        console.print(f"hit is {report['speedup']:.1f}x faster, salted hit {report['salted_speedup']:.1f}x; "
                      f"first-token logprobs differ by at most {report['max_logprob_diff']:.5f}")
    _write_json(args.json, {"bench": "vllm", **_host(), "config": {"tokens": args.tokens, "rounds": args.rounds,
                                                                    "chunkservers": args.chunkservers},
                            "results": report})
    return 0


def _rebuild(args) -> int:
    from .meta import parse_count
    from .rebuild import run_rebuild

    blocks = parse_count(args.blocks)
    with _scratch(args.data_dir) as root:
        console.print(f"kvfs-bench rebuild: one real metaserver (--insecure) rebuilds {blocks:,} MLA blocks in "
                      f"prompts of {args.chain} from the inventories of {args.servers} FAKE chunkservers in a child "
                      f"process (synthetic owner records, unsealed; nothing stored), {args.replicas} copies of each "
                      f"chunk; data in {root}")
        r = asyncio.run(run_rebuild(root, blocks, args.servers, args.replicas, args.chain, log=console.print))
    table = Table(title="rebuild from chunkserver inventories (fake servers)")
    for col in ("blocks", "restored", "seconds", "s per 1M blocks", "loop CPU s per 1M", "+ seal checks",
                "health p99 / max ms"):
        table.add_column(col, justify="right")
    probe = r["health_probe_during"]
    table.add_row(f"{r['blocks']:,}", f"{r['restored']:,}", f"{r['seconds']:.1f}", f"{r['seconds_per_million']:.0f}",
                  f"{r['loop_cpu_seconds_per_million']:.0f}" if r["loop_cpu_seconds_per_million"] else "-",
                  f"{r['seconds_per_million_with_seals']:.0f}",
                  f"{probe.get('p99_ms', 0):.1f} / {probe.get('max_ms', 0):.1f}")
    console.print(table)
    _write_json(args.json, {"bench": "rebuild", **_host(), "results": r})
    return 0 if r["restored"] == blocks and r["blocks_after"] == blocks else 1


def _meta(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .meta import BenchAborted, MetaBenchConfig, config_dict, load_saved, parse_count, run_meta

    sizes = {"blocks": parse_count(args.blocks), "chain": args.chain, "servers": args.servers}
    saved = None
    if args.reuse:
        try:
            saved = load_saved(args.reuse)
            sizes = saved["config"]  # the reused run's
        except BenchAborted as err:
            console.print(f"kvfs-bench meta: --reuse {args.reuse}: {err}", markup=False, highlight=False)
            return 1
    cfg = MetaBenchConfig(**sizes, clients=args.clients, evict=args.evict, samples=args.samples,
                          deadline=args.deadline, heartbeat_interval=args.heartbeat_interval,
                          heartbeat_timeout=args.heartbeat_timeout, load_nice=args.load_nice, reuse=args.reuse)
    changed = " ".join(cfg.meta_flags()) or "none (its defaults)"
    eviction = ("on: the reused blocks sit at the low watermark" if cfg.reuse
                else "on: the fill ends at 95% of the cache") if cfg.evict else "off"
    filled = (f"no fill: a copy of the database of the run in {cfg.reuse} ({cfg.blocks} MLA blocks filled there in "
              f"chains of {cfg.chain})" if cfg.reuse
              else f"{cfg.blocks} MLA blocks in chains of {cfg.chain} from {cfg.clients} writers")
    with _scratch(args.data_dir) as root:
        console.print(f"kvfs-bench meta: one real metaserver, {filled}; metaserver settings changed: {changed}; "
                      f"{cfg.servers} FAKE chunkservers "
                      f"in a child process (they store nothing: chunk writes never happen, ListChunks is empty, "
                      f"DeleteChunks and CopyChunk succeed at once) and the eviction phase's writers at nice "
                      f"{cfg.load_nice}; eviction {eviction}; data in {root}")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=console, transient=True) as progress:
            try:
                report = asyncio.run(run_meta(root, cfg, log=console.print, progress=progress, saved=saved))
            except BenchAborted as err:
                console.print(f"kvfs-bench meta aborted: {err}", markup=False, highlight=False)
                return 1
    _meta_tables(report)
    _write_json(args.json, {"bench": "meta", **_host(), "config": config_dict(cfg), "results": report})
    return 0


def _meta_meanwhile(name: str, p: dict) -> str:
    """What ran in the background of one phase, for the stall table."""
    ch = p.get("status_change", {})
    evicted = f"evicted {ch.get('evicted_blocks', '?')}"
    if name == "lifecycle":
        runs = p["lifecycle_runs"]
        return f"RunLifecycle x{runs['count']} (p50 {runs.get('p50_ms', 0):.0f} ms); {evicted}"
    if name in ("writes", "eviction"):
        return f"wrote {p['writes']['blocks']}; {evicted}"
    if name == "repair":
        first = f", the first {p['first_copy_s']:.1f}s in" if p["first_copy_s"] is not None else ""
        dead = f"seen dead after {p['detect_s']:.1f}s" if p["detect_s"] is not None else f"NOT seen dead ({p['error']})"
        return f"{p['silenced']} {dead}; {p['copies']} copies{first}; lost {ch.get('blocks_lost', '?')}; {evicted}"
    return evicted


def _wrong(s: dict) -> str:
    """'0', or '12 (matched 0 x12)': how many answers were wrong and what they said."""
    if not s["wrong"]:
        return "0"
    said = ", ".join(f"{m} x{n}" for m, n in sorted(s["wrong_matched"].items(), key=lambda kv: -kv[1]))
    return f"{s['wrong']} (matched {said})"


def _meta_tables(r: dict) -> None:
    def mb(n):
        return "-" if n is None else f"{n / 1e6:,.0f}"

    def per(n):
        return "-" if n is None else f"{n:,.0f}"

    fill = r["fill"]
    if "reused" in fill:
        console.print(f"no fill: the database of {fill['reused']} copied in {fill['copy_s']:.1f} s; the metaserver "
                      f"served {fill['serving_s']:.1f} s after its start, holding {fill['blocks']} blocks")
    else:
        table = Table(title=f"fill: {fill['blocks']} blocks committed in {fill['chains']} chains "
                            f"({fill['failed_batches']} batches failed, {fill['refused']} blocks refused)")
        for col in ("blocks/s", *(f"decile {i + 1}" for i in range(len(fill["deciles"])))):
            table.add_column(col, justify="right")
        table.add_row(f"{fill['blocks_per_s']:,.0f}", *(f"{d['blocks_per_s']:,.0f}" for d in fill["deciles"]))
        console.print(table)
    mem, disk = r["memory"], r["disk"]
    after = "its start on the reused database" if "reused" in fill else "the fill"
    table = Table(title=f"the metaserver after {after}: {mem['blocks']} blocks held ({mem['evicted_blocks']} evicted)")
    for col in ("RSS MB", "RSS B/block", "peak MB", "peak B/block", "disk MB", "disk B/block"):
        table.add_column(col, justify="right")
    table.add_row(mb(mem["rss_bytes"]), per(mem["rss_per_block"]), mb(mem["hwm_bytes"]), per(mem["hwm_per_block"]),
                  mb(disk["bytes"]), per(disk["per_block"]))
    console.print(table)
    table = Table(title="MatchPrefix from a plain grpc.aio stub, keys joined as the SDK sends them, one at a time (ms; every answer checked)")
    for col in ("phase", "lookup", "count", "p50", "p99", "max", "wrong", "errors"):
        table.add_column(col, justify="right")
    for name, phase in r["phases"].items():
        for kind, s in phase.get("lookups", {}).items():
            errors = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "0"
            table.add_row(name, kind, str(s["count"]), f"{s.get('p50_ms', 0):.1f}", f"{s.get('p99_ms', 0):.1f}",
                          f"{s.get('max_ms', 0):.1f}", _wrong(s), errors)
    console.print(table)
    table = Table(title="longest wait of a health Check sent every 10 ms by a probe process (ms), and the "
                        "metaserver's event-loop stalls (all / with its loop's thread on the CPU / waiting for a core), and the "
                        "share of the phase its loop's thread was on a CPU / runnable waiting for one, per phase")
    for col in ("phase", "seconds", "probes", "p50", "p99", "max", "failed", "stalls >50 ms", ">100 ms",
                "loop on CPU / waiting", "meanwhile"):
        table.add_column(col, justify="right")
    for name, p in r["phases"].items():
        pr = p["probe"]
        stalls = p.get("loop_stalls", {})
        over = [f"{stalls[k]['count']} / {stalls[k]['busy']} / {stalls[k].get('waiting', 0)}" if k in stalls else "-"
                for k in ("50ms", "100ms")]
        meanwhile = _meta_meanwhile(name, p)
        loop = p.get("metaserver_loop")
        cores = f"{100 * loop['on_cpu']:.0f}% / {100 * loop['waiting_for_a_core']:.0f}%" if loop else "-"
        table.add_row(name, f"{p['seconds']:.1f}", str(pr["count"]), f"{pr.get('p50_ms', 0):.1f}",
                      f"{pr.get('p99_ms', 0):.1f}", f"{pr.get('max_ms', 0):.0f}", str(pr["failed"]), *over, cores,
                      meanwhile)
    console.print(table)
    table = Table(title="the metaserver's steps (writes' and background passes' work between two turns of its event "
                        "loop; a lookup arriving during one waits for its end), by kind, per phase; over each bound: "
                        "all / those whose CPU time alone was over it (the others also waited: for a core, the disk, "
                        "a lock)")
    for col in ("phase", "kind", "steps", "mean ms", "share of loop", "on CPU", "> 1 ms", "> 2 ms", "> 5 ms"):
        table.add_column(col, justify="right")

    def percent(share: float | None) -> str:
        return f"{100 * share:.0f}%" if share is not None else "-"

    for name, p in r["phases"].items():
        for kind, s in sorted(p.get("steps", {}).items(), key=lambda kv: -kv[1]["count"] * kv[1]["mean_ms"]):
            busy = s.get("over_on_cpu", {})
            table.add_row(name, kind, str(s["count"]), f"{s['mean_ms']:.2f}", percent(s["loop_share"]),
                          percent(s.get("on_cpu")),
                          *(f"{s['over'].get(k, '-')} / {busy.get(k, '-')}" for k in ("1ms", "2ms", "5ms")))
    console.print(table)
    if "settle_s" in r:
        began = "the start on the reused database" if "reused" in fill else "the fill"
        console.print(f"nothing was evicted for 2 s from {r['settle_s']:.1f} s after {began}; the steady phase began "
                      f"then" if r["settle_s"] is not None else f"eviction had not stopped 600 s after {began}; the "
                      "steady phase ran beside it")
    rs = r["restart"]
    table = Table(title="restart on the same data: seconds from SIGTERM to exit, and from start to ...")
    for col in ("exited", "SERVING", f"a {rs['expected']}-block match", "RSS after MB"):
        table.add_column(col, justify="right")
    table.add_row(f"{rs['stop_s']:.1f}", f"{rs['serving_s']:.1f}" if "serving_s" in rs else "-",
                  f"{rs['full_match_s']:.1f}" if "full_match_s" in rs else "-", mb(rs.get("rss_bytes")))
    console.print(table)
    a = r["answers"]
    console.print(f"{a['lookups']} lookups: {a['wrong']} wrong answers, {a['errors']} errors; metaserver log: "
                  f"{r['metaserver']['log_warnings']} warning/error lines"
                  + (f"; it had exited with {rs['exit_code']} before the restart" if rs["exit_code"] else "")
                  + (f"; restart: {rs['error']}" if rs.get("error") else ""))
    if r["metaserver"].get("stall_sites"):
        console.print("where the metaserver's event loop was seen held past 50 ms (samples every 10 ms):\n" + "\n".join(
            f"  {n:5d}  {site}" for site, n in r["metaserver"]["stall_sites"]), markup=False, highlight=False)
    if "log_tail" in r["metaserver"]:
        console.print("metaserver log tail:\n" + r["metaserver"]["log_tail"], markup=False, highlight=False)


def _network_label(args) -> str:
    network = getattr(args, "network", None)
    if args.meta:
        return f"the cluster at {args.meta}"
    if not network:
        return "a local cluster on loopback"
    from kvfs.cli.hosts import Link

    return f"SHAPED NETWORK: each server in a network namespace, each chunkserver's link {Link.parse(network)}"


@contextlib.contextmanager
def _cluster(args):
    """The metaserver address to use: `--meta`, or a local cluster started (and stopped) here:
    with `--network`, each server in a network namespace of its own, each chunkserver's
    link shaped (cli/hosts.py)."""
    if args.meta:
        yield args.meta
        return
    from kvfs.cli.hosts import Hosts, Link
    from kvfs.cli.launcher import LocalCluster

    with _scratch() as root, contextlib.ExitStack() as stack:
        hosts = None
        if getattr(args, "network", None):
            link = Link.parse(args.network)
            if os.geteuid() != 0:
                raise SystemExit("kvfs-bench: --network builds network namespaces and shapes links: run it as root")
            hosts = stack.enter_context(Hosts(args.chunkservers + 1))
            for i in range(1, args.chunkservers + 1):
                hosts.shape(i, link)
        cluster = LocalCluster(root, chunkservers=args.chunkservers, replicas=2, capacity="16GiB", hosts=hosts)
        try:
            cluster.start()
            with cluster.worker_env():  # the engines' clients connect as the cluster's worker
                yield cluster.meta_address
        finally:
            cluster.stop()


@contextlib.contextmanager
def _scratch(keep: str | None = None):
    """A folder for the servers' data: `keep` (left in place), or a temporary one removed after."""
    root = pathlib.Path(keep or tempfile.mkdtemp(prefix="kvfs-bench-"))
    try:
        yield root
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _policy_table(results: list[dict]) -> Table:
    table = Table(title="time to first token per policy (seconds)")
    columns = ["policy", "hit p50", "hit p99", "miss p50", "miss p99", "all mean", "all p99", "restore GB/s",
               "write-back GB/s", "dropped", "restore/partial/recompute", "hedges (won)"]
    if "token_hit_ratio" in results[0]:
        columns.append("token hit ratio")
    for col in columns:
        table.add_column(col, justify="right")
    for r in results:
        h, m, a, d = r["ttft_hit"], r["ttft_miss"], r["ttft_all"], r["decisions"]
        row = [r["policy"], f"{h.get('p50', 0):.3f}", f"{h.get('p99', 0):.3f}", f"{m.get('p50', 0):.3f}",
               f"{m.get('p99', 0):.3f}", f"{a['mean']:.3f}", f"{a['p99']:.3f}", f"{r['restore_gbps']:.2f}",
               f"{r['write_back_gbps']:.3f}", str(r["write_backs_dropped"]),
               f"{d.get('restore', 0)}/{d.get('partial', 0)}/{d.get('recompute', 0)}",
               f"{r['hedges']} ({r['hedges_won']})"]
        if "token_hit_ratio" in r:
            row.append(f"{r['token_hit_ratio']:.1%}")
        table.add_row(*row)
    return table


def _simulate(args) -> int:
    from .simulate import SIMULATED, report_rows, simulate_all, unique_blocks

    policies = [p for p in SIMULATED if p != "infinite"] if args.policy == "adaptive" else args.policy.split(",")
    traces = []
    for path in args.path:
        unique = unique_blocks(path, args.limit)
        capacities = []
        for c in args.capacity_blocks.split(","):  # blocks, or a share of the trace's unique blocks
            capacities.append(round(unique * float(c[:-1]) / 100) if c.endswith("%") else int(c))
        console.print(f"kvfs-bench trace --simulate: {path}, {unique} unique 512-token blocks, capacities "
                      f"{capacities} blocks, policies {', '.join(policies)} (no cluster: the eviction policy alone; "
                      f"belady sees the future)")
        summary = simulate_all(path, capacities, policies, args.limit)
        table = Table(title=f"token hit ratio of {summary['requests']} requests of {path} through the eviction "
                            f"policy alone")
        for col in ("policy", "capacity blocks", "of unique", "token hit ratio", "vs lru, points", "of infinite",
                    "evictions", "refused"):
            table.add_column(col, justify="right")
        for row in report_rows(summary):
            table.add_row(*row)
        console.print(table)
        traces.append({"path": path, "capacity_blocks": capacities, "results": summary})
    _write_json(args.json, {"bench": "simulate", **_host(), "config": {
        "paths": args.path, "limit": args.limit, "policies": policies}, "traces": traces})
    return 0


def _trace(args) -> int:
    from rich.progress import Progress

    if args.simulate:
        return _simulate(args)
    if len(args.path) != 1:
        raise SystemExit("kvfs-bench trace: one trace at a time through the cluster (several only with --simulate)")
    args.path = args.path[0]
    from kvfs.engine import ModelConfig
    from kvfs.keys import Namespace
    from .restore import load_trace, replay

    cfg = ModelConfig.preset(args.preset)
    trace = load_trace(args.path, args.limit, cfg.vocab_size)
    policies = args.policy.split(",")
    cacheable = sum(c for _, _, c in trace) / max(1, sum(len(t) for _, t, _ in trace))
    console.print(f"kvfs-bench trace: {len(trace)} requests from {args.path}, {sum(len(t) for _, t, _ in trace)} "
                  f"prompt tokens ({cacheable:.1%} in blocks with hash ids), time / {args.speed}, the {args.preset} "
                  f"model, policies {', '.join(policies)}")
    results = []
    with _cluster(args) as meta, Progress(console=console, transient=True) as progress:
        for policy in policies:
            task = progress.add_task(f"policy {policy}", total=len(trace))
            ns = Namespace("bench", f"trace-{args.preset}-{policy}")  # every policy starts cold
            results.append(asyncio.run(replay(meta, cfg, policy, trace, args.speed, args.concurrency, ns,
                                              lambda t=task: progress.advance(t))))
    console.print(_policy_table(results))
    _write_json(args.json, {"bench": "trace", **_host(), "config": {
        "path": args.path, "limit": args.limit, "requests": len(trace), "speed": args.speed,
        "concurrency": args.concurrency, "preset": args.preset, "policies": policies}, "results": results})
    _plot(args.plot, results, f"kvfs-bench trace: {len(trace)} requests of {args.path}, time / {args.speed}, "
                              f"concurrency {args.concurrency}, {args.preset} model")
    return 0


def _shards(args) -> int:
    from .shards import shard_balance

    counts = [int(n) for n in args.metaservers.split(",")]
    traces = []
    for path in args.path:
        r = shard_balance(path, counts, args.block_tokens, args.limit)
        console.print(f"kvfs-bench shards: {path}: {r['requests']} requests, {r['roots']} distinct first blocks, "
                      f"{r['blocks']} 512-token blocks; routed by the first {r['block_tokens']}-token block's key; "
                      f"the hottest first block has {r['hottest_root_lookup_share']:.1%} of the lookups, the "
                      f"largest prefix tree {r['largest_root_block_share']:.1%} of the blocks (no cluster)")
        table = Table(title=f"per metaserver, over the mean (1.00 is even): {path}")
        for col in ("metaservers", "blocks max", "blocks min", "lookups max", "lookups min", "blocks each",
                    "lookups each"):
            table.add_column(col, justify="right")
        for x in r["results"]:
            b, k = x["blocks_balance"], x["lookups_balance"]
            table.add_row(str(x["metaservers"]), f"{b['max_over_mean']:.2f}", f"{b['min_over_mean']:.2f}",
                          f"{k['max_over_mean']:.2f}", f"{k['min_over_mean']:.2f}",
                          " ".join(map(str, x["blocks"])), " ".join(map(str, x["lookups"])))
        console.print(table)
        traces.append({"path": path, **r})
    _write_json(args.json, {"bench": "shards", **_host(), "config": {
        "paths": args.path, "metaservers": counts, "block_tokens": args.block_tokens, "limit": args.limit},
        "traces": traces})
    return 0


def _host() -> dict:
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}}


def _write_json(path: str | None, report: dict) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfs-bench", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    io = sub.add_parser("io", help="restore throughput and per-block latency per transport, beside the raw "
                                   "disk, a loopback socket and Redis")
    io.add_argument("--tokens", type=int, default=32768)
    io.add_argument("--layers", type=int, default=27)
    io.add_argument("--transport", default="grpc,tcp,shm", help="one or more of grpc,tcp,shm")
    io.add_argument("--cache", default="warm,cold", help="warm (page cache), cold (O_DIRECT), or both")
    io.add_argument("--rounds", type=int, default=3)
    io.add_argument("--concurrency", type=int, default=16)
    io.add_argument("--chunkservers", type=int, default=3)
    io.add_argument("--insecure", action="store_true", help="the cluster without TLS (a trusted lab)")
    io.add_argument("--vs-insecure", action="store_true",
                    help="also restore, alternating, from a TLS and an --insecure cluster: the cost of TLS per "
                         "transport (the last column)")
    prefix = sub.add_parser("prefix", help="restore and write-back of one long MLA prefix on a local cluster, "
                                           "beside the raw disk reader; MatchPrefix latency")
    prefix.add_argument("--tokens", type=int, default=32768)
    prefix.add_argument("--rounds", type=int, default=3)
    prefix.add_argument("--lookup-blocks", type=int, default=2000)
    prefix.add_argument("--chunkservers", type=int, default=3)
    prefix.add_argument("--replicas", type=int, default=2)
    prefix.add_argument("--data-dir", help="where servers keep data (default: a temp folder, removed)")
    ttft = sub.add_parser("ttft", help="time to first token of the MLA engine, recompute vs restore")
    ttft.add_argument("--preset", default="bench")
    ttft.add_argument("--tokens", default="2048,8192,32768", help="prompt lengths, comma-separated")
    ttft.add_argument("--chunkservers", type=int, default=3)
    ttft.add_argument("--rounds", type=int, default=5,
                      help="hits per length, each beside an SDK restore of the same blocks (medians compared)")
    restore = sub.add_parser("restore", help="TTFT of concurrent hits and misses under each admission policy")
    restore.add_argument("--preset", default="bench")
    restore.add_argument("--prompt-tokens", default="8192",
                         help="a length, a list (cycled), or lognormal:median=N,sigma=S")
    restore.add_argument("--hit-ratio", type=float, default=0.5)
    restore.add_argument("--requests", type=int, default=32,
                         help="requests per policy; with --duration, distinct requests cycled")
    restore.add_argument("--duration", type=float, help="seconds of load per policy (default: --requests once)")
    restore.add_argument("--repeat", type=int, default=1,
                         help="passes per policy, in alternating order; percentiles pool every pass")
    restore.add_argument("--concurrency", type=int, default=8)
    restore.add_argument("--policy", default="adaptive,always-restore,always-recompute")
    restore.add_argument("--seed", type=int, default=0)
    restore.add_argument("--compute", help="replace the model's work by a simulated GPU's time (deepseek-v3): "
                         "a bench mode where restores compete with fast prefills; every byte of I/O stays real")
    restore.add_argument("--compute-scale", type=float, default=1.0,
                         help="with --compute: an accelerator this many times slower than the published figures, "
                         "to keep a real cluster's ratio of read bandwidth to compute on a machine with slower "
                         "storage (docs/operations.md)")
    restore.add_argument("--network", help="each server in a network namespace of its own (root), each "
                         "chunkserver's link shaped both ways with tc: a rate, e.g. 2gbit")
    restore.add_argument("--rates", help="open loop: a load sweep, Poisson arrivals at each of these requests/s "
                         "(--concurrency caps requests in service)")
    restore.add_argument("--meta", help="an existing cluster's metaserver (default: start a local one)")
    restore.add_argument("--chunkservers", type=int, default=3)
    trace = sub.add_parser("trace", help="replay a Mooncake-format trace through the engine and cluster")
    trace.add_argument("path", nargs="+", help="a Mooncake-format trace, or gen:SHAPE[:REQUESTS[:SEED]] for one "
                       "generated (chat, agent, sysprompt, documents, mix); several with --simulate")
    trace.add_argument("--limit", type=int, help="only the first N requests")
    trace.add_argument("--speed", type=float, default=1.0, help="divide arrival times by this")
    trace.add_argument("--preset", default="tiny")
    trace.add_argument("--concurrency", type=int, default=8)
    trace.add_argument("--policy", default="adaptive",
                       help="admission policies; with --simulate, eviction policies (default: all)")
    trace.add_argument("--simulate", action="store_true",
                       help="replay through the eviction policy alone (no cluster, no engine)")
    trace.add_argument("--capacity-blocks", default="1%,5%,10%",
                       help="with --simulate: cache sizes in blocks, or in %% of the trace's unique blocks")
    trace.add_argument("--meta", help="an existing cluster's metaserver (default: start a local one)")
    trace.add_argument("--chunkservers", type=int, default=3)
    faults = sub.add_parser("faults", help="restores while a chunkserver is killed; detection and re-replication")
    faults.add_argument("--gib", type=float, default=1.0, help="GiB of blocks written first")
    faults.add_argument("--chunkservers", type=int, default=4)
    faults.add_argument("--prompt-blocks", type=int, default=16)
    faults.add_argument("--concurrency", type=int, default=4)
    faults.add_argument("--steady", type=float, default=10.0, help="seconds of restores before the kill")
    vllm = sub.add_parser("vllm", help="time to first token in a real vLLM with kvfs: miss vs hit (extra vllm)")
    vllm.add_argument("--tokens", type=int, default=4096)
    vllm.add_argument("--chunkservers", type=int, default=3)
    vllm.add_argument("--rounds", type=int, default=5,
                      help="hits of the same prompt in the fresh engine after its first (0: none)")
    meta = sub.add_parser("meta", help="one real metaserver at scale (fake chunkservers): fill rate, memory and "
                                       "disk per block, restart, MatchPrefix latency under background work")
    meta.add_argument("--blocks", default="1M", help="blocks to fill: 20000, 100K, 1M, 10M")
    meta.add_argument("--chain", type=int, default=2000, help="blocks per chain (prompt)")
    meta.add_argument("--clients", type=int, default=8, help="concurrent writers")
    meta.add_argument("--servers", type=int, default=4, help="fake chunkservers, one failure domain each")
    meta.add_argument("--evict", action=argparse.BooleanOptionalAction, default=True,
                      help="size the fakes so the fill ends at 95%% of the cache, then write until it evicts")
    meta.add_argument("--samples", type=int, default=1000, help="lookups per kind and phase (at least)")
    meta.add_argument("--deadline", type=float, default=10.0, help="seconds, per RPC")
    meta.add_argument("--heartbeat-interval", help="metaserver setting (default: its own)")
    meta.add_argument("--heartbeat-timeout", help="metaserver setting (default: its own)")
    meta.add_argument("--load-nice", type=int, default=10,
                      help="CPU niceness of the load beside the metaserver (the fake chunkservers and the eviction "
                           "phase's writers, which stand for other machines); 0: they compete for this machine's "
                           "cores as equals")
    meta.add_argument("--data-dir", help="where the metaserver keeps data (default: a temp folder, removed); kept, "
                                          "a later run can --reuse it")
    meta.add_argument("--reuse", metavar="DIR",
                      help="no fill: start on a copy of the database an earlier run kept in DIR (its --data-dir), "
                           "the fakes sized so that what it holds sits at the low watermark, and go on from the "
                           "steady phase; --blocks, --chain and --servers are that run's")
    rebuild = sub.add_parser("rebuild", help="a real metaserver rebuilding its metadata from chunkserver "
                                             "inventories (fake chunkservers): seconds per million blocks")
    rebuild.add_argument("--blocks", default="200K", help="blocks the inventories hold: 20000, 200K, 1M")
    rebuild.add_argument("--servers", type=int, default=4, help="fake chunkservers")
    rebuild.add_argument("--replicas", type=int, default=2, help="copies of each chunk")
    rebuild.add_argument("--chain", type=int, default=64, help="blocks per prompt (each names its parent)")
    rebuild.add_argument("--data-dir", help="where the metaserver keeps data (default: a temp folder, removed)")
    tenants = sub.add_parser("tenants", help="one tenant's restore latency while another floods the same "
                                             "chunkservers, without and with per-tenant read pacing")
    tenants.add_argument("--rate", default="64MiB", help="tenant_read_rate of the paced configuration")
    tenants.add_argument("--a-tokens", type=int, default=1024, help="tenant A's prompt (MLA tokens)")
    tenants.add_argument("--b-tokens", type=int, default=8192, help="tenant B's prefix (MLA tokens)")
    tenants.add_argument("--flood", type=int, default=4, help="B's concurrent restore loops")
    tenants.add_argument("--samples", type=int, default=40, help="A's restores per phase")
    tenants.add_argument("--a-interval", type=float, default=0.25, help="seconds between A's restores")
    tenants.add_argument("--transport", default="tcp", help="tcp, shm or grpc (all paced alike)")
    tenants.add_argument("--chunkservers", type=int, default=3)
    mixed = sub.add_parser("mixed", help="restore latency alone and while write-backs stream into the same "
                                         "chunkservers, beside raw O_DIRECT write")
    mixed.add_argument("--restore-tokens", type=int, default=2048, help="the restored prefix (MLA tokens)")
    mixed.add_argument("--write-tokens", type=int, default=2048, help="each write-back's prompt (MLA tokens)")
    mixed.add_argument("--writers", type=int, default=4, help="concurrent write-back loops (their own process)")
    mixed.add_argument("--restorers", type=int, default=2, help="concurrent restore loops")
    mixed.add_argument("--seconds", type=float, default=20.0, help="of restores, alone and under the writes")
    mixed.add_argument("--transport", default="auto", help="auto, shm, tcp or grpc (restores and writes)")
    mixed.add_argument("--chunkservers", type=int, default=3)
    mixed.add_argument("--io-mode", default="direct", help="the chunkservers': direct (O_DIRECT) or buffered")
    mixed.add_argument("--write-yield", default="0",
                       help="the chunkservers' write_yield settings to compare, one run each (0: writes never wait)")
    mixed.add_argument("--write-nice", default="0,10",
                       help="write_nice settings to compare (the chunkservers' and the writer's SDK's), one run "
                            "each with every write_yield (0: write threads at the servers' priority)")
    mixed.add_argument("--no-disk-probe", dest="disk_probe", action="store_false",
                       help="skip timing the restores beside the disk's own work (raw writes at the write-backs' "
                            "disk rate, then flushes), with no kvfs writes")
    shards = sub.add_parser("shards", help="how evenly hash slots spread a trace's prefixes over N metaservers "
                                           "(blocks and lookups per metaserver; no cluster)")
    shards.add_argument("path", nargs="+", help="a Mooncake-format trace, or gen:SHAPE[:REQUESTS[:SEED]]")
    shards.add_argument("--metaservers", default="2,4,8", help="metaserver counts to compare")
    shards.add_argument("--block-tokens", type=int, default=64, help="tokens under a prompt's first block key")
    shards.add_argument("--limit", type=int, help="only the first N requests")
    for p in (io, prefix, ttft, restore, trace, faults, vllm, meta, rebuild, tenants, mixed, shards):
        p.add_argument("--json", help="write the report here")
    for p in (restore, trace):
        p.add_argument("--plot", help="draw time-to-first-token CDFs per policy into this PNG (matplotlib)")
    args = parser.parse_args(argv)
    return {"io": _io, "prefix": _prefix, "ttft": _ttft, "restore": _restore, "trace": _trace,
            "faults": _faults, "vllm": _vllm, "meta": _meta, "rebuild": _rebuild, "tenants": _tenants,
            "mixed": _mixed, "shards": _shards}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
