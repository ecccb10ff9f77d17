"""The byte layout of a KV block, and how a block is cut into chunks.

A block's payload is layer-major, `[layer][token][kv_dim]` in the engine's dtype,
so layer l of a block is one contiguous range. Chunks are cut at layer
boundaries (as many whole layers as fit in `chunk_size`; a layer larger than
that is cut into pieces), so every layer lives in exactly the chunks that hold
nothing else, and a restore can deliver layers in order as chunks arrive.

A restore's destination (and a write-back's source) holds many blocks laid out
`[layer][token][kv_dim]` across the whole prefix, so layer l of every block is
one contiguous range an engine can use directly.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1, "int8": 1}


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Bytes [offset, offset + length) of a block payload, covering layers first..last."""

    index: int
    offset: int
    length: int
    first_layer: int
    last_layer: int


@dataclass(frozen=True, slots=True)
class BlockLayout:
    layers: int
    block_tokens: int
    kv_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if min(self.layers, self.block_tokens, self.kv_dim) <= 0:
            raise ValueError(f"layers, block_tokens and kv_dim must be positive: {self}")

    @classmethod
    def mla(cls, layers: int = 27, block_tokens: int = 64, dtype: str = "bfloat16") -> BlockLayout:
        """DeepSeek-V2/V3 MLA: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token."""
        return cls(layers, block_tokens, 576, dtype)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """One token of one layer."""
        return self.kv_dim * self.itemsize

    @property
    def layer_bytes(self) -> int:
        return self.block_tokens * self.row_bytes

    @property
    def payload_bytes(self) -> int:
        return self.layers * self.layer_bytes

    def chunks(self, chunk_size: int) -> list[ChunkSpan]:
        """The chunks of one block payload, in order."""
        spans: list[ChunkSpan] = []
        if self.layer_bytes <= chunk_size:
            per = chunk_size // self.layer_bytes
            for first in range(0, self.layers, per):
                last = min(first + per, self.layers) - 1
                spans.append(ChunkSpan(len(spans), first * self.layer_bytes,
                                       (last - first + 1) * self.layer_bytes, first, last))
        else:
            for layer in range(self.layers):
                base = layer * self.layer_bytes
                for off in range(0, self.layer_bytes, chunk_size):
                    spans.append(ChunkSpan(len(spans), base + off, min(chunk_size, self.layer_bytes - off),
                                           layer, layer))
        return spans

    def buffer_bytes(self, tokens: int) -> int:
        """Bytes of a `[layer][tokens][kv_dim]` buffer."""
        return self.layers * tokens * self.row_bytes

    def span_of(self, offset: int, length: int, index: int = 0) -> ChunkSpan:
        """The span of payload bytes [offset, offset + length) (a chunk as metadata lists it)."""
        if offset < 0 or length <= 0 or offset + length > self.payload_bytes:
            raise ValueError(f"chunk [{offset}, {offset + length}) is outside a {self.payload_bytes}-byte block")
        return ChunkSpan(index, offset, length, offset // self.layer_bytes,
                         (offset + length - 1) // self.layer_bytes)

    def scatter(self, span: ChunkSpan, block: int, buffer_tokens: int) -> list[tuple[int, int, int]]:
        """Where a chunk's bytes go in a `[layer][buffer_tokens][kv_dim]` buffer:
        (offset in chunk, offset in buffer, length) pieces, one per layer it touches.
        Read backwards, the same pieces gather a chunk out of such a buffer."""
        if (block + 1) * self.block_tokens > buffer_tokens:
            raise ValueError(f"block {block} does not fit a buffer of {buffer_tokens} tokens")
        pieces = []
        layer_bytes = self.layer_bytes  # a property chain: once, not per layer (restores call this per chunk)
        stride = buffer_tokens * self.row_bytes  # one layer of the whole buffer
        pos = span.offset
        end = span.offset + span.length
        while pos < end:
            layer, within = divmod(pos, layer_bytes)
            n = min(layer_bytes - within, end - pos)
            pieces.append((pos - span.offset, layer * stride + block * layer_bytes + within, n))
            pos += n
        return pieces
