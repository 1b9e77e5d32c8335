"""MXFP4 (OCP Microscaling, FP4 E2M1 elements with a shared E8M0 scale per 32) pack / unpack.

Format, for a weight W [..., K] quantized along its last (input) dim K, K % 32 == 0:
    element  E2M1, 4 bits: sign (bit 3) and a magnitude code 0..7 for {0, 0.5, 1, 1.5, 2, 3, 4, 6}
    packing  two elements per uint8: element 2i in the low nibble, element 2i+1 in the high nibble
             -> packed [..., K/2] uint8
    scale    one E8M0 per block of 32 consecutive elements along K: a uint8 e with value 2^(e - 127)
             -> scales [..., K/32] uint8 (255, the E8M0 NaN, is never produced)
    value    W[.., k] = e2m1(code) * 2^(e - 127)

Scale choice (the OCP MX spec rule): X = 2^(floor(log2(amax)) - 2), the exponent of the block's
largest magnitude minus E2M1's largest exponent (6 = 1.5 * 2^2). amax / X lies in [4, 8), so values
above 6 X saturate to +-6 X. An all-zero block gets the smallest scale (e = 0). The exponent is
clamped to E8M0's range [-127, 127].

Rounding choice: each x / X (exact: X is a power of two) is saturated to [-6, 6] and rounded to the
nearest E2M1 value, ties to the value with an even code (mantissa bit 0): 0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. The sign is kept, so a negative value that
rounds to zero is stored as -0 (code 8) and decodes to -0.0 (== 0).

Round trip: values already of the form e2m1 * X with the block's own scale come back exactly; any
other value comes back within half an E2M1 step of its scale, i.e. |err| <= X / 4 below 2X,
X / 2 in [2X, 4X), and X in [4X, 6X] (plus the saturation above 6X).
"""
from __future__ import annotations

import torch

BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127


