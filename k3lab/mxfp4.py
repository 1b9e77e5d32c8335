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
