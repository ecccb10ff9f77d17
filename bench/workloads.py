"""Synthetic request traces in the Mooncake format, from documented workload shapes.

`kvfs-bench trace --generate SHAPE` writes one; `trace --simulate` replays it
through the eviction policies beside the shipped trace. Each shape is a way
inference providers' prompts are known to reuse (or not reuse) their prefixes;
the parameters below are choices, written down so a reader can disagree with them:

- `chat`: multi-turn conversations. Each opens with one of 20 system prompts
  (Zipf-popular, lognormal length around 1,500 tokens); every turn resends the
  whole history plus a new user message (median 150 tokens) and the answer
  (median 300) joins the history. Turns per conversation are geometric with mean
  4 (public chat logs average a few turns, with a long tail), a minute of
  thinking between turns on average. Reuse: a conversation's history once per
  later turn, a minute apart, with other conversations in between.
- `agent`: tool-using agent loops. Each task opens with one of 5 tool-definition
  prefixes (4K to 12K tokens, shared by every task that uses that tool set) and an
  instruction, then loops: the model's action (median 150 tokens) and the tool's
  observation (median 800, heavy tail) join the history, every step resends it.
  Steps are geometric with mean 20 (at most 60), 5 s apart on average. Reuse:
  a long history, many times, seconds apart.
- `sysprompt`: single-turn requests behind shared system prompts. 50 prompts,
  Zipf-popular (s = 1.1: a few carry most traffic), lognormal around 3,000 tokens
  (instructions with few-shot examples), then a private question (median 400). 5%
  of requests resend a recent one whole (a retry or a regenerate). Reuse: the
  popular heads, constantly; the tails almost never.
- `documents`: long one-off documents (retrieval, summarization): one of 3 short
  instruction prefixes, then a document (lognormal around 12K tokens) and a
  question. Documents come from a large corpus, Zipf with s = 0.6, so most are
  read once and a few return, long after. Reuse: little, and far apart.
- `mix`: all four at once, as one provider serving them sees it (conversations,
  tasks, requests and documents interleaved in time, in proportion to their rates).

Block ids come from content: a 512-token block's id is the same wherever the same
pieces of text cover it in the same place, so a system prompt whose length is not a
multiple of 512 shares its full blocks and not the block it ends in, and a prompt's
partial last block differs from the full one a longer prompt has there.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
import os
import random
from collections.abc import Callable, Iterator

from .simulate import BLOCK_TOKENS

SHAPES = ("chat", "agent", "sysprompt", "documents", "mix")


class _Blocks:
    """Interns block contents (tuples of (piece, from, to)) as small ids."""

    def __init__(self):
        self.ids: dict[tuple, int] = {}

    def hash_ids(self, pieces: list[tuple[int, int]]) -> list[int]:
        """Block ids for a prompt made of `pieces` (piece id, tokens), in order."""
        out, block, room = [], [], BLOCK_TOKENS
        for piece, length in pieces:
            at = 0
            while at < length:
                take = min(room, length - at)
                block.append((piece, at, at + take))
                at += take
                room -= take
                if room == 0:
                    out.append(self.ids.setdefault(tuple(block), len(self.ids)))
                    block, room = [], BLOCK_TOKENS
        if block:
            out.append(self.ids.setdefault(tuple(block), len(self.ids)))
        return out


class _Draw:
    """The random choices every shape makes, from one seeded generator."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.pieces = itertools.count(1 << 40)  # ids of pieces of text nobody else has

    def tokens(self, median: float, sigma: float, low: int = 1, high: int = 200_000) -> int:
        return max(low, min(high, round(median * math.exp(self.rng.gauss(0.0, sigma)))))

    def geometric(self, mean: float, high: int) -> int:
        """1, 2, ... with the given mean, at most `high`."""
        p = 1.0 / mean
        return min(high, 1 + int(math.log(1.0 - self.rng.random()) / math.log(1.0 - p)))

    def zipf(self, n: int, s: float) -> Callable[[], int]:
        """A sampler of 0 .. n-1, item k with weight 1 / (k + 1)^s."""
        cum = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
        return lambda: min(n - 1, bisect.bisect_left(cum, self.rng.random() * cum[-1]))

    def fresh(self, tokens: int) -> tuple[int, int]:
        return next(self.pieces), tokens


# A session is a generator of (seconds after its start, prompt pieces, output tokens).
Session = Iterator[tuple[float, list[tuple[int, int]], int]]


