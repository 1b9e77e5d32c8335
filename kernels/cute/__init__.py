"""CuTe DSL kernels (nvidia-cutlass-dsl; NVIDIA Hopper and newer). Imported only where used."""
