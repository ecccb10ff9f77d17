"""kvfs.engine: a thin DeepSeek-V2-style MLA inference engine on kvfs.

    from kvfs.engine import ModelConfig, build_model, KVCache

`ModelConfig.preset("tiny" | "bench" | "deepseek-v2-lite")` gives the shapes;
`build_model(cfg, checkpoint=None)` builds the model from a seed or from a
DeepSeek-V2-format safetensors checkpoint; `KVCache` holds the per-layer MLA
cache in the layout kvfs stores.
"""

from .cache import KVCache
from .config import ModelConfig
from .model import MLAModel
from .weights import build_model, load_checkpoint, save_checkpoint

__all__ = ["KVCache", "MLAModel", "ModelConfig", "build_model", "load_checkpoint", "save_checkpoint"]
