"""kvfs-bench: throughput and latency measured side by side in one run."""
