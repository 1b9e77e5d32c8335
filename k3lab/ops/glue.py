"""Registry entries of the step's glue ops: the small elementwise/row kernels that sit between two projections
of a decode layer and would otherwise be several torch launches each.

  rms_norm   batch (rows), dim, xdtype "bf16" | "fp32": rms(x; weight) in bf16 (the MLA q_norm over 1536, the MoE
             routed_norm over the fp32 expert sum of 3584)
  situ_glu   batch (rows), inter: a = situ(g, u) in bf16 from the [g | u] output of one projection over the
             concatenated [w1; w3] (the shared experts, the dense MLP)
  norm_glu   batch, dim, inter, xdtype: [rms_norm(y) | situ_glu(gu)] side by side in one launch (the MoE output
             projection's input: routed_norm of the expert sum, the shared experts' activation)

Bytes (the one formula), read bandwidth, launch-bound at decode sizes:
  rms_norm   R*D*(e_x + 2) + D*2
  situ_glu   R*I*(2*2 + 2)
  norm_glu   the two above, summed

Tolerances (relative norm against fp64): 4e-3 for both: fp32 maths on exact bf16/fp32 inputs and one bf16
rounding of the output (bf16 keeps 8 bits: a relative rounding of at most 2^-9 per entry); the torch backends
(reference, torch_compile) run the SiTU in fp32 on the bf16 inputs too (k3lab.components.glue._situ_ref: in bf16 every
torch op rounds, and norm_glu missed the tolerance at 4.3e-3).
"""
from __future__ import annotations

import torch

from k3lab.registry import Case, Op, register
from k3lab.registry import generator as _gen
from k3lab.ref.situ import B1, B2

TOL = 4e-3
WHY = "4e-3: fp32 maths on exact inputs, one bf16 rounding of the output (<= 2^-9 relative per entry)"
XDTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def rms_norm_bytes(case: Case) -> int:
    R, D = case["batch"], case["dim"]
    return R * D * (XDTYPES[case["xdtype"]].itemsize + 2) + D * 2


def situ_bytes(case: Case) -> int:
    return case["batch"] * case["inter"] * 6


def norm_glu_bytes(case: Case) -> int:
    return rms_norm_bytes(case) + situ_bytes(case)




def make_rms(case: Case, seed: int, device: str) -> dict:
    R, D = case["batch"], case["dim"]
    g = _gen(seed, device)
    x = (torch.randn(R, D, generator=g, device=device) * 3).to(XDTYPES[case["xdtype"]])
    w = (1 + 0.2 * torch.randn(D, generator=g, device=device)).to(torch.bfloat16)
    return dict(x=x, weight=w, out=torch.empty(R, D, dtype=torch.bfloat16, device=device))


def ref_rms(d: dict, case: Case) -> dict:
    from k3lab.ref.rmsnorm import rms_norm

    return dict(out=rms_norm(d["x"].to(torch.float64), d["weight"].to(torch.float64), case["eps"]))


