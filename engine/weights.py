"""Weights: deterministic random init, or a DeepSeek-V2-format safetensors checkpoint.

DeepSeek checkpoints pair the RoPE dimensions interleaved (x0 x1 | x2 x3 | ...),
and their reference code de-interleaves activations at every step. The model
here keeps halves layout (x0 x2 x4 ... | x1 x3 x5 ...), so the loader permutes
the rows that produce RoPE dimensions once: the rope part of every head of the
query projection, and the last qk_rope_head_dim rows of kv_a_proj_with_mqa.
"""

from __future__ import annotations

import logging
import pathlib

import torch

from .config import ModelConfig
from .model import MLAModel

log = logging.getLogger(__name__)


def _rope_perm(r: int) -> torch.Tensor:
    return torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))


def _permute_rope_rows(name: str, w: torch.Tensor, cfg: ModelConfig, inverse: bool) -> torch.Tensor:
    r = cfg.qk_rope_head_dim
    perm = _rope_perm(r)
    if inverse:
        perm = torch.argsort(perm)
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        w = w.reshape(cfg.num_heads, cfg.qk_head_dim, -1).clone()
        w[:, cfg.qk_nope_head_dim :] = w[:, cfg.qk_nope_head_dim :][:, perm]
        return w.reshape(cfg.num_heads * cfg.qk_head_dim, -1)
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        w = w.clone()
        w[cfg.kv_lora_rank :] = w[cfg.kv_lora_rank :][perm]
        return w
    return w


@torch.no_grad()
def init_weights(model: MLAModel, seed: int) -> None:
    """Deterministic random weights: norms one, everything else N(0, 0.02)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


@torch.no_grad()
def load_checkpoint(model: MLAModel, path: str | pathlib.Path) -> None:
    """Loads a safetensors file, or every *.safetensors file of a folder (HF names)."""
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    ignored = sorted(set(tensors) - set(expected))
    if ignored:
        log.info("checkpoint %s: ignoring %d tensors this model does not have (e.g. %s)", path, len(ignored),
                 ignored[0])
    for name, target in expected.items():
        w = tensors[name]
        if w.shape != target.shape:
            raise ValueError(f"{name}: checkpoint has {tuple(w.shape)}, the model {tuple(target.shape)}")
        target.copy_(_permute_rope_rows(name, w, model.cfg, inverse=False).to(target.dtype))


@torch.no_grad()
def save_checkpoint(model: MLAModel, path: str | pathlib.Path) -> None:
    """Writes the model in DeepSeek-V2 checkpoint form (HF names, interleaved RoPE rows)."""
    from safetensors.torch import save_file

    state = {name: _permute_rope_rows(name, w, model.cfg, inverse=True).contiguous()
             for name, w in model.state_dict().items()}
    save_file(state, str(path))


def build_model(cfg: ModelConfig, checkpoint: str | pathlib.Path | None = None) -> MLAModel:
    """The model in cfg.dtype, from a checkpoint or from cfg.seed."""
    model = MLAModel(cfg)
    if checkpoint is None:
        init_weights(model, cfg.seed)
    else:
        load_checkpoint(model, checkpoint)
    return model.to(cfg.torch_dtype).eval()
