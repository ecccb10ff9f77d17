"""ModelConfig: the shapes of a DeepSeek-V2-style MLA model, with named presets."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvfs.layout import BlockLayout

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    q_lora_rank: int | None = None  # None: a plain q_proj (as in DeepSeek-V2-Lite)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "bfloat16"  # weights, activations and the KV cache kvfs stores
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {self.dtype!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        """Values cached per token per layer: the compressed KV plus the RoPE key (576 for V2/V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def block_layout(self, block_tokens: int = 64) -> BlockLayout:
        return BlockLayout(self.num_layers, block_tokens, self.kv_dim, self.dtype)

    def with_(self, **changes) -> ModelConfig:
        return replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """`tiny` (tests), `bench` (seconds-long prefills here) or `deepseek-v2-lite` (the real shapes)."""
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
        return replace(base, **overrides)


PRESETS: dict[str, ModelConfig] = {
    # a forward pass in milliseconds; byte-level vocabulary
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=2, kv_lora_rank=32,
                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, intermediate_size=128,
                        q_lora_rank=24),
    # the real MLA cache width (512 + 64 = 576 values per token per layer, bf16) so restores move
    # the same bytes per token and layer as DeepSeek-V2/V3, with few enough layers and a narrow
    # enough trunk that an 8K-token prefill takes seconds, not minutes, on two CPU cores
    "bench": ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=8, kv_lora_rank=512,
                         qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, intermediate_size=2048),
    # DeepSeek-V2-Lite: 27 layers, hidden 2048, 16 heads, plain q_proj, dense MLP shapes (its MoE
    # layers are not modelled: the cache kvfs stores does not depend on them)
    "deepseek-v2-lite": ModelConfig(vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16,
                                    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                    v_head_dim=128, intermediate_size=10944),
}
