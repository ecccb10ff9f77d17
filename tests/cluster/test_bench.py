"""kvfs-bench writes reports of the documented shape (never checked for speed)."""

import json
import math
import os
import subprocess
import sys

import pytest

BENCH = [sys.executable, "-m", "kvfs.bench.main"]


def run(args, tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([*BENCH, *args, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_io_bench_report_shape(tmp_path):
    report, stdout = run(["io", "--tokens", "1024", "--layers", "4", "--rounds", "1", "--concurrency", "2",
                          "--chunkservers", "2"], tmp_path)
    assert report["bench"] == "io" and report["config"]["transports"] == ["grpc", "tcp", "shm"]
    results = report["results"]
    assert results["blocks"] == 16 and results["socket_gbps"] > 0
    assert set(results["modes"]) == {"warm", "cold"}
    for entry in results["modes"].values():
        assert entry["raw_gbps"] > 0 and entry["raw_write_gbps"] > 0
        assert [w["path"] for w in entry["writes"]] == ["grpc", "tcp data port", "local data port"]
        for w in entry["writes"]:
            assert abs(w["write_disk_gbps"] - 2 * w["write_gbps"]) < 1e-9 and w["write_gbps"] > 0
            assert abs(w["write_over_raw"] - w["write_disk_gbps"] / entry["raw_write_gbps"]) < 1e-9
        assert entry["write_gbps"] == entry["writes"][-1]["write_gbps"]  # the default path's, as before
        assert [t["transport"] for t in entry["transports"]] == ["grpc", "tcp", "shm"]
        for t in entry["transports"]:
            assert len(t["restore_gbps"]) == 1 and t["block_p99_ms"] >= t["block_p50_ms"] > 0
            assert abs(t["over_raw"] - t["restore_gbps_median"] / entry["raw_gbps"]) < 1e-9
            assert abs(t["over_socket"] - t["restore_gbps_median"] / results["socket_gbps"]) < 1e-9
            assert ("over_redis" in t) == (results["redis"] is not None)
    assert "/ raw disk" in stdout and "/ raw write" in stdout


def test_io_bench_measures_the_cost_of_tls(tmp_path):
    report, stdout = run(["io", "--tokens", "1024", "--layers", "4", "--rounds", "1", "--concurrency", "2",
                          "--chunkservers", "2", "--cache", "warm", "--transport", "grpc,tcp", "--vs-insecure"],
                         tmp_path)
    assert report["config"]["vs_insecure"] and report["results"]["security"] == "mutual TLS"
    costs = report["results"]["modes"]["warm"]["tls_cost"]  # restores alternating between the two clusters
    assert [c["transport"] for c in costs] == ["grpc", "tcp"]
    for c in costs:
        assert c["tls_gbps"] > 0 and c["insecure_gbps"] > 0
        assert abs(c["tls_over_insecure"] - c["tls_gbps"] / c["insecure_gbps"]) < 1e-9
    assert "TLS / insecure" in stdout


def test_prefix_bench_report_shape(tmp_path):
    report, stdout = run(["prefix", "--tokens", "1024", "--rounds", "1", "--lookup-blocks", "40"], tmp_path)
    r = report["results"]
    assert report["bench"] == "prefix" and r["blocks"] == 16 and r["lookup_blocks"] == 40
    assert r["write_gbps"] > 0 and r["lookup_rpc_ms_p50"] > 0 and len(r["restore_gbps"]) == 1
    assert abs(r["restore_over_raw"] - r["restore_gbps_median"] / r["raw_gbps_median"]) < 1e-9


def test_ttft_bench_report_shape(tmp_path):
    report, stdout = run(["ttft", "--preset", "tiny", "--tokens", "200,300", "--chunkservers", "2", "--rounds", "3"],
                         tmp_path)
    rows = report["results"]["rows"]
    assert [r["tokens"] for r in rows] == [200, 300] and report["config"]["rounds"] == 3
    for r in rows:
        assert len(r["restore_gbps_all"]) == len(r["sdk_restore_gbps_all"]) == 3
        assert r["restore_gbps"] == sorted(r["restore_gbps_all"])[1]
        assert r["sdk_restore_gbps"] == sorted(r["sdk_restore_gbps_all"])[1]
        assert r["restore_gbps"] == r["bytes_restored"] / r["restore_s"] / 1e9  # the median hit is the one reported
        assert r["ttft_recompute_s"] > 0 and r["ttft_restore_s"] > 0
        assert abs(r["speedup"] - r["ttft_recompute_s"] / r["ttft_restore_s"]) < 1e-9
        assert r["bytes_restored"] == (r["tokens"] // 64) * 64 * 2 * 48 * 2  # blocks x tokens x layers x kv_dim x bf16
        assert 0 <= r["hidden_fraction"] <= 1
        assert r["sdk_restore_gbps"] > 0 and abs(r["restore_over_sdk"] - r["restore_gbps"] / r["sdk_restore_gbps"]) < 1e-9
    assert "speedup" in stdout


def test_restore_bench_report_shape_and_counts(tmp_path):
    plot = tmp_path / "cdf.png"
    report, stdout = run(["restore", "--preset", "tiny", "--prompt-tokens", "130,260", "--requests", "8",
                          "--concurrency", "3", "--hit-ratio", "0.5", "--chunkservers", "2", "--plot", str(plot)],
                         tmp_path)
    config, results = report["config"], report["results"]
    assert [r["policy"] for r in results] == ["adaptive", "always-restore", "always-recompute"]
    for r in results:
        assert r["ttft_hit"]["count"] == config["hits"] == len(r["ttft_samples"]["hit"])
        assert r["ttft_hit"]["count"] + r["ttft_miss"]["count"] == config["requests"] == r["requests"] == 8
        assert sum(r["decisions"].values()) == config["hits"]  # every hit was decided, no miss was
        assert r["ttft_all"]["p99"] >= r["ttft_all"]["p50"] > 0
        assert r["ttft_all"]["p50"] in r["ttft_samples"]["hit"] + r["ttft_samples"]["miss"]
        assert 0 <= r["hedges_won"] <= r["hedges"]
        assert len(r["server_p95_ms"]) <= 2  # measured per chunkserver
    assert results[2]["decisions"] == {"recompute": config["hits"]} and results[2]["bytes_restored"] == 0
    if config["hits"]:
        assert results[1]["decisions"] == {"restore": config["hits"]} and results[1]["bytes_restored"] > 0
    assert "time to first token per policy" in stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_restore_bench_with_simulated_compute_sweeps_offered_load(tmp_path):
    plot = tmp_path / "sweep.png"
    report, stdout = run(["restore", "--compute", "deepseek-v3", "--prompt-tokens", "200", "--requests", "6",
                          "--rates", "40,80", "--concurrency", "3", "--hit-ratio", "0.5", "--chunkservers", "2",
                          "--policy", "adaptive,always-recompute", "--plot", str(plot)], tmp_path)
    config, results = report["config"], report["results"]
    assert config["compute"]["simulated"] and config["compute"]["name"] == "deepseek-v3" and config["preset"] is None
    assert [(r["offered_rate"], r["policy"]) for r in results] == [
        (40.0, "adaptive"), (40.0, "always-recompute"), (80.0, "adaptive"), (80.0, "always-recompute")]
    for r in results:
        assert r["ttft_hit"]["count"] + r["ttft_miss"]["count"] == r["requests"] == 6
        assert sum(r["decisions"].values()) == config["hits"]
        assert set(r["actual_over_estimate"]) <= set(r["decisions"])
        assert all(v > 0 for v in r["actual_over_estimate"].values())
        # the simulated model writes back real bytes: 3 full blocks of 61 layers x 64 tokens x 576 x 2 per miss
        assert r["bytes_written"] % (61 * 64 * 576 * 2) == 0
    if config["hits"]:
        assert results[0]["bytes_restored"] > 0 or results[0]["decisions"].get("recompute") == config["hits"]
    assert "SIMULATED COMPUTE" in stdout and "offered load 80" in stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_restore_bench_runs_for_a_duration(tmp_path):
    report, _ = run(["restore", "--preset", "tiny", "--prompt-tokens", "130", "--requests", "3", "--duration", "2",
                     "--concurrency", "2", "--hit-ratio", "0.7", "--policy", "adaptive", "--chunkservers", "2",
                     "--repeat", "2"], tmp_path)
    (r,) = report["results"]
    assert r["passes"] == 2 and len(r["pass_means"]) == 2
    assert report["config"]["duration"] == 2
    assert r["requests"] > 6  # the three distinct requests were cycled, in each of two passes
    assert r["ttft_hit"]["count"] + r["ttft_miss"]["count"] == r["requests"]
    assert r["load_s"] <= r["wall_s"]
    # a hit repeats its cached prompt; a miss gets fresh tokens every time round
    assert sum(r["decisions"].values()) == r["ttft_hit"]["count"]


def test_trace_bench_replays_a_mooncake_format_trace(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [  # hash ids are 512-token blocks; requests 2 and 3 reuse request 1's first blocks
        {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 700, "output_length": 1, "hash_ids": [7]},
        {"timestamp": 20, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 30, "input_length": 600, "output_length": 1, "hash_ids": [0]},
        {"timestamp": 40, "input_length": 900, "output_length": 1, "hash_ids": [9]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # --speed 0.02: the trace's 10 ms gaps become 500 ms, room for a write-back (allocate, write both
    # replicas durably, commit: tens of ms here, a few more over fresh TLS connections) to land
    # before the next request looks its blocks up; back to back, the assertions below were a race
    report, stdout = run(["trace", str(trace), "--limit", "4", "--speed", "0.02", "--concurrency", "1",
                          "--chunkservers", "2", "--policy", "adaptive,always-recompute"], tmp_path)
    assert report["config"]["requests"] == 4
    adaptive, recompute = report["results"]
    for r in (adaptive, recompute):
        assert r["ttft_hit"]["count"] + r["ttft_miss"]["count"] == 4
        assert sum(r["decisions"].values()) == r["ttft_hit"]["count"]
    # one at a time, each request sees the write-backs of those before it (when they were not deferred):
    # the third reuses 1024 tokens, the fourth 512
    assert adaptive["ttft_hit"]["count"] >= 1 and 0 < adaptive["token_hit_ratio"] <= 1536 / 3500
    assert recompute["bytes_restored"] == 0 and recompute["decisions"].get("recompute", 0) >= 1
    assert "token" in stdout and "ratio" in stdout  # the column header (rich may wrap it)


def test_trace_simulate_runs_the_eviction_policies_alone(tmp_path):
    import pathlib

    trace = pathlib.Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_first500.jsonl"
    report, stdout = run(["trace", str(trace), "gen:chat:300:1", "--simulate", "--capacity-blocks", "5%,300"],
                         tmp_path)
    assert report["bench"] == "simulate" and [t["path"] for t in report["traces"]] == [str(trace), "gen:chat:300:1"]
    policies = {"lfuda", "lru", "arc", "arc-tlfu", "belady"}  # arc-tlfu: on trial, the simulator only
    assert set(report["config"]["policies"]) == policies
    for t, requests in zip(report["traces"], (500, 300)):
        summary = t["results"]
        assert summary["requests"] == requests
        assert t["capacity_blocks"] == [round(summary["unique_blocks"] * 0.05), 300]
        assert {(r["policy"], r["capacity_blocks"]) for r in summary["results"]} == {
            (p, c) for p in policies for c in t["capacity_blocks"]}
        for r in summary["results"]:
            assert 0 < r["token_hit_ratio"] <= summary["infinite"]["token_hit_ratio"]
    assert "infinite" in stdout and "belady" in stdout


@pytest.mark.slow
def test_faults_bench_reports_windows_detection_and_re_replication(tmp_path):
    report, stdout = run(["faults", "--gib", "0.03", "--chunkservers", "3", "--prompt-blocks", "2",
                          "--concurrency", "2", "--steady", "1"], tmp_path)
    r = report["results"]
    assert r["prompts"] >= 1 and 0 < r["detect_s"] <= r["replicated_s"]
    assert set(r["windows"]) == {"steady", "kill_to_detect", "detect_to_replicated", "after"}
    assert r["windows"]["steady"]["count"] > 0 and r["windows"]["steady"]["failed"] == 0
    assert r["windows"]["after"]["failed"] == 0  # healed: every restore succeeds again
    assert "detected after" in stdout


@pytest.fixture(scope="module")
def kept_meta_run(tmp_path_factory):
    """A 20,000-block `kvfs-bench meta` run whose folder is kept (--data-dir), for --reuse."""
    tmp = tmp_path_factory.mktemp("meta")
    report, stdout = run(["meta", "--blocks", "20000", "--chain", "2000", "--samples", "20",
                          "--data-dir", str(tmp / "kept")], tmp)
    return report, stdout, tmp / "kept"


def _files(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_meta_bench_reuses_a_kept_database_without_changing_it(kept_meta_run, tmp_path):
    first, _, kept = kept_meta_run
    before = _files(kept / "metaserver")
    report, stdout = run(["meta", "--reuse", str(kept), "--samples", "20", "--data-dir", str(tmp_path / "again")],
                         tmp_path)
    config, r = report["config"], report["results"]
    assert config["reuse"] == str(kept) and config["blocks"] == 20000 and config["servers"] == 4  # the kept run's
    fill = r["fill"]
    assert fill["reused"] == str(kept) and fill["serving_s"] > 0 and fill["copy_s"] >= 0
    # it serves what the kept run held at its end, at the low watermark of the fakes' capacity
    assert 0 < fill["blocks"] == r["memory"]["blocks"] <= first["results"]["status"]["blocks"]
    replicas = r["metaserver"]["replicas"]
    assert r["capacity_per_server"] == math.ceil(fill["blocks"] * r["block_footprint_bytes"] * replicas / 4 / 0.8)
    assert list(r["phases"]) == ["steady", "lifecycle", "writes", "eviction", "repair"]  # no fill
    for phase in r["phases"].values():
        assert len(phase["lookups"]) == 4 and all(s["count"] > 0 and s["wrong"] == 0 and s["errors"] == {}
                                                  for s in phase["lookups"].values())
    assert r["phases"]["eviction"]["status_change"]["evicted_blocks"] > 0
    assert r["answers"]["wrong"] == r["answers"]["errors"] == 0 < r["answers"]["lookups"]
    assert "error" not in r["restart"] and r["restart"]["matched"] == 2000
    assert "no fill: the database of" in stdout and "0 wrong answers" in stdout
    assert _files(kept / "metaserver") == before  # the run changed its copy only
    saved = json.loads((tmp_path / "again" / "bench-meta.json").read_text())  # and its copy can be reused again
    assert saved == json.loads((kept / "bench-meta.json").read_text()) and len(saved["chains"]) == 4


def test_meta_bench_refuses_to_reuse_a_folder_no_run_kept(tmp_path):
    (tmp_path / "metaserver").mkdir()
    proc = subprocess.run([*BENCH, "meta", "--reuse", str(tmp_path)], capture_output=True, text=True, timeout=120)
    said = " ".join(proc.stdout.split())  # rich wraps lines at the terminal's width
    assert proc.returncode == 1 and "holds no bench-meta.json" in said, proc.stdout + proc.stderr


def test_meta_bench_report_shape(kept_meta_run):
    report, stdout, _ = kept_meta_run
    config, r = report["config"], report["results"]
    assert report["bench"] == "meta" and config["blocks"] == 20000 and config["chain"] == 2000 and config["evict"]
    fill = r["fill"]
    assert fill["blocks"] == 20000 and fill["chains"] == 10 and fill["failed_batches"] == 0 and fill["errors"] == {}
    assert len(fill["deciles"]) == 10 and sum(d["blocks"] for d in fill["deciles"]) == 20000
    memory, disk = r["memory"], r["disk"]
    assert 0 < memory["blocks"] == disk["blocks"] <= 20000  # eviction may have dropped some
    assert abs(memory["rss_per_block"] - memory["rss_bytes"] / memory["blocks"]) < 1e-9
    assert abs(memory["hwm_per_block"] - memory["hwm_bytes"] / memory["blocks"]) < 1e-9
    assert memory["hwm_bytes_before_restart"] >= memory["hwm_bytes"] >= memory["rss_bytes"] > 0
    assert abs(disk["per_block"] - disk["bytes"] / disk["blocks"]) < 1e-9
    assert r["block_footprint_bytes"] == 2 << 20  # two 1 MiB slots
    assert list(r["phases"]) == ["fill", "steady", "lifecycle", "writes", "eviction", "repair"]
    assert r["settle_s"] is not None and r["settle_s"] >= 0  # the fill's eviction was done before steady
    kinds = {"hit 32", "hit 512", "hit 2000", "miss after 1 (2000 keys)"}
    for name, phase in r["phases"].items():
        probe = phase["probe"]
        assert probe["count"] > 0 and probe["max_ms"] >= probe["p99_ms"] >= probe["p50_ms"] > 0
        stalls = phase["loop_stalls"]  # the metaserver's own count, per phase: never negative, busy ones among all
        assert set(stalls) == {"25ms", "50ms", "100ms", "250ms", "1000ms"}
        assert all(0 <= s["busy"] + s["waiting"] <= s["count"] for s in stalls.values())
        for thread in ("metaserver_loop", "bench_loop"):  # shares of the phase, from schedstat
            share = phase[thread]
            assert 0 <= share["on_cpu"] <= 1.05 and 0 <= share["waiting_for_a_core"] <= 1.05, share
        assert phase["metaserver_loop"]["on_cpu"] > 0  # it served the probe at least
        assert stalls["25ms"]["count"] >= stalls["50ms"]["count"] >= stalls["1000ms"]["count"]
        if name == "fill":
            continue
        assert set(phase["lookups"]) == kinds
        for s in phase["lookups"].values():  # every answer right at this size
            # the writes phase ends once the metaserver evicts, with its samples or not
            assert s["count"] >= (1 if name == "writes" else 20) and s["max_ms"] >= s["p99_ms"] >= s["p50_ms"] > 0
            assert s["wrong"] == 0 and s["errors"] == {}
    lookups = [s for p in r["phases"].values() for s in p.get("lookups", {}).values()]
    assert r["answers"] == {"lookups": sum(s["count"] for s in lookups), "wrong": 0, "errors": 0}
    assert r["phases"]["lifecycle"]["lifecycle_runs"]["count"] > 0
    # the writes phase ends at the first eviction (at this size, the writers' first allocations: their 8 x 500
    # blocks in flight pass the high watermark at once, where at 10M they are 0.04% of the cache)
    before_eviction = r["phases"]["writes"]["writes"]["blocks"]
    evicted = r["phases"]["eviction"]["status_change"]["evicted_blocks"]  # the fakes' capacity made it evict
    writes = r["phases"]["eviction"]["writes"]  # from the writer process, its counts sent back
    # a twentieth of the fill evicted in the two (the writes phase ends at most 0.2 s after the first eviction;
    # their counters run from a Status read before the writers started to one after, so none are lost between)
    assert writes["least_evicted"] == 1000 and evicted > 0
    assert evicted + r["phases"]["writes"]["status_change"]["evicted_blocks"] >= 1000 and writes["blocks"] > 0
    assert 0 <= before_eviction and before_eviction + writes["blocks"] <= 6000  # the writers' 3 chains, counted once
    assert writes["failed_batches"] == 0 and writes["errors"] == {} and writes["deletes_seen"]
    # the load beside the metaserver (writers, fakes) runs at --load-nice's lower priority
    assert config["load_nice"] == 10 and writes["nice"] == r["fakes"]["nice"] == min(19, os.nice(0) + 10)
    repair = r["phases"]["repair"]
    assert repair["silenced"] == "fake-3" and repair["detect_s"] > 0
    restart = r["restart"]
    assert "error" not in restart and restart["matched"] == restart["expected"] == 2000
    assert restart["full_match_s"] >= restart["serving_s"] > 0 and restart["stop_s"] > 0
    # the metaserver's steps per phase: the fill's writes allocate and commit, and so do the eviction
    # phase's writers; each kind's counts add up (a long step is one over the shorter bounds too), and
    # a step long on the CPU alone is long
    assert {"allocate", "commit"} <= set(r["phases"]["fill"]["steps"])
    assert r["phases"]["eviction"]["steps"]["allocate"]["count"] > 0
    for phase in r["phases"].values():
        for s in phase["steps"].values():
            over = [s["over"][k] for k in ("1ms", "2ms", "5ms")]
            busy = [s["over_on_cpu"][k] for k in ("1ms", "2ms", "5ms")]
            assert s["count"] >= over[0] >= over[1] >= over[2] >= 0 and s["mean_ms"] > 0 and s["loop_share"] > 0
            assert busy[0] >= busy[1] >= busy[2] >= 0 and all(b <= o for b, o in zip(busy, over)), s
            assert 0 < s["on_cpu"] <= 1.05, s
    assert "the metaserver's steps" in stdout
    assert "FAKE chunkservers" in stdout and "0 wrong answers" in stdout


def test_tenants_bench_reports_both_configurations(tmp_path):
    report, stdout = run(["tenants", "--a-tokens", "64", "--b-tokens", "256", "--flood", "2", "--samples", "5",
                          "--a-interval", "0.2", "--rate", "8MiB", "--chunkservers", "2"], tmp_path)
    unpaced, paced = report["results"]
    assert report["bench"] == "tenants" and (unpaced["rate"], paced["rate"]) == (0, 8 << 20)
    for r in (unpaced, paced):
        assert r["flood_p99_ms"] >= r["flood_p50_ms"] > 0 and r["alone_p99_ms"] >= r["alone_p50_ms"] > 0
        assert abs(r["p99_ratio"] - r["flood_p99_ms"] / r["alone_p99_ms"]) < 1e-9 and r["b_gbps"] >= 0
    # A (2 MiB every 0.2 s) stays under 8 MiB/s per server; B restoring as fast as it can does not
    assert unpaced["b_paced"] == paced["a_paced"] == 0 and paced["b_paced"] > 0
    assert "under tenant B's flood" in stdout


def test_mixed_bench_times_restores_alone_and_under_write_backs(tmp_path):
    report, stdout = run(["mixed", "--restore-tokens", "256", "--write-tokens", "128", "--writers", "2",
                          "--restorers", "1", "--seconds", "1", "--chunkservers", "2", "--write-yield", "0,50ms",
                          "--write-nice", "0,10"], tmp_path)
    assert report["bench"] == "mixed" and report["config"]["write_yields"] == ["0", "50ms"]
    assert report["config"]["write_nices"] == [0, 10]
    rows = report["results"]
    assert [(r["write_yield"], r["write_nice"]) for r in rows] == [("0", 0), ("0", 10), ("50ms", 0), ("50ms", 10)]
    for r in rows:
        for phase in ("alone", "with_writes"):
            assert r[phase]["count"] >= 1 and r[phase]["p99_ms"] >= r[phase]["p50_ms"] > 0
        assert abs(r["p99_ratio"] - r["with_writes"]["p99_ms"] / r["alone"]["p99_ms"]) < 1e-9
        assert r["write_gbps"] > 0 and r["write_failures"] == 0
        assert abs(r["write_over_raw"] - r["write_disk_gbps"] / r["raw_write_gbps"]) < 1e-9
        alone, mixed = r["cpu_alone"], r["cpu_with_writes"]
        assert set(alone["roles"]) == {"restorers", "chunkservers", "metaserver"}
        assert set(mixed["roles"]) == set(alone["roles"]) | {"writer"}
        for cpu in (alone, mixed):  # the processes' counters, read by role: restores and serving took CPU
            assert 0 < cpu["host_busy_cpus"] <= cpu["cpus"] + 0.01
            assert cpu["roles"]["restorers"] > 0 and cpu["roles"]["chunkservers"] > 0
        assert mixed["roles"]["writer"] > 0  # it wrote: write_gbps > 0
        probe = r["disk_probe"]  # restores beside the disk's own writes and flushes, no kvfs writes
        assert probe["raw_writes"]["count"] >= 1 and probe["raw_writes"]["gbps"] > 0
        assert probe["flushes"]["count"] >= 1 and probe["flushes"]["per_s"] > 0
        for p in probe.values():
            assert abs(p["p99_ratio"] - p["p99_ms"] / r["alone"]["p99_ms"]) < 1e-9
    assert rows[0]["writes_deferred"] == rows[1]["writes_deferred"] == 0  # writes never wait with write_yield 0
    assert "write-backs failed: 0, 0, 0, 0" in stdout


@pytest.mark.root
def test_restore_bench_over_a_shaped_network_runs_each_server_in_a_namespace(tmp_path):
    report, stdout = run(["restore", "--compute", "deepseek-v3", "--compute-scale", "4", "--network", "1gbit",
                          "--prompt-tokens", "200", "--requests", "4", "--concurrency", "2", "--hit-ratio", "0.5",
                          "--chunkservers", "2", "--policy", "always-restore"], tmp_path)
    config, (result,) = report["config"], report["results"]
    assert config["network"] == "1gbit" and config["compute"]["scale"] == 4.0
    assert result["ttft_hit"]["count"] + result["ttft_miss"]["count"] == 4
    if config["hits"]:
        assert result["bytes_restored"] > 0  # read over the namespaces' links
    assert "SHAPED NETWORK" in stdout and "1 Gbit/s" in stdout and "4x slower" in stdout


def test_shards_reports_blocks_and_lookups_per_metaserver(tmp_path):
    import pathlib

    trace = pathlib.Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_first500.jsonl"
    report, stdout = run(["shards", str(trace), "gen:agent:200:1", "--metaservers", "2,4"], tmp_path)
    assert report["bench"] == "shards" and [t["path"] for t in report["traces"]] == [str(trace), "gen:agent:200:1"]
    for t in report["traces"]:
        assert [x["metaservers"] for x in t["results"]] == [2, 4]
        for x in t["results"]:
            assert sum(x["blocks"]) == t["blocks"] and sum(x["lookups"]) == t["requests"]
            assert x["blocks_balance"]["max_over_mean"] >= 1.0 >= x["blocks_balance"]["min_over_mean"]
    assert report["traces"][0]["requests"] == 500
    assert "lookups max" in stdout


def test_rebuild_bench_restores_every_block_of_the_fake_inventories(tmp_path):
    report, stdout = run(["rebuild", "--blocks", "3000", "--servers", "3", "--replicas", "2", "--chain", "10"], tmp_path)
    r = report["results"]
    assert report["bench"] == "rebuild" and "FAKE chunkservers" in stdout and r["chain"] == 10
    # 3,000 blocks of 2 chunks in prompts of 10, each chunk on 2 of 3 servers: every copy listed, every block
    # restored whole, under its parent
    assert r["chunks_seen"] == 3000 * 2 * 2 and r["restored"] == r["blocks_after"] == 3000 and r["incomplete"] == 0
    assert r["seconds"] > 0 and r["seconds_per_million"] == pytest.approx(r["seconds"] / 3000 * 1e6)
    assert r["seconds_per_million_with_seals"] > r["seconds_per_million"] and r["seal_check_us"] > 0
    assert r["health_probe_during"]["count"] > 0
