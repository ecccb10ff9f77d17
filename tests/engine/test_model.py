"""The MLA model on CPU with the tiny config."""

import pytest
import torch

from kvfs.engine import KVCache, ModelConfig, build_model, save_checkpoint
from kvfs.engine import tokenizer

F32 = ModelConfig.preset("tiny", dtype="float32")


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, F32.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_presets_have_the_documented_shapes():
    lite = ModelConfig.preset("deepseek-v2-lite")
    assert (lite.num_layers, lite.hidden_size, lite.num_heads, lite.kv_lora_rank, lite.qk_rope_head_dim,
            lite.qk_nope_head_dim, lite.v_head_dim, lite.vocab_size) == (27, 2048, 16, 512, 64, 128, 128, 102400)
    assert lite.kv_dim == 576 and ModelConfig.preset("bench").kv_dim == 576
    assert lite.block_layout().payload_bytes == 64 * 27 * 576 * 2
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("huge")


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_absorbed_decode_matches_expanded_attention(q_lora_rank):
    cfg = F32.with_(q_lora_rank=q_lora_rank)
    model = build_model(cfg)
    tokens = prompt(40)
    caches = [KVCache(cfg, 64), KVCache(cfg, 64)]
    for cache in caches:  # the same expanded prefill for both
        model(tokens[:39], cache, 0, absorbed=False)
    expanded = model(tokens[39:], caches[0], 39, absorbed=False)
    absorbed = model(tokens[39:], caches[1], 39, absorbed=True)
    # same maths in a different association order: float32 rounding only
    torch.testing.assert_close(absorbed, expanded, rtol=1e-4, atol=1e-5)
    # the cache of the prefill and of layer 0's new token do not depend on the attention form
    assert torch.equal(caches[0].data[:, :39], caches[1].data[:, :39])
    assert torch.equal(caches[0].data[0, 39], caches[1].data[0, 39])


def test_prefill_in_pieces_equals_prefill_at_once():
    model = build_model(F32)
    tokens = prompt(50)
    whole = KVCache(F32, 64)
    logits_whole = model(tokens, whole, 0)
    pieces = KVCache(F32, 64)
    model(tokens[:32], pieces, 0)
    logits_pieces = model(tokens[32:], pieces, 32)
    torch.testing.assert_close(logits_pieces, logits_whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pieces.data[:, :50], whole.data[:, :50], rtol=1e-5, atol=1e-6)


def test_a_copied_cache_gives_bitwise_identical_logits():
    """What a restore relies on: the same cache bytes give the same answer, bit for bit."""
    model = build_model(ModelConfig.preset("tiny"))  # bf16, as stored in kvfs
    tokens = prompt(70)
    first = KVCache(model.cfg, 80)
    model(tokens[:64], first, 0)
    reference = model(tokens[64:], first, 64)
    second = KVCache(model.cfg, 80)
    second.bytes()[: first.bytes().numel()] = first.bytes()  # the bytes a restore would deliver
    second.data[:, 64:] = 0
    assert torch.equal(model(tokens[64:], second, 64), reference)


def test_deterministic_init_from_the_seed():
    a, b = build_model(F32), build_model(F32)
    c = build_model(F32.with_(seed=1))
    tokens = prompt(10)
    out = [m(tokens, KVCache(F32, 16), 0) for m in (a, b, c)]
    assert torch.equal(out[0], out[1]) and not torch.equal(out[0], out[2])


def test_checkpoint_with_interleaved_rope_loads_to_the_same_model(tmp_path):
    model = build_model(F32.with_(seed=3))
    path = tmp_path / "model.safetensors"
    save_checkpoint(model, path)  # DeepSeek form: rope rows interleaved
    loaded = build_model(F32, checkpoint=path)
    tokens = prompt(30)
    assert torch.equal(loaded(tokens, KVCache(F32, 32), 0), model(tokens, KVCache(F32, 32), 0))
    # the reference way: keep the checkpoint's interleaved rows and de-interleave activations
    from safetensors.torch import load_file

    raw = build_model(F32)
    raw.load_state_dict(load_file(str(path)))
    raw.set_rope_interleaved(True)
    torch.testing.assert_close(raw(tokens, KVCache(F32, 32), 0), model(tokens, KVCache(F32, 32), 0),
                               rtol=1e-5, atol=1e-6)
    # and without the permutation the answer is different: the loader's work matters
    raw.set_rope_interleaved(False)
    assert not torch.allclose(raw(tokens, KVCache(F32, 32), 0), model(tokens, KVCache(F32, 32), 0), atol=1e-4)


def test_loader_refuses_incomplete_checkpoints(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "partial.safetensors"
    save_file({"lm_head.weight": torch.zeros(256, 64)}, str(path))
    with pytest.raises(ValueError, match="lacks"):
        build_model(F32, checkpoint=path)


def test_cache_lives_in_a_kvfs_buffer_layout():
    from kvfs.client import BufferPool

    cfg = ModelConfig.preset("tiny")
    layout = cfg.block_layout()
    buf = BufferPool(arena_bytes=0).get(layout.buffer_bytes(128))
    cache = KVCache(cfg, 128, buf)
    cache.data[1, 5, 7] = 3.0
    row = layout.row_bytes
    offset = 1 * 128 * row + 5 * row + 7 * layout.itemsize  # [layer][token][kv_dim]
    assert cache.bytes()[offset : offset + 2].view(torch.bfloat16).item() == 3.0


def test_byte_tokenizer_round_trips_text():
    text = "Résumé: 128K tokens ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert max(tokenizer.encode(text)) < 256
