"""The admission controller's estimates and decisions (pure logic)."""

import pytest

from kvfs.engine.admission import AdmissionController, Ewma, PrefillModel, Throughput

BLOCK = 64 * 8 * 576 * 2  # bytes of one `bench` block


def test_prefill_model_recovers_linear_and_quadratic_costs():
    m = PrefillModel()
    a, b = 2e-4, 3e-9
    for start, end in [(0, 2048), (0, 8192), (4096, 8192), (0, 512), (1000, 1500)]:
        m.observe(start, end, a * (end - start) + b * (end * end - start * start))
    assert m.a == pytest.approx(a, rel=1e-6) and m.b == pytest.approx(b, rel=1e-6)
    assert m.seconds(0, 32768) == pytest.approx(a * 32768 + b * 32768**2, rel=1e-6)
    assert m.seconds(100, 100) == 0


def test_prefill_model_with_one_observation_is_linear():
    m = PrefillModel()
    m.observe(0, 1000, 0.5)
    assert (m.a, m.b) == (pytest.approx(5e-4), 0.0)


def controller(policy="adaptive", read_gbps=1.0, queued=0, layer_lag=0.0):
    """A controller that has seen prefills, and restores whose layers came in order (lag 0)."""
    c = AdmissionController(policy=policy, read_bandwidth=Throughput(initial=read_gbps * 1e9),
                            layer_lag=Ewma(initial=layer_lag))
    for start, end in [(0, 2048), (0, 8192), (0, 512)]:
        c.prefill_done(start, end, 2e-4 * (end - start) + 3e-9 * (end * end - start * start))
    c.queued_bytes = queued
    return c


def test_an_idle_read_path_restores_everything():
    d = controller().decide(matched_blocks=128, prompt_tokens=128 * 64, bytes_per_block=BLOCK)
    assert d.kind == "restore" and d.restore_blocks == 128
    assert d.est_ttft == d.est_restore_all < d.est_recompute_all


def test_a_saturated_read_path_recomputes_short_prompts():
    d = controller(queued=20 << 30).decide(matched_blocks=8, prompt_tokens=8 * 64 + 10, bytes_per_block=BLOCK)
    assert d.kind == "recompute" and d.restore_blocks == 0
    assert d.est_ttft == d.est_recompute_all < d.est_restore_all


def test_a_busy_read_path_restores_a_leading_part():
    # restoring all 512 blocks waits ~2.5 s behind the queue; recomputing all takes ~10 s;
    # restoring part while computing the rest beats both
    c = controller(read_gbps=0.2, queued=200 << 20)
    d = c.decide(matched_blocks=512, prompt_tokens=512 * 64, bytes_per_block=BLOCK)
    assert d.kind == "partial" and 0 < d.restore_blocks < 512
    assert d.est_ttft < min(d.est_restore_all, d.est_recompute_all)
    assert c.decisions == {"partial": 1}


@pytest.mark.parametrize("policy,kind", [("always-restore", "restore"), ("always-recompute", "recompute")])
def test_fixed_policies_ignore_the_estimates(policy, kind):
    c = controller(policy=policy, queued=20 << 30 if policy == "always-restore" else 0)
    assert c.decide(matched_blocks=16, prompt_tokens=16 * 64, bytes_per_block=BLOCK).kind == kind


def test_queue_and_bandwidth_follow_what_the_engine_reports():
    c = AdmissionController()
    c.restore_issued(100 << 20)
    c.restore_issued(50 << 20)
    assert c.queued_bytes == 150 << 20
    c.restore_finished(100 << 20, 0.1)
    assert c.queued_bytes == 50 << 20
    # the prior (1 GB/s for 0.1 s), halved after 0.1 s of a 2 s half-life, beside 100 MiB in 0.1 s
    keep = 0.5 ** (0.1 / 2.0)
    assert c.read_bandwidth.value == pytest.approx((1e8 * keep + (100 << 20)) / (0.1 * keep + 0.1))
    c.restore_finished(0, 0.0, issued=50 << 20)  # a restore that failed still leaves the queue
    assert c.queued_bytes == 0


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy must be one of"):
        AdmissionController(policy="sometimes")


