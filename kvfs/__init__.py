"""kvfs: a distributed chunk file system for LLM KV-cache blocks.

This package is the vocabulary every part shares and nothing else: block keys
(keys.py), the block layout (layout.py), the data-port wire format (wire.py),
chunk checksums (checksum.py), errors and their gRPC codes (errors.py), the
configuration machinery (config.py), gRPC and serving helpers (rpc.py,
serving.py), page-aligned buffers (buffers.py) and the generated stubs (proto/).
It imports no part. The parts install beside it (kvfs.metaserver,
kvfs.chunkserver, kvfs.client, kvfs.engine, kvfs.integrations) and the programs
on top (kvfs.cli, kvfs.bench); pyproject.toml's import contracts say who may
import whom.
"""

__version__ = "0.1.0"

from kvfs.keys import Namespace, block_keys  # noqa: E402
from kvfs.layout import BlockLayout  # noqa: E402

__all__ = ["BlockLayout", "Namespace", "block_keys"]
