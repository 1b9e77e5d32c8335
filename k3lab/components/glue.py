"""The step's glue ops through the one dispatcher: RMSNorm of rows and the SiTU-GLU activation.

    glue.rms_norm(x [R, D] bf16|fp32, weight [D], out=None, *, eps, backend) -> out [R, D] bf16
    glue.situ_glu(gu [R, 2I] bf16, out=None, *, b1=4, b2=25, backend) -> out [R, I] bf16   (gu = [w1 x | w3 x])
    glue.norm_glu(y [R, D], weight [D], gu [R, 2I], out=None, *, eps, b1, b2, backend) -> out [R, D + I] bf16
        = [rms_norm(y) | situ_glu(gu)] in one launch on triton (the MoE output projection's input)

Registered in `k3lab.ops.glue` (shapes, fp64 oracle, tolerances, bytes); kernels in
`kernels/triton/rms_norm.py`, `kernels/triton/situ_glu.py` and `kernels/triton/norm_glu.py`.
"""
from __future__ import annotations

import torch

from k3lab.components import dispatch
from k3lab.ref.situ import B1, B2

COMPONENT = "glue"


class GlueArgumentError(ValueError):
    """An argument of the glue component API has the wrong type, shape, dtype, device or value."""


def _fail(name: str, msg: str):
    raise GlueArgumentError(f"{COMPONENT}: {name!r} {msg}")


