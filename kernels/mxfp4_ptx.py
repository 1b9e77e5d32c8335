"""The MXFP4 decode both CUDA-core expert kernels share (Triton's simt path in kernels/triton/moe_experts.py and the
CuTe DSL kernels in kernels/cute/moe_experts.py): PTX text only, no Triton or CuTe import.

A kernel-layout word (k3lab.mxfp4.to_kernel_layout: four bits of eight E2M1 codes placed so that plain masks and
shifts land them) becomes four f16x2 parts d0..d3 holding e2m1 * 2^-14 exactly (fp16 subnormals included) with 13
integer operations and no table; part p of word j of a 32-block multiplies the block's activation pair 4p + j."""


def decode_ptx(w: str) -> list[str]:
    """PTX: the kernel-layout word in register `w` -> parts d0..d3 (f16x2, e2m1 * 2^-14), temporary t."""
    return [f"and.b32 d0, {w}, 0x8E008E00;",
            f"shl.b32 t, {w}, 8;", "and.b32 d1, t, 0x8E008E00;",
            f"shl.b32 t, {w}, 5;", "and.b32 t, t, 0x0E000E00;", f"shl.b32 d2, {w}, 7;",
            "and.b32 d2, d2, 0x80008000;", "or.b32 d2, d2, t;",
            f"shr.u32 t, {w}, 3;", "and.b32 t, t, 0x0E000E00;", f"shl.b32 d3, {w}, 15;",
            "and.b32 d3, d3, 0x80008000;", "or.b32 d3, d3, t;"]
