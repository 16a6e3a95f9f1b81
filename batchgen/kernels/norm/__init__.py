"""Row-wise kernels around the projections: RMSNorm, LayerNorm and the gated activation, with FP8 hand-offs."""