def _rows(name: str, t, dtypes, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        _fail(name, f"must be 2-D [rows, width], got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(name, f"must have dtype in {[str(d).replace('torch.', '') for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        _fail(name, f"must be on {device} (the input's device), got {t.device}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        _fail(name, f"must have unit stride along its last dim, got strides {t.stride()}")


def _weight(weight, x: torch.Tensor, xname: str) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        _fail("weight", f"must be a 1-D tensor of {x.shape[1]} ({xname}'s width), got "
                        f"{tuple(getattr(weight, 'shape', ())) or type(weight).__name__}")
    if weight.device != x.device:
        _fail("weight", f"must be on {x.device} ({xname}'s device), got {weight.device}")


def _triton_weight(weight: torch.Tensor) -> None:
    if not weight.is_contiguous() or weight.dtype not in (torch.bfloat16, torch.float32):
        _fail("weight", f"must be a contiguous bf16 or fp32 tensor for the triton backend, got {weight.dtype}")


def _positive(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            _fail(name, f"must be a positive number, got {v!r}")


def _block(block) -> None:
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 16
                              or block & (block - 1)):
        _fail("block", f"must be None or a power of two >= 16, got {block!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *, eps: float,
             backend: str = "reference", ran: list | None = None, num_warps: int | None = None) -> torch.Tensor:
    """out = rms(x; weight) (bf16; float64 for the fp64 oracle on the reference), one launch on triton."""
    _rows("x", x, (torch.bfloat16, torch.float32, torch.float64))
    _weight(weight, x, "x")
    _positive(eps=eps)
    odt = torch.float64 if x.dtype == torch.float64 else torch.bfloat16
    if out is None:
        out = torch.empty(x.shape, dtype=odt, device=x.device)
    _rows("out", out, (odt,), x.device)
    if tuple(out.shape) != tuple(x.shape):
        _fail("out", f"must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    be, opts, why = dispatch.select("rms_norm", backend, B=x.shape[0])
    if be == "triton":
        if x.dtype == torch.float64:
            _fail("x", "must be bf16 or fp32 for the triton backend, got float64")
        _triton_weight(weight)
        dispatch.kernel("rms_norm", be)(x, weight, out, eps=float(eps), num_warps=num_warps)
        opts = dict(opts, num_warps=num_warps)
    else:
        from k3lab.ref.rmsnorm import rms_norm as ref

        fn = ref if be == "reference" else dispatch.compiled("glue.rms_norm", ref)
        out.copy_(fn(x, weight, float(eps), out_dtype=odt))
    dispatch.record(ran, op="rms_norm", backend_requested=backend, backend=be, kernel=dispatch.kernel_path(
        "rms_norm", be), options=opts, shape=dict(rows=x.shape[0], dim=x.shape[1], xdtype=str(x.dtype)[6:]), why=why)
    return out


def _situ_ref(gu: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """The torch backends' SiTU: fp32 maths on the bf16 inputs, one rounding when stored (as the kernels and the
    registry's tolerance have it; run in bf16, every torch op rounds and the result misses the 4e-3 tolerance);
    float64 stays float64 (the oracle)."""
    from k3lab.ref.situ import situ

    inter = gu.shape[1] // 2
    x = gu if gu.dtype == torch.float64 else gu.float()
    return situ(x[:, :inter], x[:, inter:], b1, b2)


def situ_glu(gu: torch.Tensor, out: torch.Tensor | None = None, *, b1: float = B1, b2: float = B2,
             backend: str = "reference", ran: list | None = None, block: int | None = None,
             num_warps: int | None = None) -> torch.Tensor:
    """out = situ(gu[:, :I], gu[:, I:]) (bf16; float64 for the fp64 oracle on the reference)."""
    _rows("gu", gu, (torch.bfloat16, torch.float64))
    if gu.shape[1] % 2:
        _fail("gu", f"must hold [g | u]: an even width 2*I, got {gu.shape[1]}")
    inter = gu.shape[1] // 2
    _positive(b1=b1, b2=b2)
    if out is None:
        out = torch.empty(gu.shape[0], inter, dtype=gu.dtype, device=gu.device)
    _rows("out", out, (gu.dtype,), gu.device)
    if tuple(out.shape) != (gu.shape[0], inter):
        _fail("out", f"must be [{gu.shape[0]}, {inter}] (rows of gu, half its width), got {tuple(out.shape)}")
    _block(block)
    be, opts, why = dispatch.select("situ_glu", backend, B=gu.shape[0])
    if be == "triton":
        if gu.dtype != torch.bfloat16:
            _fail("gu", f"must be bf16 for the triton backend, got {gu.dtype}")
        dispatch.kernel("situ_glu", be)(gu, out, b1=float(b1), b2=float(b2), block=block, num_warps=num_warps)
        opts = dict(opts, block=block, num_warps=num_warps)
    else:
        fn = _situ_ref if be == "reference" else dispatch.compiled("glue.situ", _situ_ref)
        out.copy_(fn(gu, float(b1), float(b2)))
    dispatch.record(ran, op="situ_glu", backend_requested=backend, backend=be, kernel=dispatch.kernel_path(
        "situ_glu", be), options=opts, shape=dict(rows=gu.shape[0], inter=inter), why=why)
    return out


def norm_glu(y: torch.Tensor, weight: torch.Tensor, gu: torch.Tensor, out: torch.Tensor | None = None, *, eps: float,
             b1: float = B1, b2: float = B2, backend: str = "reference", ran: list | None = None,
             block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """out [R, D + I] = [rms(y; weight) | situ(gu[:, :I], gu[:, I:])] (bf16; float64 for the fp64 oracle on the
    reference): `rms_norm` and `situ_glu` side by side, one launch on triton."""
    _rows("y", y, (torch.bfloat16, torch.float32, torch.float64))
    _rows("gu", gu, (torch.bfloat16, torch.float64), y.device)
    R, D = y.shape
    if gu.shape[0] != R or gu.shape[1] % 2:
        _fail("gu", f"must be [{R}, 2*I] (y's rows, [g | u]), got {tuple(gu.shape)}")
    inter = gu.shape[1] // 2
    _weight(weight, y, "y")
    _positive(eps=eps, b1=b1, b2=b2)
    odt = torch.float64 if y.dtype == torch.float64 else torch.bfloat16
    if out is None:
        out = torch.empty(R, D + inter, dtype=odt, device=y.device)
    _rows("out", out, (odt,), y.device)
    if tuple(out.shape) != (R, D + inter):
        _fail("out", f"must be [{R}, {D + inter}] (y's width plus half of gu's), got {tuple(out.shape)}")
    _block(block)
    be, opts, why = dispatch.select("norm_glu", backend, B=R)
    if be == "triton":
        if y.dtype == torch.float64 or gu.dtype != torch.bfloat16:
            _fail("y" if y.dtype == torch.float64 else "gu", f"must be bf16/fp32 (y) and bf16 (gu) for the triton "
                                                              f"backend, got {y.dtype} and {gu.dtype}")
        _triton_weight(weight)
        if D > 16384:
            _fail("y", f"must be at most 16384 wide for the triton backend (one row in registers), got {D}")
        dispatch.kernel("norm_glu", be)(y, weight, gu, out, eps=float(eps), b1=float(b1), b2=float(b2), block=block,
                                        num_warps=num_warps)
        opts = dict(opts, block=block, num_warps=num_warps)
    else:
        from k3lab.ref.rmsnorm import rms_norm as ref

        fn_n = ref if be == "reference" else dispatch.compiled("glue.rms_norm", ref)
        fn_s = _situ_ref if be == "reference" else dispatch.compiled("glue.situ", _situ_ref)
        out[:, :D].copy_(fn_n(y, weight, float(eps), out_dtype=odt))
        out[:, D:].copy_(fn_s(gu, float(b1), float(b2)))
    dispatch.record(ran, op="norm_glu", backend_requested=backend, backend=be, kernel=dispatch.kernel_path(
        "norm_glu", be), options=opts, shape=dict(rows=R, dim=D, inter=inter, ydtype=str(y.dtype)[6:]), why=why)
    return out