def call_rms(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import glue

    return glue.rms_norm(d["x"], d["weight"], d["out"], eps=case["eps"], backend=backend, ran=ran, **opts)


def make_situ(case: Case, seed: int, device: str) -> dict:
    R, I = case["batch"], case["inter"]
    g = _gen(seed, device)
    gu = (torch.randn(R, 2 * I, generator=g, device=device) * 4).to(torch.bfloat16)  # past both tanh knees
    return dict(gu=gu, out=torch.empty(R, I, dtype=torch.bfloat16, device=device))


def ref_situ(d: dict, case: Case) -> dict:
    from k3lab.ref.situ import situ

    gu = d["gu"].to(torch.float64)
    I = case["inter"]
    return dict(out=situ(gu[:, :I], gu[:, I:], B1, B2))


def call_situ(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import glue

    return glue.situ_glu(d["gu"], d["out"], backend=backend, ran=ran, **opts)


def _tol(case: Case) -> dict[str, float]:
    return dict(out=TOL)


_BACKENDS_RMS = {"reference": "k3lab.ref.rmsnorm:rms_norm", "torch_compile": "k3lab.ref.rmsnorm:rms_norm",
                 "triton": "k3lab_kernels.triton.rms_norm:rms_norm"}
_BACKENDS_SITU = {"reference": "k3lab.ref.situ:situ", "torch_compile": "k3lab.ref.situ:situ",
                  "triton": "k3lab_kernels.triton.situ_glu:situ_glu"}

RMS_NORM = register(Op(
    name="rms_norm", component="glue", policy_key="rms_norm",
    doc="RMSNorm of rows (fp32 maths, bf16 out): the MLA q_norm and the MoE routed_norm",
    axes=dict(batch=(1, 3, 64), dim=(1536, 3584), xdtype=("bf16", "fp32"), eps=(1e-6,)),
    option_axes={"num_warps": {"triton": (None, 2, 4, 8, 16)}}, option_defaults={"num_warps": (None,)},
    make_inputs=make_rms, reference=ref_rms, written=("out",), updated=(), tolerances=_tol, tolerance_why=WHY,
    call=call_rms, nbytes=rms_norm_bytes, flops=lambda c: 4 * c["batch"] * c["dim"], floor_bw="read",
    backends=_BACKENDS_RMS, valid=lambda c: c["batch"] >= 1 and 1 <= c["dim"] <= 16384,
    test_file="tests/test_glue.py",
))

SITU_GLU = register(Op(
    name="situ_glu", component="glue", policy_key="situ_glu",
    doc="SiTU-GLU activation of one [g | u] projection output (bf16 out): the shared experts, the dense MLP",
    axes=dict(batch=(1, 3, 64), inter=(768, 384, 1000)),
    option_axes={"block": {"triton": (None, 256, 512, 1024)}, "num_warps": {"triton": (None, 2, 4, 8)}},
    option_defaults={"block": (None,), "num_warps": (None,)},
    make_inputs=make_situ, reference=ref_situ, written=("out",), updated=(), tolerances=_tol, tolerance_why=WHY,
    call=call_situ, nbytes=situ_bytes, flops=lambda c: 12 * c["batch"] * c["inter"], floor_bw="read",
    backends=_BACKENDS_SITU, valid=lambda c: c["batch"] >= 1 and c["inter"] >= 1, test_file="tests/test_glue.py",
))


def make_norm_glu(case: Case, seed: int, device: str) -> dict:
    r, s = make_rms(case, seed, device), make_situ(case, seed + 1, device)
    R, D, I = case["batch"], case["dim"], case["inter"]
    return dict(y=r["x"], weight=r["weight"], gu=s["gu"],
                out=torch.empty(R, D + I, dtype=torch.bfloat16, device=device))


def ref_norm_glu(d: dict, case: Case) -> dict:
    n = ref_rms(dict(x=d["y"], weight=d["weight"]), case)["out"]
    return dict(out=torch.cat([n, ref_situ(d, case)["out"]], dim=1))


def call_norm_glu(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import glue

    return glue.norm_glu(d["y"], d["weight"], d["gu"], d["out"], eps=case["eps"], backend=backend, ran=ran, **opts)


NORM_GLU = register(Op(
    name="norm_glu", component="glue", policy_key="norm_glu",
    doc="[RMSNorm(y) | SiTU-GLU(gu)] side by side in one launch: the MoE output projection's input",
    axes=dict(batch=(1, 3, 64), dim=(3584, 1000), inter=(768, 384), xdtype=("fp32", "bf16"), eps=(1e-6,)),
    option_axes={"block": {"triton": (None, 256, 512, 1024)}, "num_warps": {"triton": (None, 4, 8)}},
    option_defaults={"block": (None,), "num_warps": (None,)},
    make_inputs=make_norm_glu, reference=ref_norm_glu, written=("out",), updated=(), tolerances=_tol,
    tolerance_why=WHY, call=call_norm_glu, nbytes=norm_glu_bytes,
    flops=lambda c: 4 * c["batch"] * c["dim"] + 12 * c["batch"] * c["inter"], floor_bw="read",
    backends={"reference": "k3lab.ref.rmsnorm:rms_norm", "torch_compile": "k3lab.ref.rmsnorm:rms_norm",
              "triton": "k3lab_kernels.triton.norm_glu:norm_glu"},
    valid=lambda c: c["batch"] >= 1 and 1 <= c["dim"] <= 16384 and c["inter"] >= 1, test_file="tests/test_glue.py",
))