async def test_write_backs_wait_for_restores_and_are_dropped_past_the_bound():
    import asyncio

    from kvfs.engine.admission import WriteBackQueue

    c = AdmissionController()
    idle = asyncio.Event()
    c.on_idle = idle.set
    q = WriteBackQueue(lambda: c.queued_bytes > 0, idle, max_bytes=300, per_tenant_bytes=200)
    ran = []

    def job(name):
        async def run():
            ran.append(name)
            return name
        return run

    c.restore_issued(1000)  # a restore is waiting
    first = q.submit("a", 100, job("a1"))
    second = q.submit("b", 150, job("b1"))
    assert q.submit("b", 100, job("b2")) is None  # tenant b would pass its 200-byte cap
    assert q.submit("c", 100, job("c1")) is None  # the queue would pass 300 bytes
    assert (q.dropped, q.dropped_bytes) == (2, 200)
    await asyncio.sleep(0)
    assert ran == [] and q.deferred == 1  # nothing runs while the restore waits
    c.restore_finished(1000, 0.5)  # the read queue empties: write-backs go, in order
    assert await first == "a1" and await second == "b1"
    await q.drain()
    assert ran == ["a1", "b1"] and q.queued_bytes == 0


def test_compute_queued_ahead_makes_recompute_costlier():
    c = controller(queued=2 << 30)  # a read queue deep enough that recompute wins on an idle engine
    idle = c.decide(matched_blocks=8, prompt_tokens=8 * 64 + 10, bytes_per_block=BLOCK, now=100.0)
    assert idle.kind == "recompute"
    # prefills due before this request's would-be recompute finishes run first
    c.compute_started("other", 100.0, 30.0)
    busy = c.decide(matched_blocks=8, prompt_tokens=8 * 64 + 10, bytes_per_block=BLOCK, now=100.0)
    assert busy.est_recompute_all == pytest.approx(idle.est_recompute_all + 30.0)
    assert busy.kind == "restore"
    c.compute_finished("other")
    assert c.compute_wait(1e9) == 0


def test_read_bandwidth_is_the_paths_throughput_not_one_restores_share():
    c = AdmissionController(read_bandwidth=Throughput(initial=1e9, half_life=1e-4))  # the last sample only
    # four restores of 100 MB issued together; the path delivers 1 GB/s, so they end
    # 0.1 s apart, each having taken 0.1-0.4 s (a share of 250-1000 MB/s)
    for _ in range(4):
        c.restore_issued(100_000_000, now=0.0)
    for i in range(1, 5):
        c.restore_finished(100_000_000, 0.1 * i, now=0.1 * i)
        assert c.read_bandwidth.value == pytest.approx(1e9)
    assert c.queued_bytes == 0
    # idle, then one restore alone: its own rate again
    c.restore_issued(50_000_000, now=10.0)
    c.restore_finished(50_000_000, 0.1, now=10.1)
    assert c.read_bandwidth.value == pytest.approx(5e8)


def test_read_bandwidth_weighs_each_restore_by_the_time_it_covers():
    # a path that delivers 100 MB in 0.3 s, then three 100 MB restores ending 10 ms apart:
    # 400 MB in 0.33 s. A mean of the four rates (0.33, 10, 10, 10 GB/s) would read 7.6 GB/s
    c = AdmissionController(read_bandwidth=Throughput(initial=1e9, half_life=1e6))  # no decay: a plain ratio
    c.read_bandwidth.bytes = c.read_bandwidth.seconds = 0.0  # no prior
    for _ in range(4):
        c.restore_issued(100_000_000, now=0.0)
    for end in (0.30, 0.31, 0.32, 0.33):
        c.restore_finished(100_000_000, end, now=end)
    assert c.read_bandwidth.value == pytest.approx(400_000_000 / 0.33)


async def test_without_admission_every_block_is_restored_and_write_backs_start_at_once():
    from kvfs.engine.admission import ImmediateWriteBacks, NoAdmission

    none = NoAdmission()
    assert none.decide(7, 500, 1 << 20, now=0.0) is None  # the engine restores all 7
    assert none.prefill.seconds(0, 10) > 0  # the compute queue's deadlines still need a cost model

    ran = []

    async def job():
        ran.append(1)
        return "written"

    task = ImmediateWriteBacks().submit("acme", 1 << 40, job)  # no bound: never dropped
    assert await task == "written" and ran == [1]


def test_servers_backlogs_count_as_restore_bytes_ahead_when_they_say_more():
    from kvfs.client.hedge import ServerBacklog

    c = controller(read_gbps=1.0)
    c.server_backlog = backlog = ServerBacklog()
    idle = c.decide(matched_blocks=8, prompt_tokens=8 * 64 + 10, bytes_per_block=BLOCK)
    assert idle.kind == "restore" and idle.queued_bytes == 0
    c.restore_issued(1 << 20)
    backlog.report("cs-0:1", 512 << 20)  # other workers' reads queued there: half a second at 1 GB/s
    busy = c.decide(matched_blocks=8, prompt_tokens=8 * 64 + 10, bytes_per_block=BLOCK)
    assert busy.queued_bytes == 512 << 20
    assert busy.est_restore_all == pytest.approx(((512 << 20) + 8 * BLOCK) / c.read_bandwidth.value)
    assert busy.kind == "recompute"
    backlog.report("cs-0:1", 0)  # drained: our own restore in flight is what is ahead
    assert c.decide(matched_blocks=8, prompt_tokens=8 * 64 + 10, bytes_per_block=BLOCK).queued_bytes == 1 << 20


