"""kvfs.engine: a thin DeepSeek-V2-style MLA inference engine on kvfs.

    from kvfs.engine import Engine, ModelConfig

    engine = Engine(ModelConfig.preset("tiny"), client, namespace)
    result = await engine.agenerate(token_ids, max_new_tokens=16)   # result.tokens, result.timings

`ModelConfig.preset("tiny" | "bench" | "deepseek-v2-lite")` gives the shapes;
`build_model(cfg, checkpoint=None)` builds the model from a seed or from a
DeepSeek-V2-format safetensors checkpoint; `KVCache` holds the per-layer MLA
cache in the layout kvfs stores.
"""

from .cache import KVCache
from .config import ModelConfig
from .engine import Engine, GenerateResult, Timings
from .model import MLAModel
from .weights import build_model, load_checkpoint, save_checkpoint

__all__ = ["Engine", "GenerateResult", "KVCache", "MLAModel", "ModelConfig", "Timings", "build_model",
           "load_checkpoint", "save_checkpoint"]
