"""kvfs: a distributed chunk file system for LLM KV-cache blocks.

This package holds what every part shares (errors, configuration, buffers) and
the command-line entry points. The parts install beside it: kvfs.chunkserver,
kvfs.metaserver, kvfs.client, kvfs.engine.
"""

__version__ = "0.1.0"
