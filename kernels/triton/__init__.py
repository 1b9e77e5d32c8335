"""Triton kernels (NVIDIA and ROCm GPUs; CPU via TRITON_INTERPRET=1 for logic checks)."""
