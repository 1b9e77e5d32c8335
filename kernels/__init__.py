"""k3lab_kernels: fused implementations of K3 decode components, one module per component per
backend (`triton/`, `cute/`, `aiter/`). Installed as `k3lab_kernels` (the folder is `kernels/`)."""
