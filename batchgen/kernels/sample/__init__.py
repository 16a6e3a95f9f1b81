"""Sampling kernels: the sort-free Gumbel-max draw with temperature, top-k, top-p and min-p, and argmax."""
