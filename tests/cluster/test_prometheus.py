"""A real Prometheus (Debian's `prometheus`; .ci/run installs it) scrapes a local
cluster through a demo-sized workload; what its query API reports must be what
the client measured: the hit ratio, the bytes restored, the calls timed. And every
query of the shipped Grafana dashboard must evaluate there."""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from helpers import dashboard_queries, free_port, layer_major, restore_all, tokens_for, wait_until

NS = Namespace("acme", "deepseek-v2-lite")
SMALL = BlockLayout(layers=6, block_tokens=64, kv_dim=64, dtype="bfloat16")  # 48 KiB blocks, one chunk each
CHECKSUM_BLOCK = 64 * 1024  # the data port reads and verifies whole blocks of this size
DASHBOARD = pathlib.Path(__file__).parents[2] / "deploy" / "grafana" / "kvfs.json"


class Prometheus:
    """A `prometheus` process on a loopback port, and its HTTP query API."""

    def __init__(self, proc: subprocess.Popen, address: str, log_path: pathlib.Path):
        self.proc = proc
        self.address = address
        self.log_path = log_path

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://{self.address}{path}", timeout=10) as reply:
            return json.loads(reply.read())

    def query(self, expr: str) -> dict[tuple, float]:
        """An instant query's vector: sorted label pairs -> value."""
        reply = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert reply["status"] == "success", (expr, reply)
        assert reply["data"]["resultType"] == "vector", (expr, reply["data"]["resultType"])
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in reply["data"]["result"]}

    def value(self, expr: str) -> float | None:
        """The one value of a query without labels left (None: no series yet)."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return next(iter(result.values()), None)

    def by(self, label: str, expr: str) -> dict[str, float]:
        return {dict(labels)[label]: v for labels, v in self.query(expr).items()}

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False


@pytest.fixture
def prometheus(tmp_path):
    """Factory: prometheus(targets={job: [host:port, ...]}) starts a real Prometheus
    scraping them every second; stopped at teardown."""
    binary = shutil.which("prometheus")
    assert binary, "no `prometheus` on the PATH: apt-get install prometheus (.ci/run does)"
    started: list[subprocess.Popen] = []

    def start(targets: dict[str, list[str]]) -> Prometheus:
        config = tmp_path / "prometheus.yml"  # JSON is YAML
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": addresses}]}
                               for job, addresses in targets.items()]}))
        address = f"127.0.0.1:{free_port()}"
        log_path = tmp_path / "prometheus.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address={address}", "--log.level=warn"],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started.append(proc)
        server = Prometheus(proc, address, log_path)
        wait_until(server.ready, 60, "prometheus to be ready", interval=0.1)
        return server

    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclasses.dataclass
class Measured:
    """What the client saw: per lookup its keys and matches, per transport its restores."""

    lookups: int = 0
    requested: int = 0
    matched: int = 0
    writes: int = 0
    restores: dict = dataclasses.field(default_factory=dict)  # transport -> count
    restored_bytes: dict = dataclasses.field(default_factory=dict)  # transport -> payload bytes
    restored_chunks: dict = dataclasses.field(default_factory=dict)  # transport -> chunks

    async def lookup(self, client: Client, tokens: list[int]):
        match = await client.lookup(NS, tokens)
        self.lookups += 1
        self.requested += len(match.keys)
        self.matched += match.matched
        return match


async def demo_workload(meta_address: str) -> Measured:
    """Writes three prompts, looks up hits, partial hits and a miss, and restores
    every prompt over TCP and over shared memory."""
    seen = Measured()
    prompts = [tokens_for(n, seed=40 + n) for n in (8, 6, 4)]
    async with Client(meta_address) as client:
        for tokens in prompts:
            blocks = len(tokens) // 64
            payload = layer_major(SMALL, [os.urandom(SMALL.payload_bytes) for _ in range(blocks)])
            assert (await client.write(NS, tokens, payload, SMALL)).committed == blocks
            seen.writes += 1
        for tokens in prompts:
            assert (await seen.lookup(client, tokens)).matched == len(tokens) // 64
        assert (await seen.lookup(client, prompts[0] + tokens_for(4, seed=99))).matched == 8  # 8 of 12
        assert (await seen.lookup(client, tokens_for(5, seed=98))).matched == 0  # a miss
        assert (await seen.lookup(client, prompts[1][: 3 * 64])).matched == 3
    for transport in ("tcp", "shm"):
        async with Client(meta_address, transport=transport, hedge=False) as client:
            for tokens in prompts:
                match = await seen.lookup(client, tokens)
                _, _, stats = await restore_all(client, match, SMALL)
                assert stats.bytes == match.nbytes and stats.retries == stats.hedges == 0
                seen.restores[transport] = seen.restores.get(transport, 0) + 1
                seen.restored_bytes[transport] = seen.restored_bytes.get(transport, 0) + stats.bytes
                seen.restored_chunks[transport] = seen.restored_chunks.get(transport, 0) + stats.chunks
    return seen


def settled(prom: Prometheus, expr: str, ok, what: str, timeout: float = 30):
    """Polls `expr` until `ok(value)`: Prometheus scrapes each target once a second,
    so what a workload did shows within a scrape or two after it."""
    last = []

    def check():
        last[:] = [prom.value(expr)]
        return last[0] is not None and ok(last[0])

    try:
        wait_until(check, timeout, what, interval=0.2)
    except AssertionError as err:
        raise AssertionError(f"{err}; {expr} was {last[0] if last else None}") from None
    return last[0]


async def test_prometheus_reports_what_the_client_measured(local_cluster, prometheus):
    cluster = local_cluster(chunkservers=3)
    prom = prometheus({"kvfs-metaserver": [cluster.meta.metrics_address],
                       "kvfs-chunkserver": [cs.metrics_address for cs in cluster.chunkservers]})
    settled(prom, "count(up == 1)", lambda n: n == 4, "every server scraped")
    assert prom.by("job", "count by (job) (up)") == {"kvfs-metaserver": 1, "kvfs-chunkserver": 3}

    seen = await demo_workload(cluster.meta_address)
    assert (seen.lookups, seen.requested, seen.matched) == (12, 38 + 36, 29 + 36)

    # the hit ratio: both counters from the same scrape of the metaserver, so once the
    # last lookups show, their ratio is exactly the client's
    settled(prom, "kvfs_meta_lookup_blocks_requested_total", lambda v: v == seen.requested, "requested blocks")
    settled(prom, "kvfs_meta_lookup_blocks_matched_total", lambda v: v == seen.matched, "matched blocks")
    assert prom.value("kvfs_meta_lookup_blocks_matched_total / kvfs_meta_lookup_blocks_requested_total") == \
        seen.matched / seen.requested
    assert prom.value("kvfs_meta_lookups_total") == seen.lookups

    # the metaserver's latency histograms: one observation per call the client made
    for method, calls in (("MatchPrefix", seen.lookups), ("AllocateBlocks", seen.writes),
                          ("CommitBlocks", seen.writes)):
        settled(prom, f'kvfs_meta_rpc_seconds_count{{method="{method}"}}', lambda v, c=calls: v == c, method)
        assert prom.value(f'kvfs_meta_rpc_seconds_bucket{{method="{method}",le="+Inf"}}') == calls
        assert prom.value(f'kvfs_meta_rpc_seconds_sum{{method="{method}"}}') > 0
    p99 = prom.value('histogram_quantile(0.99, sum by (le) (kvfs_meta_rpc_seconds_bucket{method="MatchPrefix"}))')
    assert 0 < p99 <= 10  # within the buckets

    # restore bytes, summed over the chunkservers: the data port reads and sends whole
    # 64 KiB checksum blocks, so a 48 KiB chunk costs the server 64 KiB: at least what
    # the client restored, and less than two checksum blocks more per chunk
    for transport in ("tcp", "shm"):
        wanted, chunks = seen.restored_bytes[transport], seen.restored_chunks[transport]
        served = settled(prom, f'sum(kvfs_chunk_read_bytes_total{{transport="{transport}"}})',
                         lambda v, w=wanted: v >= w, f"{transport} restore bytes")
        assert served < wanted + 2 * CHECKSUM_BLOCK * chunks, transport
        # one read request per batch of chunks to a server: at least one per restore, at most one per chunk
        requests = settled(prom, f'sum(kvfs_chunk_read_seconds_count{{transport="{transport}"}})',
                           lambda v, r=seen.restores[transport]: v >= r, f"{transport} read requests")
        assert requests <= chunks, transport
    assert prom.value("sum(kvfs_chunk_read_bytes_total)") >= sum(seen.restored_bytes.values())
    assert prom.by("transport", "sum by (transport) (kvfs_chunk_read_seconds_count)")["grpc"] == 0
    assert prom.by("transport", "sum by (transport) (kvfs_chunk_read_bytes_total)")["local"] == 0
    # a histogram's +Inf bucket is its count, within one evaluation
    assert set(prom.by("transport", "sum by (transport) (kvfs_chunk_read_seconds_count) - sum by (transport) "
                                    "(kvfs_chunk_read_seconds_bucket{le=\"+Inf\"})").values()) == {0}

    # the dashboard: every query parses and finds series in a real cluster's metrics
    queries = dashboard_queries(DASHBOARD)
    assert queries
    deadline = time.monotonic() + 30
    for title, expr in queries:
        series = wait_until(lambda e=expr: prom.query(e.replace("$__rate_interval", "1m")),
                            max(1.0, deadline - time.monotonic()), f"dashboard panel {title!r}: {expr}")
        assert series, (title, expr)
