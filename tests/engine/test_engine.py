"""The engine on a real local cluster: restored prefixes give the answers a
recompute gives."""

import subprocess
import time
import sys

import pytest
import torch

from kvfs.client import BufferPool, Client
from kvfs.engine import Engine, KVCache, ModelConfig
from kvfs.keys import Namespace

from helpers import tokens_for

TINY = ModelConfig.preset("tiny")  # bf16: the dtype kvfs stores
NS = Namespace("acme", "tiny-mla", "mla-bf16")


def two_phase_reference(model, tokens, split):
    """Prefix then suffix on a local cache: the same arithmetic as a restore-then-prefill."""
    cache = KVCache(model.cfg, len(tokens) + 8)
    if split:
        model(torch.tensor(tokens[:split]), cache, 0)
    return model(torch.tensor(tokens[split:]), cache, split)[-1]


@pytest.fixture
def pool():
    return BufferPool(arena_bytes=64 << 20)


@pytest.mark.parametrize("length", [128, 150, 64 * 3 - 1])  # ends on a block boundary, inside, just before
async def test_restored_prefix_gives_bitwise_identical_logits(local_cluster, pool, length):
    cluster = local_cluster()
    tokens = [t % 256 for t in tokens_for(0, seed=length, tail=length)]
    async with Client(cluster.meta_address) as client:
        first = Engine(TINY, client, NS, pool=pool)
        miss = await first.agenerate(tokens, max_new_tokens=4)
        await miss.write_back
        assert miss.timings.tokens_matched == 0 and miss.timings.bytes_written > 0
        second = Engine(TINY, client, NS, pool=pool)  # another engine: only kvfs connects them
        hit = await second.agenerate(tokens, max_new_tokens=4)
        full_blocks = length // 64
        assert hit.timings.tokens_matched == full_blocks * 64
        assert hit.timings.bytes_restored == full_blocks * TINY.block_layout().payload_bytes
        assert hit.tokens == miss.tokens
        split = min(full_blocks * 64, length - 1)
        assert torch.equal(hit.first_logits, two_phase_reference(second.model, tokens, split))
        # against one full prefill the arithmetic is grouped differently: bf16 rounding only
        torch.testing.assert_close(hit.first_logits, miss.first_logits, rtol=0.05, atol=0.05)
        for e in (first, second):
            e.close()


async def test_partial_hit_restores_the_shared_blocks_only(local_cluster, pool):
    cluster = local_cluster()
    base = [t % 256 for t in tokens_for(3, seed=1)]
    other = base[:64] + [t % 256 for t in tokens_for(2, seed=2)]  # shares the first block only
    async with Client(cluster.meta_address) as client:
        engine = Engine(TINY, client, NS, pool=pool)
        await (await engine.agenerate(base, 2)).write_back
        hit = await engine.agenerate(other, 2)
        assert hit.timings.tokens_matched == 64
        assert hit.timings.decision is None  # no admission controller: every matched block, nothing decided
        assert torch.equal(hit.first_logits, two_phase_reference(engine.model, other, 64))
        await hit.write_back
        assert (await client.lookup(NS, other)).matched == 3  # its new blocks were written back
        engine.close()


WRITER = """
import asyncio, sys
from kvfs.client import Client
from kvfs.engine import Engine, ModelConfig
from kvfs.keys import Namespace
async def main():
    async with Client(sys.argv[1]) as client:
        engine = Engine(ModelConfig.preset("tiny"), client, Namespace("acme", "tiny-mla", "mla-bf16"))
        result = await engine.agenerate([int(t) for t in sys.argv[2].split(",")], 3)
        await result.write_back
        print(",".join(map(str, result.tokens)))
asyncio.run(main())
"""


