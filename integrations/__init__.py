"""kvfs.integrations: adapters that plug kvfs into inference engines (see docs/vllm.md)."""
