"""Latent MoE in the registry: the routed experts of one decode step (grouped by expert, SiTU-GLU fused, the
routing weights and the sum over a token's experts applied). The maths is k3lab.ref.moe.routed_experts; the
API k3lab.components.moe.experts; the kernels are named in the entry's backends table.

Axes (the default grid is tiny so the CPU interpreter runs it in seconds; the GPU bench passes K3's sizes:
`--grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16`):
    batch      tokens of the step, 1..256
    dtype      expert weights: "bf16", "fp8" (e4m3, one fp32 scale per output channel), "mxfp4" (E2M1 + one
               E8M0 scale per 32 inputs)
    tp         8 or 16: each GPU holds inter / tp rows of w1/w3 (columns of w2) of every expert
    routing    "uniform" (k3lab.ref.router.route over random router weights: ~uniform choices), "same16"
               (every token chooses the same top_k experts: the router's selection bias on them), "ragged"
               (one expert chosen by every token, three by most, the rest by one or none), or the name of a
               trace in data/routing/ (k3lab.routing; its batches are `Trace.batch_ids`)
    latent, inter, n_experts, top_k   K3: 3584, 3072, 896, 16
The expert pool is drawn once per (format, sizes, device) directly in its stored format and shared by every
input set (a full TP8 pool is 7.4 GB in bf16, 3.7 GB fp8, 1.96 GB MXFP4); input sets differ in z and in the
routing, which is drawn from the set's seed, so rotated sets touch different experts: the weights a call
reads are far larger than L2 and come from DRAM (rotating the activations and routing is enough; at batch 1
in MXFP4, 35 MB a call, the timer's 7 sets pick 7 different expert sets of the 896).

Bytes (the one formula, `experts_bytes`): the DISTINCT experts touched x per-expert bytes 3*I*L*e
(e = 2 bf16; 1 + the fp32 channel scales for fp8; 1/2 + 1/32 for MXFP4) + z B*L*2 + ids and weights B*K*12
+ y B*L*4. Distinct experts: uniform E(1 - (1 - K/E)^B) (612 at batch 64), same16 K, ragged as uniform, a
trace its mean over `Trace.batch_ids` batches. Floor at the read bandwidth, from the experts the timed input sets
actually touch (`experts_set_bytes`, the registry's set_bytes: the bench's floor takes the mean over the sets; the
formula's expectation is kept in each row as `bytes_formula`, each set's bytes as `bytes_by_set`).

Tolerances (relative norm against fp64 on the dequantized weights, so the format's own quantization is no
error of the kernel): y 1e-2: z and every weight are exact in bf16 (fp8 scales multiply the fp32 row sums;
MXFP4 values are exact in bf16), products are exact in fp32 and summed in fp32, but the SiTU activation is
rounded to bf16 (2^-9 relative) for the tensor-core w2 product; ~1.5e-3 measured. The simt path (MXFP4) forms
each 32-block's products and sum in f16 (11-bit significand) from exact decoded weights and f16 activations of
2^6 x, then scales the block sum into fp32: ~1.0e-3 measured at K3 sizes (H200, every batch). The tc path (MXFP4)
multiplies the exact decoded weights by f16 activations of 2^6 x on tensor cores (products exact, fp32 sums),
the activation for w2 as f16 of 2^6 wk situ (11-bit significand, finer than bf16's). The reference and
torch.compile backends run each expert in z's dtype (bf16; ~5e-3) and sum in fp32.

Peers (GPU): `cublas_loop`, a plain loop of cuBLAS calls over the selected experts (bf16 and fp8 weights; fp8
multiplies e4m3 -> bf16 weights and applies the channel scales after): the groups (tokens per expert) are
found on the host outside the timed region, then per expert: gather z rows, x W1^T, x W3^T, SiTU, x W2^T,
times the routing weights, index_add into y. Batch <= 16 only (at 64 it is ~9,000 launches a call). MXFP4 has
no cuBLAS path on the H200 (no fp4 maths).
"""
from __future__ import annotations

import math

import torch

from k3lab import routing
from k3lab.ref import moe as ref
from k3lab.ref.moe import ExpertWeight, MoEWeights
from k3lab.ref.router import RouterWeights, route
from k3lab.ref.situ import situ
from k3lab.registry import Case, Op, Peer, register
from k3lab.registry import generator as _gen

