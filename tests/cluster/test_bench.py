"""kvfs-bench writes a report of the documented shape (never checked for speed)."""

import json
import subprocess
import sys


def test_io_bench_report_shape(tmp_path):
    out = tmp_path / "io.json"
    proc = subprocess.run([sys.executable, "-m", "kvfs.bench.main", "io", "--chunks", "32", "--rounds", "2",
                           "--concurrency", "4", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["bench"] == "io"
    assert report["config"] == {"chunks": 32, "chunk_bytes": 1 << 20, "batch": 8, "concurrency": 4, "rounds": 2}
    assert [r["mode"] for r in report["results"]] == ["direct", "buffered"]
    for r in report["results"]:
        assert len(r["raw_gbps"]) == len(r["grpc_gbps"]) == 2
        assert all(v > 0 for v in r["raw_gbps"] + r["grpc_gbps"] + [r["write_gbps"]])
        assert abs(r["grpc_over_raw"] - r["grpc_gbps_median"] / r["raw_gbps_median"]) < 1e-9
    assert "ReadChunks / raw" in proc.stdout
