"""Simulated compute: a GPU's prefill and decode time for an MLA model, in place
of the model, for benchmarks only (`kvfs-bench restore --compute NAME`).

On this project's CPUs a restore is tens to hundreds of times faster than
recomputing, so "always restore" is nearly always right and the admission
controller has nothing to decide. A GPU fleet lives elsewhere: prefill is fast,
and storage, network and queues are what run out. A `SimulatedModel` stands in
for the model there: each layer job sleeps on the engine's compute thread for
its share of the modelled prefill time, so requests still queue for one
accelerator in the compute queue's order, while every byte of the cache is
really restored and written back (its values are whatever the buffer held:
nothing reads them). The first token is token 0.

The cost of prefilling tokens [start, end) of a prompt, one accelerator:

    seconds = sum over positions p in [start, end) of (1 + p / attention_context) / tokens_per_s

a token's dense work plus its attention to the p tokens before it, which equals
the dense work at p = attention_context. Never the default: the engine runs its
real model unless given one of these.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass(frozen=True, slots=True)
class SimulatedCompute:
    name: str
    shapes: ModelConfig  # the model whose cache is restored and written (its layers and width)
    tokens_per_s: float  # prefill at short context
    attention_context: float  # context where a token's attention costs as much as its dense work
    decode_s: float  # per generated token
    source: str  # where the figures come from
    scale: float = 1.0  # how many times slower than those figures (scaled())

    def scaled(self, factor: float) -> SimulatedCompute:
        """This accelerator `factor` times slower, prefill and decode alike."""
        if not factor > 0:
            raise ValueError(f"a compute scale must be positive, not {factor}")
        return dataclasses.replace(self, tokens_per_s=self.tokens_per_s / factor, decode_s=self.decode_s * factor,
                                   scale=self.scale * factor)

    @property
    def label(self) -> str:
        return self.name if self.scale == 1 else f"{self.name} {self.scale:g}x slower"

    def prefill_seconds(self, start: int, end: int) -> float:
        if end <= start:
            return 0.0
        dense = end - start
        attention = (end * (end - 1) - start * (start - 1)) / 2 / self.attention_context
        return (dense + attention) / self.tokens_per_s


# DeepSeek-V3 (61 layers, 128 heads; 37B parameters active per token; MLA's cache 512 + 64 values
# a token and layer). Dense work: 2 x 37e9 FLOPs a token. Attention, prefill (not absorbed): per
# query-key pair and layer 2 x (192 + 128) x 128 FLOPs (scores over qk head dim 192, values over
# v head dim 128), x 61 layers = 5.0e6; equal to the dense work at 74e9 / 5.0e6 = 14,800 tokens of
# context. The rate is fitted to DeepSeek's report of 13 s to the first token of an uncached
# 128K-token prompt: (131,072 + 131,072 x 131,071 / 2 / 14,800) / 13 s = 54,700 tokens/s at
# short context (one serving instance; their published fleet average, 73.7K input tokens/s per
# 8-GPU H800 node with 56% of them cache hits, is of the same order). Decode: their published
# 20-22 tokens/s per user, about 47 ms a token.
V3_SHAPES = ModelConfig(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432,
                        q_lora_rank=1536)
MODELS: dict[str, SimulatedCompute] = {
    "deepseek-v3": SimulatedCompute(
        "deepseek-v3", V3_SHAPES, tokens_per_s=54_700.0, attention_context=14_800.0, decode_s=0.047,
        source="DeepSeek-V3 shapes; 13 s to the first token of a 128K-token prompt and 20-22 tokens/s "
               "decode, as DeepSeek reports them"),
}


def simulated(name: str, scale: float = 1.0) -> SimulatedCompute:
    """The simulated accelerator `name`, `scale` times slower than its published figures."""
    try:
        return MODELS[name].scaled(scale)
    except KeyError:
        raise ValueError(f"unknown simulated compute {name!r}; known: {', '.join(MODELS)}") from None


class SimulatedModel:
    """The parts of MLAModel the engine calls (`steps`, a decode call), sleeping
    instead of computing."""

    def __init__(self, compute: SimulatedCompute):
        self.compute = compute
        self.layers = compute.shapes.num_layers
        self._logits = torch.zeros(1, 1)  # argmax: token 0

    def steps(self, tokens: torch.Tensor, cache, pos: int, **_):
        per_layer = self.compute.prefill_seconds(pos, pos + tokens.shape[0]) / self.layers
        for i in range(self.layers):
            yield "layer", i
            time.sleep(per_layer)  # on the compute thread: the accelerator is busy
        yield "logits", self._logits

    def __call__(self, tokens: torch.Tensor, cache, pos: int) -> torch.Tensor:
        time.sleep(self.compute.decode_s * tokens.shape[0])
        return self._logits
