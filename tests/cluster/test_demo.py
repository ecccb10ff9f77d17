"""The README's main job and the local cluster commands, as users run them."""

import json
import os
import subprocess
import sys
import urllib.request

from helpers import wait_until

KVFS = [sys.executable, "-m", "kvfs.cli"]


def cluster_up(data, *flags: str) -> tuple[subprocess.Popen, list[str]]:
    """`kvfs cluster up` running, and what it printed up to its "cluster up" line."""
    up = subprocess.Popen([*KVFS, "cluster", "up", *flags, "--data-dir", str(data)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    while not lines or not lines[-1].startswith("cluster up"):
        line = up.stdout.readline()
        if not line:
            up.kill()
            up.wait()
            raise AssertionError("kvfs cluster up exited early:\n" + "".join(lines))
        lines.append(line)
    return up, lines


def exited(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            pass
    return True


def test_demo_serves_prompts_from_a_real_local_cluster(tmp_path):
    proc = subprocess.run([*KVFS, "demo", "--prompts", "24", "--engine-tokens", "300",
                           "--data-dir", str(tmp_path / "demo"), "--top-svg", str(tmp_path / "top.svg")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "prompts served: 24" in out
    assert "restored bytes checked: all exact" in out
    hit = float(out.split("hit ratio: ")[1].split("%")[0])
    assert 0 < hit < 100
    assert "same answer: yes" in out and "x faster" in out
    assert "cluster stopped" in out
    svg = (tmp_path / "top.svg").read_text()  # the `kvfs top` frame of the workload (docs/kvfs-top.svg)
    assert svg.startswith("<svg") and all(f"{w}" in svg for w in ("hit&#160;ratio", "restore&#160;B/s", "cs-2"))
    for i in range(3):  # every chunkserver took part
        assert list((tmp_path / "demo" / f"cs-{i}" / "slots").glob("*/*.slots"))


def test_cluster_up_status_down(tmp_path):
    data = tmp_path / "cluster"
    up, lines = cluster_up(data, "--chunkservers", "2", "--replicas", "2")
    try:
        assert lines[0].startswith("metaserver 127.0.0.1:")
        assert [l.split()[:2] for l in lines[1:3]] == [["chunkserver", "cs-0"], ["chunkserver", "cs-1"]]
        servers = json.loads((data / "cluster.json").read_text())["servers"]
        pids = [s["pid"] for s in servers.values()]
        metrics = servers["metaserver"]["metrics"]
        assert lines[0].split()[2:] == ["metrics", f"http://{metrics}/metrics"]
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
            assert b'kvfs_meta_servers{state="live"} 2.0' in reply.read()
        for i, line in enumerate(lines[1:3]):
            metrics = servers[f"cs-{i}"]["metrics"]
            assert line.split()[4:] == ["metrics", f"http://{metrics}/metrics"]
            with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
                assert b"kvfs_chunk_chunks 0.0" in reply.read()
        status = subprocess.run([*KVFS, "status", "--data-dir", str(data)], capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, status.stderr
        assert status.stdout.count(" yes ") == 2
        status = subprocess.run([*KVFS, "status", "--json", "--data-dir", str(data)], capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert [(s["id"], s["live"]) for s in json.loads(status.stdout)["servers"]] == [("cs-0", True),
                                                                                        ("cs-1", True)]
        down = subprocess.run([*KVFS, "cluster", "down", "--data-dir", str(data)], capture_output=True,
                              text=True, timeout=60)
        assert down.returncode == 0 and "cluster stopped" in down.stdout
        assert up.wait(timeout=30) == 0
        wait_until(lambda: exited(pids), 10, "every server process to exit")
        assert not (data / "cluster.json").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_cluster_up_with_two_metaservers_starts_and_stops_etcd_too(tmp_path):
    data = tmp_path / "cluster"
    up, lines = cluster_up(data, "--metaservers", "2", "--chunkservers", "2")
    try:
        assert [l.split()[0] for l in lines[:3]] == ["metaserver", "metaserver-1", "etcd"]
        assert lines[-1].startswith("cluster up (2 metaservers, 2 chunkservers")
        state = json.loads((data / "cluster.json").read_text())
        assert state["metaservers"].split(",") == [lines[0].split()[1], lines[1].split()[1]]
        pids = [s["pid"] for s in state["servers"].values()]
        assert set(state["servers"]) == {"metaserver", "metaserver-1", "cs-0", "cs-1", "etcd"}
        status = subprocess.run([*KVFS, "status", "--data-dir", str(data)], capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0 and status.stdout.count(" yes ") == 2, status.stdout + status.stderr
        down = subprocess.run([*KVFS, "cluster", "down", "--data-dir", str(data)], capture_output=True,
                              text=True, timeout=60)
        assert down.returncode == 0 and "cluster stopped" in down.stdout
        assert up.wait(timeout=30) == 0
        wait_until(lambda: exited(pids), 10, "every server process, etcd too, to exit")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
