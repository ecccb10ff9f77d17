"""A DeepSeek-V2-style MLA transformer, small enough to read in one sitting.

Module names follow the Hugging Face DeepSeek-V2 checkpoints (`model.layers.N.
self_attn.kv_a_proj_with_mqa`, ...), so a checkpoint's state dict loads as is.

Attention (MLA): each token's keys and values are compressed into `c_kv`
(kv_lora_rank values, RMS-normed) plus one RoPE key shared by all heads
(qk_rope_head_dim values). Those 576 values per token per layer are the whole
KV cache, and what kvfs stores. Prefill expands the cache with `kv_b_proj`;
decode uses the absorbed form, folding `kv_b_proj` into the query and the
output so it reads only the compressed cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(dim: int, start: int, count: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions start..start+count-1, `[count, dim]`, halves layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(start, start + count, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotates `x [..., tokens, (heads,) dim]` by position.

    The model keeps rope dimensions in halves layout (first half real parts,
    second half imaginary). DeepSeek checkpoints pair them interleaved; the
    loader permutes those weights once, and `interleaved=True` instead
    de-interleaves activations on the fly, exactly as the reference code does.
    """
    if interleaved:
        *lead, d = x.shape
        x = x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, dq = cfg.num_heads, cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, h * dq, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(dq)
        self.rope_interleaved = False

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cache: torch.Tensor, pos: int, absorbed: bool) -> torch.Tensor:
        """x `[T, hidden]` at positions pos..pos+T-1; `cache [max_tokens, kv_dim]` holds
        positions < pos and receives this step's entries."""
        cfg = self.cfg
        t, h, r, c = x.shape[0], cfg.num_heads, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q = self._query(x).view(t, h, cfg.qk_head_dim)
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(x)
        cos, sin = rope_tables(r, pos, t, cfg.rope_theta)
        q_pe = apply_rope(q_pe, cos[:, None], sin[:, None], self.rope_interleaved)
        k_pe = apply_rope(kv[:, c:], cos, sin, self.rope_interleaved)
        cache[pos : pos + t, :c] = self.kv_a_layernorm(kv[:, :c])
        cache[pos : pos + t, c:] = k_pe
        ctx = cache[: pos + t]
        c_all, kpe_all = ctx[:, :c], ctx[:, c:]
        mask = torch.arange(pos + t)[None, :] <= torch.arange(pos, pos + t)[:, None]  # [T, S] causal
        w = self.kv_b_proj.weight.view(h, cfg.qk_nope_head_dim + cfg.v_head_dim, c)
        if absorbed:
            # fold W_UK into the query and W_UV into the output: attention over the
            # compressed cache only, never materialising per-head keys or values
            q_c = torch.einsum("thn,hnc->thc", q_nope.float(), w[:, : cfg.qk_nope_head_dim].float())
            scores = (torch.einsum("thc,sc->hts", q_c, c_all.float())
                      + torch.einsum("thr,sr->hts", q_pe.float(), kpe_all.float())) * self.scale
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            o_c = torch.einsum("hts,sc->thc", probs, c_all.float())
            out = torch.einsum("thc,hvc->thv", o_c, w[:, cfg.qk_nope_head_dim :].float()).to(x.dtype)
        else:
            kvb = F.linear(c_all, self.kv_b_proj.weight).view(-1, h, cfg.qk_nope_head_dim + cfg.v_head_dim)
            k = torch.cat((kvb[..., : cfg.qk_nope_head_dim], kpe_all[:, None].expand(-1, h, r)), dim=-1)
            v = kvb[..., cfg.qk_nope_head_dim :]
            qh = torch.cat((q_nope, q_pe), dim=-1)
            out = F.scaled_dot_product_attention(qh.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 attn_mask=mask, scale=self.scale).transpose(0, 1)
        return self.o_proj(out.reshape(t, h * cfg.v_head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, pos: int, absorbed: bool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache, pos, absorbed)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Trunk(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MLAModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Trunk(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, pos: int, *, absorbed: bool | None = None,
                before_layer: Callable[[int], None] | None = None, last_only: bool = True) -> torch.Tensor:
        """Runs tokens at positions pos.. over a cache holding positions < pos.

        `absorbed` defaults to the decode form for single tokens and the expanded
        form for prefill. `before_layer(l)` is called before layer l reads the
        cache, so a restore can deliver layer l just in time.
        """
        for kind, value in self.steps(tokens, cache, pos, absorbed=absorbed, last_only=last_only):
            if kind == "logits":
                return value
            if before_layer is not None:
                before_layer(value)
        raise AssertionError("steps() ends with the logits")

    @torch.inference_mode()
    def steps(self, tokens: torch.Tensor, cache: KVCache, pos: int, *, absorbed: bool | None = None,
              last_only: bool = True):
        """`forward` one layer at a time: yields ("layer", l) before layer l reads the
        cache and finally ("logits", tensor), so a scheduler can run each layer as a
        job of its own and wait for a restored layer between jobs."""
        absorbed = tokens.shape[0] == 1 if absorbed is None else absorbed
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            yield "layer", i
            x = layer(x, cache.layer(i), pos, absorbed)
        x = self.model.norm(x[-1:] if last_only else x)
        yield "logits", self.lm_head(x).float()

    def set_rope_interleaved(self, interleaved: bool) -> None:
        for layer in self.model.layers:
            layer.self_attn.rope_interleaved = interleaved
