"""KVCache: the per-layer MLA cache, laid out exactly as kvfs moves it.

`[layers][tokens][kv_lora_rank + qk_rope_head_dim]` in the model dtype: layer l
of the whole sequence is one contiguous range, which is the layout of a kvfs
restore's destination and a write-back's source, so neither needs a copy.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, max_tokens: int, buffer: torch.Tensor | None = None):
        shape = (cfg.num_layers, max_tokens, cfg.kv_dim)
        if buffer is None:
            self.data = torch.zeros(shape, dtype=cfg.torch_dtype)
        else:  # e.g. a uint8 tensor from kvfs.client.BufferPool
            need = cfg.num_layers * max_tokens * cfg.kv_dim * torch.finfo(cfg.torch_dtype).bits // 8
            if buffer.numel() * buffer.element_size() < need or not buffer.is_contiguous():
                raise ValueError(f"cache buffer needs {need} contiguous bytes")
            self.data = buffer.view(torch.uint8)[:need].view(cfg.torch_dtype).view(shape)
        self.max_tokens = max_tokens

    def layer(self, i: int) -> torch.Tensor:
        return self.data[i]

    def bytes(self) -> torch.Tensor:
        """The whole cache as flat bytes (what kvfs reads into and writes from)."""
        return self.data.view(-1).view(torch.uint8)