async def test_a_prefix_written_by_another_process_is_restored_exactly(local_cluster, pool):
    cluster = local_cluster()
    tokens = [t % 256 for t in tokens_for(4, seed=3, tail=10)]
    proc = subprocess.run([sys.executable, "-c", WRITER, cluster.meta_address, ",".join(map(str, tokens))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    async with Client(cluster.meta_address) as client:
        engine = Engine(TINY, client, NS, pool=pool)
        hit = await engine.agenerate(tokens, 3)
        assert hit.timings.tokens_matched == 256
        assert hit.tokens == [int(t) for t in proc.stdout.strip().split(",")]
        assert torch.equal(hit.first_logits, two_phase_reference(engine.model, tokens, 256))
        engine.close()


async def test_a_restore_that_fails_midway_is_recomputed_and_right(local_cluster, pool):
    cluster = local_cluster()
    tokens = [t % 256 for t in tokens_for(6, seed=4, tail=3)]
    async with Client(cluster.meta_address) as client:
        engine = Engine(TINY, client, NS, pool=pool)
        miss = await engine.agenerate(tokens, 3)
        await miss.write_back
        cluster.chunkservers[0].kill()
        cluster.chunkservers[1].kill()
        print("injected: SIGKILL cs-0 and cs-1; chunks on that pair have no live replica")
        hit = await engine.agenerate(tokens, 3)
        assert hit.timings.recomputed_after_failed_restore
        assert hit.tokens == miss.tokens and torch.equal(hit.first_logits, miss.first_logits)
        engine.close()


def test_sync_generate_with_a_sync_client(local_cluster, pool):
    from kvfs.client import SyncClient

    cluster = local_cluster()
    with SyncClient(cluster.meta_address) as client:
        engine = Engine(TINY, client, NS, pool=pool)
        result = engine.generate(list(b"hello kvfs, " * 20), max_new_tokens=5)
        assert len(result.tokens) == 5 and result.timings.ttft > 0
        engine.close()


async def test_chunked_prefill_matches_one_pass(local_cluster, pool, monkeypatch):
    import kvfs.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 64)
    cfg = TINY.with_(dtype="float32")
    cluster = local_cluster()
    tokens = [t % 256 for t in tokens_for(4, seed=9, tail=44)]  # 300 tokens: five chunks
    async with Client(cluster.meta_address) as client:
        engine = Engine(cfg, client, Namespace("acme", "tiny-mla", "mla-f32"), pool=pool, write_back=False)
        result = await engine.agenerate(tokens, 1)
        one_pass = engine.model(torch.tensor(tokens), KVCache(cfg, 310), 0)[-1]
        torch.testing.assert_close(result.first_logits, one_pass, rtol=1e-4, atol=1e-5)
        engine.close()


async def test_concurrent_requests_get_the_answers_they_get_alone(local_cluster, pool):
    import asyncio

    cluster = local_cluster()
    prompts = [[t % 256 for t in tokens_for(2, seed=20 + i, tail=5 * i)] for i in range(3)]
    async with Client(cluster.meta_address) as client:
        engine = Engine(TINY, client, NS, pool=pool, write_back=False)
        alone = [await engine.agenerate(p, 4) for p in prompts]
        together = await asyncio.gather(*(engine.agenerate(p, 4) for p in prompts))
        assert [r.tokens for r in together] == [r.tokens for r in alone]
        assert all(torch.equal(a.first_logits, b.first_logits) for a, b in zip(alone, together))
        engine.close()


async def test_a_failed_write_back_is_logged_and_the_request_still_answers(local_cluster, pool, caplog):
    cluster = local_cluster()
    tokens = [t % 256 for t in tokens_for(3, seed=30)]
    for cs in cluster.chunkservers:
        cs.kill()  # the metaserver still counts them live for a few seconds: allocation succeeds, writes fail
    async with Client(cluster.meta_address) as client:
        engine = Engine(TINY, client, NS, pool=pool)
        result = await engine.agenerate(tokens, 3)
        assert len(result.tokens) == 3
        await result.write_back  # finishes without raising
        assert result.timings.bytes_written == 0
        assert "write-back of 3 blocks failed" in caplog.text
        engine.close()


@pytest.mark.parametrize("policy,queued,kind", [("always-recompute", 0, "recompute"),
                                                ("always-restore", 0, "restore"),
                                                ("adaptive", 1 << 40, "recompute")])
async def test_admission_decides_how_much_to_restore(local_cluster, pool, policy, queued, kind):
    from kvfs.engine.admission import AdmissionController

    cluster = local_cluster()
    tokens = [t % 256 for t in tokens_for(4, seed=40, tail=7)]
    async with Client(cluster.meta_address) as client:
        writer = Engine(TINY, client, NS, pool=pool)
        miss = await writer.agenerate(tokens, 3)
        await miss.write_back
        admission = AdmissionController(policy=policy)
        admission.queued_bytes = queued  # e.g. a read queue so deep that waiting loses to recompute
        engine = Engine(TINY, client, NS, pool=pool, admission=admission, write_back=False)
        result = await engine.agenerate(tokens, 3)
        assert result.timings.decision.kind == kind and admission.decisions[kind] == 1
        assert result.timings.bytes_restored == (0 if kind == "recompute" else 4 * TINY.block_layout().payload_bytes)
        assert result.tokens == miss.tokens
        for e in (writer, engine):
            e.close()


async def test_a_partial_restore_computes_the_rest_exactly(local_cluster, pool):
    from kvfs.engine.admission import AdmissionController, Decision

    class RestoreTwo(AdmissionController):
        def decide(self, matched_blocks, prompt_tokens, bytes_per_block, now=None):
            return Decision("test", "partial", 2, matched_blocks, 0.0, 0.0, 0.0, 1.0, 0)

    cluster = local_cluster()
    tokens = [t % 256 for t in tokens_for(5, seed=41, tail=3)]
    async with Client(cluster.meta_address) as client:
        await (await Engine(TINY, client, NS, pool=pool).agenerate(tokens, 2)).write_back
        engine = Engine(TINY, client, NS, pool=pool, admission=RestoreTwo())
        result = await engine.agenerate(tokens, 2)
        assert result.timings.tokens_matched == 128
        assert result.timings.bytes_restored == 2 * TINY.block_layout().payload_bytes
        assert torch.equal(result.first_logits, two_phase_reference(engine.model, tokens, 128))
        # the 3 blocks it recomputed were cached all along: nothing to write back
        assert result.write_back is None and engine.writebacks.queued_bytes == 0
        engine.close()


async def test_client_and_engine_metrics_count_what_the_requests_did(local_cluster, pool):
    """ClientMetrics and EngineCollector on one registry, as a worker's exporter
    would serve them: every figure equals what the requests report."""
    from prometheus_client import CollectorRegistry

    from kvfs.client import ClientMetrics
    from kvfs.engine.admission import AdmissionController
    from kvfs.engine.metrics import EngineCollector

    cluster = local_cluster()
    registry = CollectorRegistry()
    tokens = [t % 256 for t in tokens_for(4, seed=42, tail=7)]
    other = [t % 256 for t in tokens_for(3, seed=43)]
    async with Client(cluster.meta_address, metrics=ClientMetrics(registry)) as client:
        engine = Engine(TINY, client, NS, pool=pool, admission=AdmissionController(policy="always-restore"))
        registry.register(EngineCollector(engine))
        miss = await engine.agenerate(tokens, 2)
        await miss.write_back
        hit = await engine.agenerate(tokens, 2)
        engine.writebacks.max_bytes = 0  # a full queue: the next write-back is dropped
        dropped = await engine.agenerate(other, 2)
        engine.close()
    value = registry.get_sample_value
    block = TINY.block_layout().payload_bytes
    assert value("kvfs_client_lookups_total") == 3
    assert value("kvfs_client_lookup_blocks_total", {"result": "requested"}) == 4 + 4 + 3
    assert value("kvfs_client_lookup_blocks_total", {"result": "matched"}) == hit.timings.tokens_matched // 64 == 4
    assert value("kvfs_client_lookup_seconds_count") == 3
    assert value("kvfs_client_restores_total", {"outcome": "ok"}) == 1
    assert value("kvfs_client_restore_seconds_count") == 1
    assert sum(value("kvfs_client_restore_bytes_total", {"transport": t}) or 0 for t in ("grpc", "tcp", "shm")) \
        == hit.timings.bytes_restored == 4 * block
    assert value("kvfs_client_writes_total", {"outcome": "ok"}) == 1
    assert value("kvfs_client_write_blocks_total") == 4
    assert value("kvfs_client_write_bytes_total") == miss.timings.bytes_written == 4 * block
    assert value("kvfs_engine_admission_decisions_total", {"decision": "restore"}) == 1
    assert value("kvfs_engine_admission_decisions_total", {"decision": "recompute"}) == 0
    assert dropped.timings.write_back_dropped
    assert value("kvfs_engine_write_backs_dropped_total") == 1
    assert value("kvfs_engine_write_back_dropped_bytes_total") == 3 * block


async def test_layers_that_wait_for_nothing_share_a_compute_job(local_cluster):
    """A miss's prefill runs its layers back to back in few compute jobs (LAYER_SLICE_S).
    The simulated DeepSeek-V3 (61 layers, a few ms for 192 tokens) shows it; its cache
    bytes really move."""
    from kvfs.engine.simulated import simulated

    sim = simulated("deepseek-v3")
    cluster = local_cluster()
    tokens = tokens_for(3, seed=4)
    async with Client(cluster.meta_address) as client:
        engine = Engine(sim.shapes, client, Namespace("acme", "sim", "v3"), pool=BufferPool(arena_bytes=0),
                        simulated=sim)
        jobs = []
        run = engine.compute.run
        engine.compute.run = lambda deadline, fn: jobs.append(fn) or run(deadline, fn)
        miss = await engine.agenerate(tokens, 1)
        await miss.write_back
        assert miss.timings.bytes_written == 3 * sim.shapes.block_layout().payload_bytes
        assert len(jobs) < 10  # not 62: 61 layers and the logits
        hit = await engine.agenerate(tokens, 1)
        assert hit.timings.bytes_restored == 3 * sim.shapes.block_layout().payload_bytes
        engine.close()


async def test_a_hit_computes_the_layers_restored_so_far_in_one_job(local_cluster):
    """The restore here has layers 0-9 in at once and the rest once layer 10 is waited
    for: the last token's prefill runs layers 0-9 in one compute job, then the other 51
    and the logits in a second (a job a layer, it was 62)."""
    from kvfs.engine.simulated import simulated

    class Restore:
        upto = 9

        async def layer_ready(self, layer):
            assert not self.ready(layer)  # waited for only when not in yet
            self.upto = 60

        def ready(self, layer):
            return layer <= self.upto

    sim = simulated("deepseek-v3")
    cluster = local_cluster()
    async with Client(cluster.meta_address) as client:
        engine = Engine(sim.shapes, client, Namespace("acme", "sim", "v3"), pool=BufferPool(arena_bytes=0),
                        simulated=sim)
        jobs = []
        run = engine.compute.run

        async def counted(deadline, fn):
            step = await run(deadline, fn)
            jobs.append(step[0])
            return step

        engine.compute.run = counted
        tokens = tokens_for(3, seed=4)
        restore = Restore()
        logits, _, _ = await engine._prefill(tokens, KVCache(sim.shapes, len(tokens)), len(tokens) - 1, restore,
                                             time.perf_counter())
        assert logits is not None and restore.upto == 60
        assert jobs == [("layer", 10), ("logits", logits)]
        engine.close()


async def test_an_engine_with_admission_starts_from_its_model_s_measured_speed(local_cluster):
    """Two short prefills at start seed the prefill model: on a simulated GPU a 2K-token
    recompute is some 40 ms, which the CPU-sized prior puts at 2 s."""
    from kvfs.engine.admission import AdmissionController, PrefillModel
    from kvfs.engine.simulated import simulated

    sim = simulated("deepseek-v3")
    cluster = local_cluster()
    async with Client(cluster.meta_address) as client:
        engine = Engine(sim.shapes, client, Namespace("acme", "sim", "v3"), pool=BufferPool(arena_bytes=0),
                        admission=AdmissionController(), simulated=sim)
        prior = PrefillModel().seconds(0, 2048)
        assert len(engine.prefill_cost._obs) == 2
        assert sim.prefill_seconds(0, 2048) / 2 < engine.prefill_cost.seconds(0, 2048) < prior / 2
        engine.close()
        plain = Engine(TINY, client, NS, pool=BufferPool(arena_bytes=0))
        assert len(plain.prefill_cost._obs) == 0  # without admission nothing is timed at start
        plain.close()


async def test_the_controller_hears_of_a_restore_when_it_ends_not_when_the_prefill_beside_it_does(local_cluster):
    """A partial restore's compute outlasts it: its bytes leave the read queue (and its
    rate is sampled) as the last of them lands, while the prefill still runs."""
    from kvfs.engine.admission import AdmissionController, Decision
    from kvfs.engine.simulated import simulated

    sim = simulated("deepseek-v3", 400)  # the 2 blocks and tail recomputed take about a second
    heard = []

    class RestoreOne(AdmissionController):
        def decide(self, matched_blocks, prompt_tokens, bytes_per_block, now=None):
            return Decision("test", "partial", 1, matched_blocks, 0.0, 0.0, 0.0, 1.0, 0)

        def restore_finished(self, nbytes, seconds, issued=None, now=None, first_layer=None):
            super().restore_finished(nbytes, seconds, issued, now, first_layer)
            heard.append((time.perf_counter(), nbytes, self.queued_bytes))

    cluster = local_cluster()
    tokens = tokens_for(3, seed=5, tail=3)
    async with Client(cluster.meta_address) as client:
        writer = Engine(sim.shapes, client, Namespace("acme", "sim", "v3"), pool=BufferPool(arena_bytes=0),
                        simulated=sim.scaled(1 / 400))
        await (await writer.agenerate(tokens, 1)).write_back
        writer.close()
        engine = Engine(sim.shapes, client, Namespace("acme", "sim", "v3"), pool=BufferPool(arena_bytes=0),
                        admission=RestoreOne(), simulated=sim, write_back=False)
        heard.clear()  # the start's timing prefills restore nothing
        result = await engine.agenerate(tokens, 1)
        done = time.perf_counter()
        assert result.timings.bytes_restored == sim.shapes.block_layout().payload_bytes
        (at, nbytes, queued), = heard
        assert (nbytes, queued) == (sim.shapes.block_layout().payload_bytes, 0)
        assert done - at > 0.5  # heard while most of the prefill was still to run
        engine.close()