def test_a_partial_restore_overlaps_its_compute_only_from_the_first_whole_layer():
    c = controller(read_gbps=0.2, queued=200 << 20)
    overlapped = c.decide(matched_blocks=512, prompt_tokens=512 * 64, bytes_per_block=BLOCK)
    assert overlapped.kind == "partial"
    # restores whose first layer is whole only at their end: reading and computing add up
    for _ in range(40):
        c.restore_finished(0, 1.0, issued=0, first_layer=1.0)
    assert c.layer_lag.value == pytest.approx(1.0, abs=0.01)
    serial = c.decide(matched_blocks=512, prompt_tokens=512 * 64, bytes_per_block=BLOCK)
    restore = c.restore_seconds(serial.restore_blocks * BLOCK)
    compute = c.prefill.seconds(min(serial.restore_blocks * 64, 512 * 64 - 1), 512 * 64)
    assert serial.est_ttft == pytest.approx(max(restore, c.layer_lag.value * restore + compute))
    assert serial.est_ttft > overlapped.est_ttft
    assert serial.restore_blocks == 512 or serial.restore_blocks != overlapped.restore_blocks


def test_a_recompute_is_charged_the_wait_it_adds_to_prefills_queued_behind_it():
    import math

    c = controller(queued=2 << 30)  # a read queue deep enough that recompute wins on an idle engine
    args = dict(matched_blocks=8, prompt_tokens=8 * 64 + 10, bytes_per_block=BLOCK, now=100.0)
    alone = c.decide(**args)
    assert alone.kind == "recompute"
    own = c.prefill.seconds(0, 8 * 64 + 10)
    # misses admitted before it and due after it: each would wait `own` longer
    for i in range(math.ceil(alone.est_restore_all / own) + 1):
        c.compute_started(f"miss-{i}", 1e6, 5.0)
    assert c.compute_behind(100.0 + own) > alone.est_restore_all / own and c.compute_wait(100.0 + own) == 0
    crowded = c.decide(**args)
    assert crowded.kind == "restore"
    assert crowded.est_recompute_all == pytest.approx(alone.est_recompute_all)  # its own estimate is unchanged


def test_prefills_expected_to_arrive_during_a_recompute_are_charged_half_of_it_each():
    import math

    c = controller(queued=2 << 30)
    args = dict(matched_blocks=8, prompt_tokens=8 * 64 + 10, bytes_per_block=BLOCK, now=100.0)
    alone = c.decide(**args)
    assert alone.kind == "recompute"
    own = c.prefill.seconds(0, 8 * 64 + 10)
    # prefills admitted steadily, at a rate where those arriving during the recompute would
    # wait longer in all than the restore takes; each done before the decision
    rate = 4 * alone.est_restore_all / own**2
    for i in range(int(10 * rate)):  # ten seconds of them: the rate's prior (0.1 s of none) is forgotten
        c.compute_started(i, 80.0 + i / rate + 1e-3, 1e-3)
        c.compute_finished(i)
    assert c.prefill_rate.value == pytest.approx(rate, rel=0.05) and not c.compute_ahead
    assert c.decide(**args).kind == "restore"
    assert math.isclose(AdmissionController().layer_lag.value, 0.5)  # a fresh one: neither in order nor not


@pytest.mark.parametrize("each,kind", [(1e-4, "recompute"), (0.08, "restore")])
def test_a_recompute_is_charged_more_the_busier_the_accelerator_is(each, kind):
    # 10 prefills a second, each `each` seconds long and done before the decision: the same
    # arrivals keep the accelerator 0.1% or 80% busy. Restoring 8 blocks waits ~0.2 s behind
    # the read queue, recomputing them takes ~0.1 s. At 80% busy, the prefills that arrive before
    # the accelerator is free again (each of which the recompute delays) are five times as many
    c = controller(queued=int(0.2e9) - 8 * BLOCK)
    rate = 10.0
    for i in range(int(10 * rate)):
        arrived = 80.0 + i / rate
        c.compute_started(i, arrived + each, each)
        c.compute_finished(i)
    assert c.prefill_rate.value == pytest.approx(rate, rel=0.05)
    assert c.prefill_seconds.value == pytest.approx(each, rel=1e-3)
    d = c.decide(matched_blocks=8, prompt_tokens=8 * 64 + 10, bytes_per_block=BLOCK, now=100.0)
    assert d.est_recompute_all < 0.9 * d.est_restore_all  # on its own, recomputing is the faster
    assert d.kind == kind
