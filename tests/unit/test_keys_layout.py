import hashlib
import struct

import pytest

from kvfs.keys import Namespace, block_keys
from kvfs.layout import BlockLayout

NS = Namespace("acme", "deepseek-v2-lite")


def test_keys_follow_the_documented_chain():
    tokens = list(range(100, 100 + 3 * 4 + 2))
    keys = block_keys(NS, tokens, 4)
    assert len(keys) == 3  # the trailing partial block has no key
    prev = NS.root_key()
    for i, key in enumerate(keys):
        raw = struct.pack("<4i", *tokens[4 * i : 4 * i + 4])
        prev = hashlib.blake2b(prev + raw, key=NS.digest, digest_size=16).digest()
        assert key == prev


def test_a_key_names_the_whole_prefix_not_just_its_block():
    a = block_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_keys(NS, [9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different first block
    assert block_keys(NS, [1, 2, 3, 4, 0, 0, 0, 0], 4)[0] == a[0]  # shared first block, same key


def test_namespaces_separate_keys():
    tokens = list(range(64))
    others = [Namespace("other", "deepseek-v2-lite"), Namespace("acme", "other-model"),
              Namespace("acme", "deepseek-v2-lite", "mla-fp8")]
    mine = block_keys(NS, tokens, 16)
    for ns in others:
        assert not set(block_keys(ns, tokens, 16)) & set(mine)
    # fields are length-prefixed: moving a character between fields changes the digest
    assert Namespace("ab", "c").digest != Namespace("a", "bc").digest


def test_token_ids_must_fit_int32():
    with pytest.raises(ValueError, match="int32"):
        block_keys(NS, [2**31], 1)


def test_mla_layout_sizes_and_layer_aligned_chunks():
    layout = BlockLayout.mla()
    assert layout.row_bytes == 576 * 2 and layout.layer_bytes == 64 * 1152
    assert layout.payload_bytes == 64 * 27 * 576 * 2
    spans = layout.chunks(1 << 20)
    assert [(s.first_layer, s.last_layer) for s in spans] == [(0, 13), (14, 26)]
    assert sum(s.length for s in spans) == layout.payload_bytes
    assert all(s.length <= 1 << 20 and s.offset % layout.layer_bytes == 0 for s in spans)


def test_layers_larger_than_a_chunk_are_cut_into_pieces():
    layout = BlockLayout(layers=2, block_tokens=4, kv_dim=100, dtype="float32")  # 1600-byte layers
    spans = layout.chunks(1000)
    assert [(s.offset, s.length, s.first_layer) for s in spans] == [(0, 1000, 0), (1000, 600, 0),
                                                                     (1600, 1000, 1), (2600, 600, 1)]


def test_scatter_puts_every_byte_in_its_layer_major_place():
    layout = BlockLayout(layers=5, block_tokens=2, kv_dim=3, dtype="uint8")  # 6-byte layers
    blocks = 3
    # payload of block b: byte value encodes (block, layer, position)
    payloads = [bytes(100 * b + 10 * (i // 6) + i % 6 for i in range(30)) for b in range(blocks)]
    tokens = blocks * 2 + 1  # a buffer may hold more tokens than full blocks
    out = bytearray(layout.buffer_bytes(tokens))
    for b, payload in enumerate(payloads):
        for span in layout.chunks(13):  # 2 layers per chunk
            assert layout.span_of(span.offset, span.length, span.index) == span
            chunk = payload[span.offset : span.offset + span.length]
            for src, dst, n in layout.scatter(span, b, tokens):
                out[dst : dst + n] = chunk[src : src + n]
    expect = b"".join(b"".join(payloads[b][6 * layer : 6 * layer + 6] for b in range(blocks)) + b"\0\0\0"
                      for layer in range(5))
    assert bytes(out) == expect
    with pytest.raises(ValueError):
        layout.scatter(layout.chunks(13)[0], blocks, tokens)


@pytest.mark.parametrize("kw", [dict(layers=0, block_tokens=1, kv_dim=1), dict(layers=1, block_tokens=1,
                                                                                kv_dim=1, dtype="complex")])
def test_bad_layouts_are_refused(kw):
    with pytest.raises(ValueError):
        BlockLayout(**kw)


def test_a_salt_gives_a_prompt_keys_of_its_own_and_no_salt_is_the_empty_one():
    ns = Namespace("t", "m")
    tokens = list(range(64))
    plain = block_keys(ns, tokens, 16)
    assert block_keys(ns, tokens, 16, None) == block_keys(ns, tokens, 16, "") == block_keys(ns, tokens, 16, b"") == plain
    alice, bob = block_keys(ns, tokens, 16, "alice"), block_keys(ns, tokens, 16, "bob")
    assert block_keys(ns, tokens, 16, b"alice") == alice  # a str salt is its UTF-8 bytes
    # every key differs, not only the first: a salted prompt shares no block with another
    assert not set(alice) & set(plain) and not set(alice) & set(bob)
    assert block_keys(ns, tokens[:32], 16, "alice") == alice[:2]  # still a chain: prefixes match


def test_a_tenant_secret_changes_every_key_and_only_its_holder_can_compute_them():
    ns = Namespace("acme", "m")
    tokens = list(range(64 * 4))
    plain = block_keys(ns, tokens, 64)
    mine = block_keys(ns, tokens, 64, secret=b"s" * 16)
    assert mine == block_keys(ns, tokens, 64, secret=b"s" * 16)  # deterministic for its holder
    assert not set(mine) & set(plain)  # and nothing like what a guess without it computes
    assert not set(mine) & set(block_keys(ns, tokens, 64, secret=b"t" * 16))
    assert block_keys(ns, tokens, 64, salt="u1", secret=b"s" * 16) != mine  # salts still apply under it
    with pytest.raises(ValueError, match="at most 48"):
        ns.root_key(secret=b"x" * 49)
