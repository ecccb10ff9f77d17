"""kvfs: a distributed chunk file system for LLM KV-cache blocks.

This package holds what every part shares (errors, configuration, buffers) and
the command-line entry points. The parts install beside it: kvfs.chunkserver,
kvfs.metaserver, kvfs.client, kvfs.engine.
"""

__version__ = "0.1.0"

from kvfs.keys import Namespace, block_keys  # noqa: E402
from kvfs.layout import BlockLayout  # noqa: E402

__all__ = ["BlockLayout", "Namespace", "block_keys"]
