"""FP8 kernels: activation quantisation, block-scaled GEMMs (cuBLASLt, Triton, split-K). The FP8 linear layer and
checkpoint schemes that use them live in batchgen/quant/."""
