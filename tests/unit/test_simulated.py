"""Simulated compute: the cost model's arithmetic, and a model that sleeps its share."""

import time

import pytest
import torch

from kvfs.engine.simulated import MODELS, SimulatedModel, simulated


def test_prefill_cost_adds_up_over_chunks_and_matches_its_calibration():
    v3 = simulated("deepseek-v3")
    whole = v3.prefill_seconds(0, 10_000)
    assert v3.prefill_seconds(0, 4096) + v3.prefill_seconds(4096, 10_000) == pytest.approx(whole)
    assert v3.prefill_seconds(5, 5) == 0.0
    assert v3.prefill_seconds(0, 131_072) == pytest.approx(13.0, rel=0.01)  # the figure it was fitted to
    # a token late in a long prompt costs more than one early: attention grows with the context
    assert v3.prefill_seconds(100_000, 100_001) > 5 * v3.prefill_seconds(0, 1)
    assert v3.shapes.block_layout().payload_bytes == 61 * 64 * 576 * 2
    with pytest.raises(ValueError, match="unknown simulated compute"):
        simulated("gpt-9")


def test_a_simulated_model_yields_every_layer_and_sleeps_the_modelled_time():
    compute = MODELS["deepseek-v3"]
    model = SimulatedModel(compute)
    t0 = time.perf_counter()
    steps = list(model.steps(torch.zeros(2048, dtype=torch.long), None, 0))
    elapsed = time.perf_counter() - t0
    assert [k for k, _ in steps] == ["layer"] * 61 + ["logits"]
    assert [v for k, v in steps if k == "layer"] == list(range(61))
    assert int(steps[-1][1][-1].argmax()) == 0
    assert elapsed >= compute.prefill_seconds(0, 2048)  # sleep never returns early
    assert int(model(torch.zeros(1, dtype=torch.long), None, 2048)[-1].argmax()) == 0


def test_a_scaled_accelerator_takes_that_many_times_as_long():
    v3, slow = simulated("deepseek-v3"), simulated("deepseek-v3", 10)
    assert slow.prefill_seconds(0, 8192) == pytest.approx(10 * v3.prefill_seconds(0, 8192))
    assert slow.prefill_seconds(4096, 8192) == pytest.approx(10 * v3.prefill_seconds(4096, 8192))
    assert slow.decode_s == pytest.approx(10 * v3.decode_s)
    assert slow.scaled(2).prefill_seconds(0, 100) == pytest.approx(20 * v3.prefill_seconds(0, 100))
    assert (v3.label, slow.label, slow.shapes) == ("deepseek-v3", "deepseek-v3 10x slower", v3.shapes)
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="compute scale must be positive"):
            simulated("deepseek-v3", bad)