def _grid(device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, device=device, dtype=dtype)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round x (already divided by its scale) to 4-bit E2M1 codes (uint8, 0..15): saturate to +-6,
    round to nearest, ties to even code.

    The magnitude code is the number of midpoints between neighbouring grid values that |x| passes;
    at a midpoint exactly, it is passed only when the code above it is even."""
    xf = x.to(torch.float32) if x.dtype != torch.float64 else x
    a = xf.abs()
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for i in range(7):
        mid = 0.5 * (E2M1_VALUES[i] + E2M1_VALUES[i + 1])
        passed = (a >= mid) if (i + 1) % 2 == 0 else (a > mid)
        code += passed.to(torch.uint8)
    sign = torch.signbit(xf).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """4-bit codes (uint8 0..15) -> values."""
    grid = _grid(codes.device, dtype)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def mx_scale_exponent(blocks: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) - 2 per block (last dim), clamped to [-127, 127]; int32. Exact (frexp)."""
    amax = blocks.abs().amax(-1).to(torch.float64)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)  ->  floor(log2 amax) = e - 1
    exp = (e.to(torch.int32) - 1) - 2
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -E8M0_BIAS))
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS)


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize w [..., K] (K % 32 == 0) along K. Returns (packed uint8 [..., K/2], scales uint8 E8M0
    [..., K/32])."""
    K = w.shape[-1]
    if K % BLOCK:
        raise ValueError(f"pack_mxfp4: the last (input) dim must be a multiple of {BLOCK}, got {K}")
    if not w.is_floating_point():
        raise ValueError(f"pack_mxfp4: expected a floating tensor, got {w.dtype}")
    wf = w.to(torch.float64 if w.dtype == torch.float64 else torch.float32)
    blocks = wf.unflatten(-1, (K // BLOCK, BLOCK))
    exp = mx_scale_exponent(blocks)
    scaled = blocks * torch.exp2(-exp.to(wf.dtype)).unsqueeze(-1)
    codes = e2m1_encode(scaled).flatten(-2)  # [..., K]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + E8M0_BIAS).to(torch.uint8)


def unpack_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Dequantize (packed [..., K/2], scales [..., K/32]) -> [..., K] in `dtype` (exact in float32)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"unpack_mxfp4: packed and scales must be uint8, got {packed.dtype}, {scales.dtype}")
    K = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * BLOCK != K:
        raise ValueError(f"unpack_mxfp4: scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)} "
                         f"(one scale per {BLOCK} elements)")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    vals = e2m1_decode(codes, work).unflatten(-1, (K // BLOCK, BLOCK))
    scale = torch.exp2(scales.to(work) - E8M0_BIAS).unsqueeze(-1)
    return (vals * scale).flatten(-2).to(dtype)


def mxfp4_nbytes(shape: tuple[int, ...]) -> int:
    """Bytes of an MXFP4 tensor of logical shape [..., K]: K/2 packed + K/32 scales per row."""
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows * (shape[-1] // 2 + shape[-1] // BLOCK)


# ---- the MXFP4 expert kernels' layout (Triton's simt path, the CuTe DSL one-token and grouped kernels) ---------
#
# The same codes, rearranged so the kernels decode eight of them with 7 integer instructions and no table
# (k3lab_kernels.mxfp4_ptx.decode_ptx). Per 32-block of a row (16 packed bytes, codes c[0..31]) four 32-bit words
# W[j], j = 0..3. Word j carries the code pairs (c[2q], c[2q+1]) for q = 4p + j, p = 0..3 (its "parts"); part p
# decodes to one f16x2 (c[2q] in the low half) of value e2m1 * 2^-14: the magnitude bits e1 e0 m at f16 bits 11, 10,
# 9 and the sign at bit 15 of each half (e2m1 * 2^-14 is exact in f16, subnormals included). Every part is taken out
# with the mask M = 0x8E008E00, parts 2 and 3 from the word's bit reversal v (brev):
#   p = 0  w & M             element h at bits (m, e0, e1, s) = (9, 10, 11, 15) + 16 h
#   p = 1  (w << 8) & M      element h at (1, 2, 3, 7) + 16 h
#   p = 2  v & M             element h at (6, 5, 4, 0) + 16 (1 - h)    (reversal: bit b -> 31 - b)
#   p = 3  (v << 8) & M      element h at (14, 13, 12, 8) + 16 (1 - h)
# The four parts use each bit of the word once. The pairs of a word are the activation pairs 4p + j of its block, so
# the activations a thread needs for a part of four consecutive words are four consecutive pairs (one 16-byte
# load). Scales are unchanged. (Until the forty-first session, code of 566f3c7, parts 2 and 3 sat at magnitude
# 6..4 / sign 8 and magnitude 14..12 / sign 0, each taken out by two shifts, two masks and an or: 13 operations.)
_KL_BITS = (((9, 10, 11, 15), False), ((1, 2, 3, 7), False), ((6, 5, 4, 0), True), ((14, 13, 12, 8), True))
# (bit positions of (m, e0, e1, s) in the element's half, whether element h sits in half 1 - h) of part p


def to_kernel_layout(packed: torch.Tensor, quad: bool = False) -> torch.Tensor:
    """Packed MXFP4 codes [..., K/2] uint8 (this module's layout) -> the SIMT kernel's words [..., K/8] int32
    (converted in slices of rows, so a GPU stack of gigabytes needs little scratch); quad=True: each slice also
    quad-transposed (`quad_transpose`, K % 128 == 0), with no second full-size copy."""
    if packed.dtype != torch.uint8 or packed.dim() < 1 or packed.shape[-1] % (BLOCK // 2):
        raise ValueError(f"to_kernel_layout: 'packed' must be uint8 [..., K/2] with K % {BLOCK} == 0, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    if quad and packed.shape[-1] % 64:
        raise ValueError(f"to_kernel_layout: quad=True needs 'packed' [..., K/2] with K % 128 == 0, got "
                         f"{tuple(packed.shape)}")
    flat = packed.reshape(-1, packed.shape[-1])
    out = torch.empty(flat.shape[0], flat.shape[1] // 4, dtype=torch.int32, device=packed.device)
    step = max(1, (1 << 22) // max(1, flat.shape[1]))
    for r0 in range(0, flat.shape[0], step):
        words = _to_kl_rows(flat[r0:r0 + step])
        out[r0:r0 + step] = quad_transpose(words) if quad else words
    return out.reshape(*packed.shape[:-1], packed.shape[-1] // 4)


def _to_kl_rows(packed: torch.Tensor) -> torch.Tensor:
    rows, nb = packed.shape[0], packed.shape[1] // (BLOCK // 2)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).to(torch.int32)  # [rows, K/2, 2]
    codes = codes.reshape(rows, nb, 4, 4, 2)  # [row, block, p, j, half]: pair q = 4p + j
    word = torch.zeros(rows, nb, 4, dtype=torch.int32, device=packed.device)
    for p, (pos, swap) in enumerate(_KL_BITS):
        for h in range(2):
            c = codes[..., p, :, h]  # [row, block, j]: code bit i (m, e0, e1, s) goes to bit pos[i] of its half
            base = 16 * (1 - h if swap else h)
            for i, b in enumerate(pos):
                word |= ((c >> i) & 1) << (base + b)  # int32: bit 31 wraps to the sign, as intended
    return word.reshape(rows, nb * 4)


def quad_transpose(words: torch.Tensor) -> torch.Tensor:
    """Kernel-layout words [..., K/8] int32 with each 16-word group (four 32-blocks of a row) transposed as a 4 x 4
    matrix: word 4 u + t of a group (block u's word t) moves to 4 t + u, so the word t of four consecutive blocks
    lies in 16 contiguous bytes (one vector load for the lane that owns word t: the grouped CuTe experts' up kernel,
    kernels/cute/moe_grouped.py). Its own inverse. Needs K % 128 == 0."""
    if words.dtype != torch.int32 or words.dim() < 1 or words.shape[-1] % 16:
        raise ValueError(f"quad_transpose: 'words' must be int32 [..., K/8] with K % 128 == 0, got "
                         f"{words.dtype} {tuple(words.shape)}")
    lead, n = words.shape[:-1], words.shape[-1]
    return words.reshape(*lead, n // 16, 4, 4).transpose(-1, -2).contiguous().reshape(*lead, n)


def from_kernel_layout(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_kernel_layout`: [..., K/8] int32 -> packed [..., K/2] uint8."""
    if words.dtype != torch.int32 or words.shape[-1] % 4:
        raise ValueError(f"from_kernel_layout: 'words' must be int32 [..., K/8] with K % {BLOCK} == 0, got "
                         f"{words.dtype} {tuple(words.shape)}")
    lead, nb = words.shape[:-1], words.shape[-1] // 4
    w = words.to(torch.int64).reshape(*lead, nb, 4) & 0xFFFFFFFF
    codes = torch.zeros(*lead, nb, 4, 4, 2, dtype=torch.int64, device=words.device)
    for p, (pos, swap) in enumerate(_KL_BITS):
        for h in range(2):
            base = 16 * (1 - h if swap else h)
            codes[..., p, :, h] = sum(((w >> (base + b)) & 1) << i for i, b in enumerate(pos))
    codes = codes.reshape(*lead, nb * 16, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8).contiguous()
