"""The continuous-batching engine. request/block_manager/scheduler/batch are pure Python (no torch)."""
