"""Generated traces: block ids follow content, and each shape reuses the way its
docstring says."""

import pytest

from kvfs.bench.simulate import simulate, unique_blocks
from kvfs.bench.workloads import SHAPES, _Blocks, generate


def test_block_ids_follow_the_text_that_covers_them():
    b = _Blocks()
    system, q1, q2 = (1, 700), (2, 324), (3, 324)
    one, two = b.hash_ids([system, q1]), b.hash_ids([system, q2])
    assert len(one) == 2 and one[0] == two[0]  # the system prompt's full block is shared
    assert one[1] != two[1]  # the block it ends in holds each question's start
    grown = b.hash_ids([system, q1, (4, 600)])
    assert len(grown) == 4 and grown[:2] == one  # a prompt that grows keeps its full blocks
    assert b.hash_ids([system, (2, 300)])[1] != one[1]  # a partial last block is not the full one


def test_conversations_resend_their_history():
    records = generate("chat", 400, seed=2)
    firsts = {}
    continued = 0
    for r in records:
        ids = r["hash_ids"]
        # a later turn starts with every full block of an earlier turn of its conversation
        if any(len(prev) > 1 and ids[: len(prev) - 1] == prev[:-1] for prev in firsts.get(ids[0], [])):
            continued += 1
        firsts.setdefault(ids[0], []).append(ids)
    assert continued > len(records) // 2  # geometric turns with mean 4: about 3 in 4 requests continue one


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_reuses_as_described(shape):
    records = generate(shape, 1500, seed=0)
    assert len(records) == 1500 and all(r["input_length"] > 0 and r["hash_ids"] for r in records)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in records)
    ceiling = simulate(records, None, "infinite")["token_hit_ratio"]
    low, high = {"chat": (0.5, 0.95), "agent": (0.8, 1.0), "sysprompt": (0.5, 0.95), "documents": (0.0, 0.3),
                 "mix": (0.4, 0.95)}[shape]
    assert low < ceiling < high
    assert unique_blocks(records) < sum(len(r["hash_ids"]) for r in records)
