"""Batch-invariant kernels for engine.deterministic: a row's result does not depend on the other rows."""