FORMAT = {"bf16": "dense", "fp8": "fp8", "mxfp4": "mxfp4"}
ROUTINGS = ("uniform", "same16", "ragged")
TOL = 1e-2
WHY = ("y 1e-2: exact bf16 inputs and weights, fp32 products and sums, the SiTU activation rounded to bf16 for "
       "the w2 tensor-core product (~1.5e-3 measured); MXFP4 on the simt path: f16 products and 32-block sums "
       "(~1.0e-3 measured); MXFP4 on the tc path: f16 activations (11-bit significand), fp32 products and sums")
E2M1_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)


def inter_of(case: Case) -> int:
    return case["inter"] // case["tp"]


def per_expert_bytes(case: Case) -> int:
    I, L = inter_of(case), case["latent"]
    n = 3 * I * L
    return {"bf16": 2 * n, "fp8": n + (2 * I + L) * 4, "mxfp4": n // 2 + n // 32}[case["dtype"]]


def distinct_experts(case: Case) -> float:
    """The experts a step of `case` touches (expected for uniform / ragged, exact for same16, the trace's mean)."""
    E, K, B, r = case["n_experts"], case["top_k"], case["batch"], case["routing"]
    if r == "same16":
        return float(K)
    if r in ("uniform", "ragged"):
        return routing.uniform_distinct(E, K, B)
    return routing.load(r).mean_distinct(B)


def experts_bytes(case: Case, distinct: float | None = None) -> int:
    B, K, L = case["batch"], case["top_k"], case["latent"]
    d = distinct_experts(case) if distinct is None else distinct
    return int(round(d * per_expert_bytes(case))) + B * L * 2 + B * K * 12 + B * L * 4


def experts_set_bytes(d: dict, case: Case) -> int:
    """The bytes one input set makes the experts move: `experts_bytes` at the experts its routing actually chose
    (a draw of uniform routing touches a few more or fewer than the expectation: at batch 16, 896 experts, top-16,
    224.4 expected, a draw's standard deviation ~12, 5 %), so a row's floor is the bytes its timed sets moved."""
    return experts_bytes(case, float(torch.unique(d["idx"]).numel()))


def experts_flops(case: Case) -> int:
    return 2 * case["batch"] * case["top_k"] * 3 * inter_of(case) * case["latent"]


# ---- inputs -------------------------------------------------------------------------------------------

_pools: dict[tuple, MoEWeights] = {}




def _stack(fmt: str, E: int, rows: int, cols: int, device, g: torch.Generator) -> ExpertWeight:
    """[E, rows, cols] random weights drawn in their stored format (sd ~ cols^-0.5, so W x has unit scale)."""
    sd = cols ** -0.5
    if fmt == "dense":
        w = torch.randn(E, rows, cols, generator=g, device=device, dtype=torch.bfloat16)
        return ExpertWeight("dense", w.mul_(sd))
    if fmt == "fp8":
        q = torch.randn(E, rows, cols, generator=g, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        s = (0.5 + torch.rand(E, rows, generator=g, device=device)) * sd
        return ExpertWeight("fp8", q, s)
    packed = torch.randint(0, 256, (E, rows, cols // 2), generator=g, device=device, dtype=torch.uint8)
    e0 = 127 + round(math.log2(sd / E2M1_RMS))
    scales = torch.randint(e0 - 1, e0 + 2, (E, rows, cols // 32), generator=g, device=device, dtype=torch.uint8)
    return ExpertWeight("mxfp4", packed, scales)


def pool(case: Case, device) -> MoEWeights:
    """The expert pool of a case's format and sizes on `device`, drawn once (seed 0) and shared. Only the
    experts and a router over the latent are real (w_down / w_up are empty: the op starts at z)."""
    E, L, I = case["n_experts"], case["latent"], inter_of(case)
    fmt = FORMAT[case["dtype"]]
    key = (fmt, E, L, I, str(device))
    if key not in _pools:
        g = _gen(0, device)
        w1, w3 = _stack(fmt, E, I, L, device, g), _stack(fmt, E, I, L, device, g)
        w2 = _stack(fmt, E, L, I, device, g)
        router = RouterWeights(torch.randn(E, L, generator=g, device=device) * L ** -0.5,
                               torch.zeros(E, device=device), top_k=case["top_k"])
        _pools[key] = MoEWeights(router, torch.empty(L, 0, device=device), w1, w3, w2,
                                 torch.ones(L, device=device), torch.empty(0, L, device=device))
    return _pools[key]


def _route(case: Case, z: torch.Tensor, m: MoEWeights, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    r, E, K = case["routing"], case["n_experts"], case["top_k"]
    dev = z.device
    if r not in ROUTINGS:
        ids, w = routing.load(r).batch_ids(case["batch"], seed)
        return torch.from_numpy(ids).to(dev), torch.from_numpy(w).to(dev)
    bias = torch.zeros(E, device=dev)
    if r == "same16":
        bias[torch.randperm(E, generator=_gen(seed, "cpu"))[:K].to(dev)] = 1e3
    elif r == "ragged":
        bias[0] = 1e3  # every token
        bias[1:4] = 0.4  # most tokens
        bias[4] = -1e3  # nobody
    rw = RouterWeights(m.router.w, bias, top_k=K)
    idx, w, _ = route(z.float(), rw)
    return idx, w.float()


def make_experts(case: Case, seed: int, device: str) -> dict:
    B, L = case["batch"], case["latent"]
    m = pool(case, device)
    z = torch.randn(B, L, generator=_gen(seed, device), device=device).to(torch.bfloat16)
    idx, wk = _route(case, z, m, seed)
    return dict(z=z, idx=idx, weights_k=wk, moe=m, y=torch.empty(B, L, dtype=torch.float32, device=device))


def ref_experts(d: dict, case: Case) -> dict:
    f64 = torch.float64
    return dict(y=ref.routed_experts(d["z"].to(f64), d["idx"], d["weights_k"].to(f64), d["moe"]))


def call_experts(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import moe

    return moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend=backend, out=d["y"],
                       check_values=False, ran=ran, **opts)


# ---- peers --------------------------------------------------------------------------------------------

def cublas_loop_peer(case: Case) -> list[Peer]:
    """`cublas_loop` (module docstring) where it applies: a GPU, bf16 or fp8 weights, batch <= 16."""
    if not torch.cuda.is_available() or case["dtype"] == "mxfp4" or case["batch"] > 16:
        return []

    def build(d: dict):
        m, z, y = d["moe"], d["z"], d["y"]
        idx, wk = d["idx"].cpu(), d["weights_k"]
        groups = []
        for e in torch.unique(idx).tolist():  # host grouping, outside the timed region
            rows, slot = (idx == e).nonzero(as_tuple=True)
            groups.append((e, rows.to(z.device), wk[rows.to(z.device), slot.to(z.device)].unsqueeze(-1)))
        fp8 = m.w1.fmt == "fp8"

        def mm(x, w: ExpertWeight, e: int):
            if fp8:
                return (x @ w.data[e].to(torch.bfloat16).T) * w.scale[e].to(torch.bfloat16)
            return x @ w.data[e].T

        def run():
            y.zero_()
            for e, rows, w in groups:
                x = z.index_select(0, rows)
                a = situ(mm(x, m.w1, e), mm(x, m.w3, e), m.b1, m.b2)
                y.index_add_(0, rows, mm(a, m.w2, e).float() * w)
        return run

    def check(c: Case, s: dict):
        from k3lab import registry
        from k3lab.harness import checker

        return checker.check(registry.get(c.op), c, impl=lambda inp: build(inp)(), impl_name="cublas_loop",
                             inputs=s)

    return [Peer("cublas_loop", build, check, note="a loop of cuBLAS GEMMs over the selected experts (torch "
                 "matmul, bf16; host grouping outside the timed region)")]


def experts_supports(backend: str, shape: dict) -> str | None:
    """What the cute backend takes: bf16 and fp8 experts (kernels/cute/moe_dense.py) at one token (a thread a
    16-byte chunk of a row, so latent / CW <= 1024 and top-k x I / CW <= 1024, CW = 8 bf16 or 16 fp8 columns) and at
    more (the grouped twins' `grouped_supports`);
    MXFP4 experts (whose sizes the op's `_valid` already keeps to multiples of 32) at one token
    (kernels/cute/moe_experts.py) top-k x I/32 <= 1024 and latent/32 <= 1024 (threads a CTA of its down and up
    kernels); at more, the grouped kernels' `supports` (kernels/cute/moe_grouped.py: latent a multiple of a
    down CTA's rows and of four blocks a warp's part, I % 64, batch x top-k <= 4096).
    `shape` is a case of the op (batch, dtype, top_k, inter, tp, latent) or the component's call (B, fmt, K, I: the
    per-GPU slice, L); a key it lacks passes (the kernel checks its tensors)."""
    if backend != "cute":
        return None
    batch = shape.get("batch", shape.get("B", 1))
    fmt = shape.get("dtype", shape.get("fmt", "mxfp4"))
    k = shape.get("top_k", shape.get("K"))
    inter = shape.get("I")
    if inter is None and shape.get("inter") is not None:
        inter = shape.get("inter") // shape.get("tp", 1)
    lat = shape.get("L", shape.get("latent"))
    if fmt != "mxfp4":  # bf16 / fp8 (kernels/cute/moe_dense.py): one token, a thread a 16-byte chunk; or grouped
        if batch != 1:
            from k3lab_kernels.cute import moe_dense as md

            return md.grouped_supports(batch, k or 1, md.GROUP_ROWS * 4 if inter is None else inter,
                                       64 * md.GROUP_DOWN_TILES if lat is None else lat, fmt == "fp8")
        cw = 16 if fmt == "fp8" else 8
        if lat is not None and (lat % cw or lat // cw > 1024):
            return f"the cute {fmt} experts take a latent that is a multiple of {cw} and at most {1024 * cw}, got {lat}"
        if inter is not None and k is not None and (inter % cw or k * (inter // cw) > 1024):
            return (f"the cute {fmt} experts take I a multiple of {cw} with top-k x I/{cw} <= 1024, got {k} x "
                    f"{inter}")
        return None
    if batch != 1:  # the grouped kernels' own rule; a key the shape lacks passes
        from k3lab_kernels.cute import moe_grouped as mg

        return mg.supports(batch, k or 1, mg.UP_ROWS if inter is None else inter,
                           64 * max(mg.DOWN_TILES, mg.FEW_DOWN_TILES) if lat is None else lat)
    if k is not None and inter is not None and k * (inter // 32) > 1024:
        return f"the cute experts take top-k x I/32 <= 1024, got {k} x {inter // 32}"
    lat = shape.get("L", shape.get("latent"))
    if lat is not None and lat // 32 > 1024:
        return f"the cute experts take latent / 32 <= 1024, got {lat // 32}"
    return None


def _valid(c: Case) -> bool:
    r, E, K = c["routing"], c["n_experts"], c["top_k"]
    if c["dtype"] not in FORMAT or c["inter"] % c["tp"] or c["latent"] % 32 or not 1 <= K <= E or c["batch"] < 1:
        return False
    if c["dtype"] == "mxfp4" and inter_of(c) % 32:
        return False
    if r in ROUTINGS:
        return not (r == "ragged" and E < 8)
    try:
        tr = routing.load(r)
    except routing.TraceError:
        return False
    return tr.n_experts == E and tr.top_k == K


_NONE = (None,)

register(Op(
    name="moe_experts", component="moe", policy_key="experts",
    doc="the routed experts of one step: grouped by expert, w1/w3 + SiTU-GLU, w2 x routing weights, summed per token",
    axes=dict(batch=(1, 5), dtype=("bf16", "fp8", "mxfp4"), tp=(8,), routing=("uniform", "same16"), latent=(64,),
              inter=(256,), n_experts=(24,), top_k=(4,)),
    option_axes={"path": {"triton": (None, "gemv", "grouped", "simt", "tc"), "cute": (None, "token", "grouped")},
                 "block_n": {"triton": (None, 16, 32, 64, 128)},
                 "block_k": {"triton": (None, 64, 128, 256, 512)},
                 "block_l": {"triton": (None, 16, 32, 64, 128, 256, 512)},
                 "block_t": {"triton": (None, 1, 2, 16, 32, 64)}, "num_warps": {"triton": (None, 2, 4, 8)},
                 "num_stages": {"triton": (None, 1, 2, 3, 4, 5)}, "persist": {"triton": (None, 0, 2, 4, 8, 16)},
                 "maxnreg": {"triton": (None, 80, 96, 128, 160, 248)}, "leaders": {"triton": (None, False, True)},
                 "wait": {"triton": (None, "all", "expert")}},
    option_defaults={"path": _NONE, "block_n": _NONE, "block_k": _NONE, "block_l": _NONE, "block_t": _NONE,
                     "num_warps": _NONE, "num_stages": _NONE, "persist": _NONE, "maxnreg": _NONE,
                     "leaders": _NONE, "wait": _NONE},
    make_inputs=make_experts, reference=ref_experts, written=("y",), updated=(),
    tolerances=lambda c: dict(y=TOL), tolerance_why=WHY, call=call_experts,
    nbytes=experts_bytes, flops=experts_flops, floor_bw="read", set_bytes=experts_set_bytes,
    backends={"reference": "k3lab.ref.moe:routed_experts", "torch_compile": "k3lab.ref.moe:routed_experts",
              "triton": "k3lab_kernels.triton.moe_experts:moe_experts",
              "cute": "k3lab_kernels.cute.moe_experts:moe_experts"},
    valid=_valid, peers=cublas_loop_peer, test_file="tests/test_moe_kernels.py", supports=experts_supports,
))