def _chat(d: _Draw) -> Callable[[], Session]:
    system = [(k, d.tokens(1500, 0.6, 100, 8000)) for k in range(20)]
    pick = d.zipf(len(system), 1.0)

    def session() -> Session:
        history, t = [system[pick()]], 0.0
        for _ in range(d.geometric(4.0, 40)):
            question, answer = d.fresh(d.tokens(150, 1.0)), d.tokens(300, 0.8)
            yield t, history + [question], answer
            history += [question, d.fresh(answer)]
            t += d.rng.expovariate(1 / 60.0) + answer / 50.0  # thinking, plus reading the answer
    return session


def _agent(d: _Draw) -> Callable[[], Session]:
    tools = [(100 + k, d.rng.randint(4000, 12000)) for k in range(5)]
    pick = d.zipf(len(tools), 1.0)

    def session() -> Session:
        history, t = [tools[pick()], d.fresh(d.tokens(500, 0.5))], 0.0
        for _ in range(d.geometric(20.0, 60)):
            action = d.tokens(150, 0.7)
            yield t, list(history), action
            history += [d.fresh(action), d.fresh(d.tokens(800, 1.2, 10, 16000))]
            t += d.rng.expovariate(1 / 5.0)
    return session


def _sysprompt(d: _Draw) -> Callable[[], Session]:
    system = [(200 + k, d.tokens(3000, 0.7, 200, 20000)) for k in range(50)]
    pick = d.zipf(len(system), 1.1)
    recent: list[list[tuple[int, int]]] = []

    def session() -> Session:
        if recent and d.rng.random() < 0.05:
            pieces = d.rng.choice(recent[-50:])  # a retry or a regenerate
        else:
            pieces = [system[pick()], d.fresh(d.tokens(400, 1.0))]
            recent.append(pieces)
        yield 0.0, pieces, d.tokens(200, 0.8)
    return session


def _documents(d: _Draw) -> Callable[[], Session]:
    instructions = [(300 + k, d.rng.randint(100, 400)) for k in range(3)]
    corpus = 20000
    pick = d.zipf(corpus, 0.6)
    lengths: dict[int, int] = {}

    def session() -> Session:
        doc = pick()
        length = lengths.setdefault(doc, d.tokens(12000, 0.8, 1000, 120000))
        yield 0.0, [d.rng.choice(instructions), (1 << 30 | doc, length), d.fresh(d.tokens(100, 0.8))], \
            d.tokens(400, 0.8)
    return session


# shape -> (its sessions, sessions started per second: each shape about one request a second)
_MAKERS: dict[str, tuple[Callable[[_Draw], Callable[[], Session]], float]] = {
    "chat": (_chat, 0.25), "agent": (_agent, 0.05), "sysprompt": (_sysprompt, 1.0),
    "documents": (_documents, 1.0)}


def generate(shape: str, requests: int = 4000, seed: int = 0) -> list[dict]:
    """`requests` trace records of a shape, in timestamp order."""
    if shape not in SHAPES:
        raise ValueError(f"unknown workload shape {shape!r}; known: {', '.join(SHAPES)}")
    d, blocks = _Draw(seed), _Blocks()
    kinds = [_MAKERS[s] for s in (_MAKERS if shape == "mix" else (shape,))]
    makers = [(make(d), rate) for make, rate in kinds]
    rate = sum(r for _, r in makers)
    # sessions start as one Poisson process, each of a shape in proportion to its rate;
    # their requests are merged in time order
    pending: list[tuple] = []  # (time, tiebreak, session, its start, its next request)
    out, start, order = [], 0.0, itertools.count()
    while len(out) < requests:
        if not pending or pending[0][0] > start:
            start += d.rng.expovariate(rate)
            make = d.rng.choices([m for m, _ in makers], [r for _, r in makers])[0]
            _queue(pending, make(), start, order)
            continue
        when, _, session, begun, (_, pieces, output) = heapq.heappop(pending)
        out.append({"timestamp": round(when * 1000), "input_length": sum(n for _, n in pieces),
                    "output_length": output, "hash_ids": blocks.hash_ids(pieces)})
        _queue(pending, session, begun, order)
    return out


def _queue(pending: list, session: Session, begun: float, order) -> None:
    """Queues a session's next request at its time (a finished session is dropped)."""
    request = next(session, None)
    if request is not None:
        heapq.heappush(pending, (begun + request[0], next(order), session, begun, request))


def write(records: list[dict], path: str | os.PathLike) -> None:
    with open(path, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
