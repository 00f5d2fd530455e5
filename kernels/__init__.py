"""Attention and other kernels; each Triton kernel sits beside the pure-torch reference it must match."""
