"""The MXFP4 decode the expert kernels share (Triton's simt path in kernels/triton/moe_experts.py, the CuTe DSL
one-token and grouped kernels in kernels/cute/moe_experts.py and moe_grouped.py): PTX text only, no Triton or CuTe
import.

A kernel-layout word (k3lab.mxfp4.to_kernel_layout: eight E2M1 codes placed so that one mask lands each pair, parts 2
and 3 through the word's bit reversal) becomes four f16x2 parts d0..d3 holding e2m1 * 2^-14 exactly (fp16
subnormals included) with 7 integer operations and no table (sm_90a SASS: 4 LOP3, 2 shifts, 1 BREV; the form before
the forty-first session took 13 PTX / 11 SASS); part p of word j of a 32-block multiplies the block's activation
pair 4p + j."""


def decode_ptx(w: str) -> list[str]:
    """PTX: the kernel-layout word in register `w` -> parts d0..d3 (f16x2, e2m1 * 2^-14), temporary t."""
    return [f"and.b32 d0, {w}, 0x8E008E00;",
            f"shl.b32 t, {w}, 8;", "and.b32 d1, t, 0x8E008E00;",
            f"brev.b32 t, {w};", "and.b32 d2, t, 0x8E008E00;",
            "shl.b32 t, t, 8;", "and.b32 d3, t, 0x8E008E00;"]
