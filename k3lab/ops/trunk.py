"""The trunk in the registry: projections (one, or a group fused by shared input), the router's top-k
selection and AttnRes + RMSNorm. The maths: k3lab.ref (situ.linear, router, attnres); the API
k3lab.components.trunk and k3lab.components.attnres; the kernels are named in each entry's backends table.

Axes (the default grid is small so the CPU interpreter runs it in seconds; the GPU bench passes its own):
  proj        preset "tp8" | "tp16" | "tiny" (the per-GPU shapes, `proj_shapes`; docs/MODEL.md), proj (the
              name of a projection of `proj_shapes`), batch 1..256, wdtype "bf16" | "fp8" (e4m3, one fp32 scale per
              output channel), residual (the output projection's epilogue: out = residual + x W^T), prologue
              "none" | "situ" (x = [g | u] [B, 2K], the projection reads situ(g, u): shared_w2) | "rms" (x [B, K],
              the projection reads RMSNorm(x) * weight: moe_up with fp32 x, the routed expert sum; mla_uq bf16) |
              "rms+situ" (moe_up_shared: x the routed sum through the rms prologue, x2 = [g | u] of the shared
              experts through SiTU, W = [Wup | w2]: the MoE's output in one launch)
  proj_group  preset, group ("kda_in", "mla_in", "moe_in": `GROUPS`), batch, wdtype: one launch over the
              concatenated weight, each part's output its own tensor (the router's logits fp32, others bf16);
              select (moe_in only): the router's top-16 and weights over the logits in the same launch
  router_topk batch, experts (896), top_k (16), scores "random" | "near" (logits in pairs 2^-12 apart: biased scores
              >= ~1e-5 apart, resolved in fp32) | "ties" (many exactly equal biased scores: the tie rule decides)
  attnres_norm batch 1..64, n_blocks 0..9, update "none" | "add" | "fresh" (the new-block layer: p = a), dim

Tie rule of the router (the kernel's and the reference's here; torch.topk documents none): descending
biased score, equal biased scores taken lower expert id first. k3lab.ref.router.route follows it too (a stable
sort, eighth session; it used torch.topk before); `ref_router` below is the oracle.

Peers (`k3lab bench trunk`): cuBLAS (F.linear on the same bf16 weights; for fp8 weights on their bf16
dequantization, as torch has no per-channel-scale fp8 GEMV for bf16 activations), the group's parts run
one after another (our kernel, one launch each) and cuBLAS on the group's parts; fla's fused_attnres
(with its output RMSNorm) on the updated partial; the torch reference, and torch.compile of it for the
router and AttnRes (the projections have no torch_compile backend: torch.compile of x @ W^T is the same
cuBLAS GEMM as the cublas peer).

Bytes (the one formula):
  proj        weights N*K*e (e = 2 bf16, 1 fp8 + 4*N scales) + x B*K*2 + outputs B*N*e_out (+ residual B*N*2);
              the situ prologue reads x [B, 2K] (B*2K*2), the rms one x [B, K] in its dtype and the weight K*2
  router_topk logits B*E*4 + bias E*4 + idx B*k*8 + weights B*k*4
  attnres     (n_blocks + 1 + [update add]) sources... see `attnres_bytes`: each source B*D*2, the three weight
              vectors D*2 each, out B*D*2, partial_out B*D*2 when updated
All at the read bandwidth (floor_bw "read").

Tolerances (relative norm against fp64; every input is exactly representable):
  proj outputs 4e-3: bf16 x bf16 (or e4m3 widened to bf16, exact) products are exact in fp32 and the sums are
      fp32 over K <= 7168 (~1e-6); the output is rounded once to bf16 (2^-9 relative per entry, ~1.5e-3 as a
      norm); the router's fp32 logits 1e-5. fp8 weights are compared against their dequantized fp64 value
      (W_fp8 * scale), so quantization is no error of the kernel. With a prologue the oracle applies it in fp64
      with no rounding; the kernel rounds its result to bf16 once (as the stand-alone op does): 2^-9 relative
      per input entry, averaging to ~1e-3 in the output's norm, within the same 4e-3. Option f16 (fp8 weights on
      f16 MMAs) rounds x to f16 first: exact for 2^-17 <= |x| < 65520 (every normal-range input), so the same.
  router idx 0 (exact: same set and order under the tie rule; the inputs keep distinct biased scores 2^-14
      apart or exactly equal), weights 1e-5 (fp32 sigmoid and sum).
  attnres partial_out 0 (bit-exact: one rounding of the fp32 sum of two bf16 values, which is exact),
      out 4e-3 (fp32 mix and norms, the output rounded to bf16).
"""
from __future__ import annotations

import functools
import os

import torch

from k3lab.config import preset as make_preset
from k3lab.registry import Case, Op, Peer, register
from k3lab.registry import generator as _gen

PRESETS = ("tp8", "tp16", "tiny")
PROLOGUES = {"none": None, "situ": ("shared_w2",), "rms": ("moe_up", "mla_uq"),  # prologue: the projections it feeds
             "rms+situ": ("moe_up_shared",)}
RMS_FP32_IN = ("moe_up",)  # the routed norm reads the experts' fp32 sum
GROUPS = {
    "kda_in": ("kda_q", "kda_k", "kda_v", "kda_g", "kda_fa", "kda_b"),
    "mla_in": ("mla_dq", "mla_dkv", "mla_gate"),
    "moe_in": ("moe_router", "moe_down", "shared_w1", "shared_w3"),
}
FP32_OUT = ("moe_router",)  # projections whose output is fp32 (the router's logits feed its top-k)
SELECT_K = 16  # the fused selection's top-k (K3's)
UPDATES = ("none", "add", "fresh")
MAX_OUT = 6  # outputs of one launch (k3lab_kernels.triton.proj_gemv.MAX_OUTPUTS)
TOL = dict(bf16_out=4e-3, fp32_out=1e-5, weights=1e-5, out=4e-3)
WHY = ("proj 4e-3: exact products, fp32 sums, one bf16 rounding of the output (fp32 outputs 1e-5); fp8 against "
       "the dequantized weights; router idx exact under the tie rule, weights 1e-5; attnres partial bit-exact, "
       "out 4e-3 (fp32 mix and norms, bf16 output)")


@functools.cache
def proj_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """{projection name: (N out, K in)} one GPU computes at `preset` (docs/MODEL.md, One GPU's share): the KDA input
    projections q, k, v, g, the decay's first factor fa and beta, its fb and output o; MLA q/kv down, gate,
    q up and output; the MoE router, latent down/up and the shared experts' w1, w3 (both experts' slices
    stacked) and w2. The MLA down-projections, the router and the latent projections are whole on every rank."""
    if preset not in PRESETS:
        raise ValueError(f"trunk: preset must be one of {PRESETS}, got {preset!r}")
    v = make_preset(preset)
    c = v.cfg
    D, H = c.hidden_size, v.heads
    kd = H * c.kda_head_dim
    sh = c.n_shared_experts * (c.shared_intermediate_size // v.tp)
    return {
        "kda_q": (kd, D), "kda_k": (kd, D), "kda_v": (kd, D), "kda_g": (kd, D), "kda_fa": (c.kda_decay_rank, D),
        "kda_b": (H, D), "kda_fb": (kd, c.kda_decay_rank), "kda_o": (D, kd),
        "mla_dq": (c.q_lora_rank, D), "mla_dkv": (c.kv_lora_rank + c.qk_rope_head_dim, D),
        "mla_gate": (H * c.v_head_dim, D), "mla_uq": (H * c.qk_head_dim, c.q_lora_rank), "mla_o": (D, H * c.v_head_dim),
        "moe_router": (c.n_routed_experts, D), "moe_down": (c.moe_latent_size, D), "moe_up": (D, c.moe_latent_size),
        "shared_w1": (sh, D), "shared_w3": (sh, D), "shared_w2": (D, sh),
        "moe_up_shared": (D, c.moe_latent_size + sh),  # [Wup | shared w2]: two K segments (prologue rms+situ)
    }


NAMES = tuple(proj_shapes("tiny"))


def _parts(case: Case) -> tuple[str, ...]:
    return GROUPS[case["group"]] if case.op == "proj_group" else (case["proj"],)


def _wbytes(case: Case) -> int:
    return 1 if case["wdtype"] == "fp8" else 2


def proj_bytes(case: Case) -> int:
    """Bytes a projection (or a fused group) must move (module docstring)."""
    shp = proj_shapes(case["preset"])
    B = case["batch"]
    parts = _parts(case)
    K = shp[parts[0]][1]
    N = sum(shp[p][0] for p in parts)
    outs = sum(B * shp[p][0] * (4 if p in FP32_OUT else 2) for p in parts)
    scales = 4 * N if case["wdtype"] == "fp8" else 0
    pro = case.get("prologue", "none")
    lat = shp["moe_up"][1]
    if pro == "situ":  # [g | u]
        x_in = B * 2 * K * 2
    elif pro == "rms":  # the rows (fp32 for the routed sum) and the norm weight
        x_in = B * K * (4 if parts[0] in RMS_FP32_IN else 2) + K * 2
    elif pro == "rms+situ":  # the routed sum (fp32) with its norm weight, then [g | u]
        x_in = B * lat * 4 + lat * 2 + B * 2 * (K - lat) * 2
    else:
        x_in = B * K * 2
    sel = shp[parts[0]][0] * 4 + B * SELECT_K * 12 if case.get("select", False) else 0  # bias, idx, weights
    return N * K * _wbytes(case) + scales + x_in + outs + sel + (B * N * 2 if case.get("residual", False) else 0)


def proj_flops(case: Case) -> int:
    shp = proj_shapes(case["preset"])
    return sum(2 * case["batch"] * shp[p][0] * shp[p][1] for p in _parts(case))


def router_bytes(case: Case) -> int:
    B, E, k = case["batch"], case["experts"], case["top_k"]
    return B * E * 4 + E * 4 + B * k * 12


def router_flops(case: Case) -> int:
    return 4 * case["batch"] * case["experts"]


def attnres_bytes(case: Case) -> int:
    B, D, n, u = case["batch"], case["dim"], case["n_blocks"], case["update"]
    src = n + (2 if u == "add" else 1)  # blocks, prefix (or the new output alone for "fresh"), the new output
    return src * B * D * 2 + 3 * D * 2 + B * D * 2 + (B * D * 2 if u != "none" else 0)


def attnres_flops(case: Case) -> int:
    return 6 * case["batch"] * case["dim"] * (case["n_blocks"] + 1)


# ---- inputs ---------------------------------------------------------------------------------------



def _weight(N: int, K: int, wdtype: str, g: torch.Generator, device: str):
    """(W, scale): bf16 [N, K] (scale an empty tensor) or e4m3 [N, K] with one fp32 scale per row."""
    w = torch.randn(N, K, generator=g, device=device) * K ** -0.5
    if wdtype == "fp8":
        from k3lab_kernels.triton.proj_gemv import quantize_fp8

        return quantize_fp8(w)
    return w.to(torch.bfloat16), torch.empty(0, dtype=torch.float32, device=device)


def make_proj(case: Case, seed: int, device: str) -> dict:
    shp = proj_shapes(case["preset"])
    parts = _parts(case)
    B, K = case["batch"], shp[parts[0]][1]
    N = sum(shp[p][0] for p in parts)
    g = _gen(seed, device)
    w, s = _weight(N, K, case["wdtype"], g, device)
    pro = case.get("prologue", "none")
    lat = shp["moe_up"][1]
    if pro in ("situ", "rms+situ"):  # g and u over the ranges where the tanh saturates and where it does not
        k2 = K - lat if pro == "rms+situ" else K
        gu = torch.cat([torch.randn(B, k2, generator=g, device=device) * 3,
                        torch.randn(B, k2, generator=g, device=device) * 20], 1).to(torch.bfloat16)
    if pro == "situ":
        x = gu
    elif pro == "rms+situ":
        x = torch.randn(B, lat, generator=g, device=device) * 3  # fp32: the routed experts' sum
    else:
        x = torch.randn(B, K, generator=g, device=device) * (3.0 if pro == "rms" else 1.0)
        x = x if pro == "rms" and parts[0] in RMS_FP32_IN else x.to(torch.bfloat16)
    d = dict(x=x, w=w, w_scale=s)
    kr = K if pro == "rms" else lat if pro == "rms+situ" else 0
    d["pro_w"] = (1 + 0.2 * torch.randn(kr, generator=g, device=device)).to(torch.bfloat16)
    if pro == "rms+situ":
        d["x2"] = gu
    k = SELECT_K if case.get("select", False) else 0
    E = shp[parts[0]][0] if k else 0
    d["e_bias"] = torch.randn(E, generator=g, device=device) * 0.1
    d["idx"] = torch.empty(B, k, dtype=torch.int64, device=device)
    d["weights"] = torch.empty(B, k, dtype=torch.float32, device=device)
    if case.get("residual", False):
        d["residual"] = torch.randn(B, N, generator=g, device=device).to(torch.bfloat16)
    for i in range(MAX_OUT):  # y0.. one per part (the rest empty: the written names are fixed)
        p = parts[i] if i < len(parts) else None
        d[f"y{i}"] = torch.empty(B if p else 0, shp[p][0] if p else 0, device=device,
                                 dtype=torch.float32 if p in FP32_OUT else torch.bfloat16)
    return d


def _wtrue(d: dict, dt=torch.float64) -> torch.Tensor:
    """The weight's exact value (fp8: dequantized with its per-row scale)."""
    w = d["w"].to(dt)
    return w * d["w_scale"].to(dt)[:, None] if d["w"].dtype == torch.float8_e4m3fn else w


def prologue_of(d: dict, case: Case):
    """The component API's prologue argument for this case (None, ("situ", 4, 25) or ("rms", weight, 1e-6))."""
    from k3lab.ref.situ import B1, B2

    pro = case.get("prologue", "none")
    return None if pro == "none" else ("situ", B1, B2) if pro == "situ" else ("rms", d["pro_w"], 1e-6)


def second_of(d: dict, case: Case) -> dict:
    """The component API's second K segment for this case: {} or dict(x2=..., prologue2=("situ", 4, 25))."""
    from k3lab.ref.situ import B1, B2

    return dict(x2=d["x2"], prologue2=("situ", B1, B2)) if case.get("prologue", "none") == "rms+situ" else {}


def ref_proj(d: dict, case: Case) -> dict:
    from k3lab.components.trunk import _prologue_ref

    pro = prologue_of(d, case)
    if pro is not None and pro[0] == "rms":
        pro = ("rms", pro[1].to(torch.float64), pro[2])
    xin = _prologue_ref(d["x"].to(torch.float64), pro)
    if "x2" in d:
        xin = torch.cat([xin, _prologue_ref(d["x2"].to(torch.float64), second_of(d, case)["prologue2"])], 1)
    y = xin @ _wtrue(d).T
    if "residual" in d:
        y = y + d["residual"].to(torch.float64)
    out, a = {}, 0
    for i, _ in enumerate(_parts(case)):
        n = d[f"y{i}"].shape[1]
        out[f"y{i}"] = y[:, a:a + n]
        a += n
    if case.get("select", False):  # the oracle's selection over its fp64 logits (the tie rule of ref_router)
        out.update(ref_router(dict(logits=out["y0"], e_bias=d["e_bias"]), Case.of("router_topk", top_k=SELECT_K)))
    return out


def make_router(case: Case, seed: int, device: str) -> dict:
    B, E, k = case["batch"], case["experts"], case["top_k"]
    g = _gen(seed)
    kind = case["scores"]
    if kind == "random":
        z, bias = torch.randn(B, E, generator=g) * 2, torch.randn(E, generator=g) * 0.1
    elif kind == "near":  # biased scores in pairs 2^-14 apart around the cut (fp32 resolves them)
        base = torch.randn(B, E // 2 + 1, generator=g)
        z = torch.stack([base, base + 2.0 ** -12], -1).reshape(B, -1)[:, :E]
        bias = torch.zeros(E)
    elif kind == "ties":  # a few distinct (logit, bias) pairs: many experts share a biased score exactly
        z = torch.randint(-2, 3, (B, E), generator=g).float() * 0.5
        bias = torch.zeros(E)
    else:
        raise ValueError(f"router_topk: scores must be random, near or ties, got {kind!r}")
    return dict(logits=z.to(device), e_bias=bias.to(device),
                idx=torch.empty(B, k, dtype=torch.int64, device=device),
                weights=torch.empty(B, k, dtype=torch.float32, device=device))


def ref_router(d: dict, case: Case) -> dict:
    """fp64 oracle with the tie rule: a stable sort of the negated biased scores keeps equal scores in id order."""
    s = torch.sigmoid(d["logits"].to(torch.float64))
    order = torch.sort(-(s + d["e_bias"].to(torch.float64)), dim=-1, stable=True).indices[:, :case["top_k"]]
    sel = torch.gather(s, -1, order)
    return dict(idx=order.to(torch.float64), weights=sel / sel.sum(-1, keepdim=True) * 1.0)


def make_attnres(case: Case, seed: int, device: str) -> dict:
    B, D, n, u = case["batch"], case["dim"], case["n_blocks"], case["update"]
    g = _gen(seed, device)

    def act(scale=1.0):
        return (torch.randn(B, D, generator=g, device=device) * scale).to(torch.bfloat16)

    d = {f"block{i}": act(1 + i / 4) for i in range(n)}
    d["prefix"] = act(2.0)
    d["new"] = act(0.5) if u != "none" else torch.empty(0, dtype=torch.bfloat16, device=device)
    for k in ("w_norm", "norm_w"):
        d[k] = (1 + 0.2 * torch.randn(D, generator=g, device=device)).to(torch.bfloat16)
    d["w_proj"] = (torch.randn(D, generator=g, device=device) * D ** -0.5 * 4).to(torch.bfloat16)  # scores O(1)
    d["out"] = torch.empty(B, D, dtype=torch.bfloat16, device=device)
    d["partial_out"] = torch.empty(B, D if u != "none" else 0, dtype=torch.bfloat16, device=device)
    return d


def blocks_of(d: dict) -> list[torch.Tensor]:
    return [d[f"block{i}"] for i in range(sum(1 for k in d if k.startswith("block")))]


def ref_attnres(d: dict, case: Case) -> dict:
    from k3lab.ref.attnres import attnres_norm

    f64 = torch.float64
    u = case["update"]
    out = {}
    if u == "none":
        p = d["prefix"]
    else:
        p = (d["new"].to(f64) if u == "fresh" else d["prefix"].to(f64) + d["new"].to(f64)).to(torch.bfloat16)
        out["partial_out"] = p.to(f64)
    _, y = attnres_norm([b.to(f64) for b in blocks_of(d)], p.to(f64), d["w_norm"].to(f64), d["w_proj"].to(f64),
                        d["norm_w"].to(f64), 1e-6, out_dtype=f64)
    out["out"] = y
    return out


def tolerances(case: Case) -> dict[str, float]:
    parts = _parts(case) if case.op in ("proj", "proj_group") else ()
    t = {f"y{i}": TOL["fp32_out"] if i < len(parts) and parts[i] in FP32_OUT else TOL["bf16_out"]
         for i in range(MAX_OUT)}
    return dict(t, idx=0.0, weights=TOL["weights"], out=TOL["out"], partial_out=0.0)


# ---- calls through the component API ----------------------------------------------------------------

def _scale(d: dict):
    return d["w_scale"] if d["w_scale"].numel() else None


def call_proj(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import trunk

    return trunk.proj(d["x"], d["w"], d["y0"], w_scale=_scale(d), residual=d.get("residual"),
                      prologue=prologue_of(d, case), **second_of(d, case), backend=backend, ran=ran, **opts)


def call_group(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import trunk

    sel = trunk.Select(d["e_bias"], d["idx"], d["weights"]) if case.get("select", False) else None
    return trunk.proj_group(d["x"], d["w"], [d[f"y{i}"] for i in range(len(_parts(case)))], w_scale=_scale(d),
                            select=sel, backend=backend, ran=ran, **opts)


def call_router(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import trunk

    return trunk.router_topk(d["logits"], d["e_bias"], top_k=case["top_k"], scaling=1.0, idx=d["idx"],
                             weights=d["weights"], backend=backend, ran=ran, **opts)


def call_attnres(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import attnres

    u = case["update"]
    return attnres.update_mix_norm(blocks_of(d), d["prefix"], d["new"] if u != "none" else None, d["w_norm"],
                                   d["w_proj"], d["norm_w"], out=d["out"],
                                   partial_out=d["partial_out"] if u != "none" else None, update=u,
                                   backend=backend, ran=ran, **opts)


# ---- peers ------------------------------------------------------------------------------------------------

def _dense_w(d: dict) -> torch.Tensor:
    """The bf16 weight cuBLAS multiplies: the weight itself, or fp8's dequantization (made outside the timed
    region, cached on the input set)."""
    if d["w"].dtype != torch.float8_e4m3fn:
        return d["w"]
    if "_w_bf16" not in d:
        d["_w_bf16"] = _wtrue(d, torch.float32).to(torch.bfloat16)
    return d["_w_bf16"]


def proj_peers(case: Case) -> list[Peer]:
    import torch.nn.functional as F

    parts = _parts(case)
    shp = proj_shapes(case["preset"])
    sizes = [shp[p][0] for p in parts]
    note_w = " on the bf16 dequantized weights" if case["wdtype"] == "fp8" else ""

    fp32_out = any(p in FP32_OUT for p in parts)

    def gemm(a, w):
        """One cuBLAS GEMM on bf16 operands; with an fp32 output among the parts (the router's logits) the GEMM
        writes fp32 (torch.mm's out_dtype, CUDA only; bf16 output rounded every logit and failed the fp32 check).
        On the CPU (tests) the same product in fp32 torch ops."""
        if not fp32_out:
            return F.linear(a, w)
        if a.is_cuda:
            return torch.mm(a, w.t(), out_dtype=torch.float32)
        return torch.mm(a.float(), w.float().t())

    def cublas(d: dict):
        from k3lab.components.trunk import _prologue_ref

        w, x, r = _dense_w(d), d["x"], d.get("residual")
        pro, two = prologue_of(d, case), second_of(d, case)
        if pro is not None:  # the prologue(s) in torch ops, then cuBLAS
            def xin():
                a = _prologue_ref(x, pro)
                return torch.cat([a, _prologue_ref(two["x2"], two["prologue2"])], 1) if two else a
            return lambda: gemm(xin(), w) if r is None else torch.addmm(r, xin(), w.t())
        if r is not None:
            return lambda: torch.addmm(r, x, w.t())
        return lambda: gemm(x, w)

    def checker_of(make, name):
        def check(c: Case, s: dict):
            from k3lab.harness import checker

            def impl(inp: dict) -> None:
                y = make(inp)()
                ys = y if isinstance(y, list) else list(y.split(sizes, dim=1))
                for i, t in enumerate(ys):
                    if t is not None:
                        inp[f"y{i}"].copy_(t)
            return checker.check(GROUP if c.op == "proj_group" else PROJ, c, impl=impl, impl_name=name, inputs=s)
        return check

    def stream(d: dict):
        from k3lab_kernels.triton.bw_probe import fit_config, stream_sum

        flat = d["w"].view(-1).view(torch.bfloat16)
        cfg = fit_config(flat.numel())
        if cfg is None:
            raise ValueError(f"stream peer: the weight's {flat.numel()} bf16 values are not a multiple of 16")
        part = torch.empty(flat.numel() // (cfg[0] * cfg[1]), dtype=torch.float32, device=flat.device)
        return lambda: stream_sum(flat, part, cfg)

    def stream_grid(d: dict):
        from k3lab_kernels.triton.bw_probe import grid_programs
        from k3lab_kernels.triton.bw_probe import stream_grid as read

        flat = d["w"].view(-1).view(torch.bfloat16)
        sms = torch.cuda.get_device_properties(flat.device).multi_processor_count if flat.is_cuda else 4
        part = torch.empty(grid_programs(flat.numel(), sms), dtype=torch.float32, device=flat.device)
        return lambda: read(flat, part)

    out = [Peer("cublas", cublas, checker_of(cublas, "cublas"),
                note=f"torch F.linear (cuBLAS) on the concatenated weight{note_w}"
                + (" (fp32 output: torch.mm out_dtype float32)" if fp32_out else ""))]
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":  # a Triton kernel: a GPU or the
        out.append(Peer("stream", stream, None, note="the read probe's streaming sum over the same weight bytes (no "
                        "product, nothing checked): how fast this harness reads these bytes at all"))  # interpreter
        out.append(Peer("stream_grid", stream_grid, None, note="the same read from a grid sized to the GPU (programs "
                        "walking tiles, no partial last wave: bw_probe.stream_grid)"))
    if case.get("prologue", "none") != "none":
        def unfused(d: dict):
            from k3lab.components import glue, trunk

            x, r, pro, y, two = d["x"], d.get("residual"), prologue_of(d, case), d["y0"], second_of(d, case)
            sc = _scale(d)
            if two:  # the step's composition before: rms_norm, Wup (+ p), situ_glu, w2 (+ that): four launches
                k1 = x.shape[1]
                w1, w2 = d["w"][:, :k1].contiguous(), d["w"][:, k1:].contiguous()
                a1 = torch.empty(x.shape[0], k1, dtype=torch.bfloat16, device=x.device)
                a2 = torch.empty(x.shape[0], w2.shape[1], dtype=torch.bfloat16, device=x.device)
                mid = torch.empty_like(y)

                def run2():
                    glue.rms_norm(x, pro[1], a1, eps=pro[2], backend="triton")
                    trunk.proj(a1, w1, mid, w_scale=sc, residual=r, backend="triton")
                    glue.situ_glu(two["x2"], a2, b1=two["prologue2"][1], b2=two["prologue2"][2], backend="triton")
                    return trunk.proj(a2, w2, y, w_scale=sc, residual=mid, backend="triton")  # (one scale a row)
                return run2
            a = torch.empty(x.shape[0], d["w"].shape[1], dtype=torch.bfloat16, device=x.device)

            def run():
                if pro[0] == "situ":
                    glue.situ_glu(x, a, b1=pro[1], b2=pro[2], backend="triton")
                else:
                    glue.rms_norm(x, pro[1], a, eps=pro[2], backend="triton")
                return trunk.proj(a, d["w"], y, w_scale=sc, residual=r, backend="triton")
            return run
        out.append(Peer("unfused", unfused, checker_of(unfused, "unfused"),
                        note="the stand-alone glue kernel(s) (situ_glu / rms_norm) then our projection(s): two "
                             "launches, four for two segments"))
    if case.op == "proj_group":
        def cublas_parts(d: dict):
            ws = list(_dense_w(d).split(sizes))
            x = d["x"]
            return lambda: [gemm(x, w) if p in FP32_OUT else F.linear(x, w) for p, w in zip(parts, ws)]

        def ours_parts(d: dict):
            from k3lab.components import trunk

            ws = list(d["w"].split(sizes))
            sc = list(d["w_scale"].split(sizes)) if d["w_scale"].numel() else [None] * len(ws)
            ys = [d[f"y{i}"] for i in range(len(parts))]
            x = d["x"]
            return lambda: [trunk.proj(x, w, y, w_scale=s, backend="triton") for w, s, y in zip(ws, sc, ys)]

        out += [Peer("cublas_parts", cublas_parts, checker_of(cublas_parts, "cublas_parts"),
                     note=f"cuBLAS, one F.linear per part{note_w}"),
                Peer("triton_parts", ours_parts, checker_of(ours_parts, "triton_parts"),
                     note="our projection kernel, one launch per part")]
    return out


def fla_available() -> tuple[bool, str]:
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        return False, "fla-core is not installed"
    if not torch.cuda.is_available():
        return False, "fla kernels need a GPU"
    return True, "fla"


def attnres_peers(case: Case) -> list[Peer]:
    """fla's fused_attnres with its output RMSNorm on blocks + [the updated partial] (the partial update is
    made outside the timed region: fla has none)."""
    if not fla_available()[0]:
        return []

    def make(d: dict):
        from fla.ops.attnres import fused_attnres

        want = ref_attnres(d, case)
        p = want["partial_out"].to(torch.bfloat16) if "partial_out" in want else d["prefix"]
        srcs = blocks_of(d) + [p]
        return lambda: fused_attnres(d["w_proj"], srcs, d["w_norm"], output_rms_weight=d["norm_w"], rms_eps=1e-6)

    def check(c: Case, s: dict):
        from k3lab.harness import checker

        def impl(inp: dict) -> None:
            y = make(inp)()
            inp["out"].copy_(y)
            if c["update"] != "none":
                inp["partial_out"].copy_(ref_attnres(inp, c)["partial_out"].to(torch.bfloat16))
        return checker.check(ATTNRES, c, impl=impl, impl_name="fla", inputs=s)

    return [Peer("fla", make, check, note="fla fused_attnres + output RMSNorm (partial updated outside)")]


def proj_facts(case: Case) -> dict:
    """What the trunk's auto rules filter a projection case on (k3lab.policy.matches): its weight format, its
    output rows (the parts' rows summed for a group) and its input width, as the component reads them off the call's
    tensors."""
    shp = proj_shapes(case["preset"])
    parts = _parts(case)
    return {"fmt": case.get("wdtype", "bf16"), "n": sum(shp[p][0] for p in parts), "k": shp[parts[0]][1]}


def _max_batch() -> int:
    from k3lab.components.trunk import MAX_BATCH

    return MAX_BATCH


def proj_supports(backend: str, shape: dict) -> str | None:
    """The batches the triton projections take (1..MAX_BATCH rows; `auto` then passes over triton to the
    reference, e.g. a verify step of more tokens); what the cute projection takes (bf16 or fp8 weights, batch <= 16,
    K a multiple of 8 / 16, no input prologue but rmsp (none with fp8), the fused selection at batch <= 4 with bf16
    weights: kernels/cute/proj_gemv.py). A shape or case without a key passes; the weight format is a call's `fmt`
    (k3lab.components.trunk's facts, the name the auto rules use) or a bench case's `wdtype` axis."""
    fmt = shape.get("fmt", shape.get("wdtype", "bf16"))
    if backend == "triton" and shape.get("batch", 1) > _max_batch():
        return f"x has {shape['batch']} rows; the triton projections take 1..{_max_batch()}"
    if backend == "cute":
        from k3lab_kernels.cute.proj_gemv import MAX_BATCH as CB

        if shape.get("batch", 1) > CB:
            return f"x has {shape['batch']} rows; the cute projection takes 1..{CB}"
        if fmt not in ("bf16", "fp8"):
            return "the cute projection takes bf16 or fp8 weights"
        if fmt == "fp8" and shape.get("select", False):
            return "the cute projection fuses the selection with bf16 weights only"
        if shape.get("prologue", "none") not in ("none", "rmsp"):
            return "the cute projection runs no input prologue but rmsp"
        if fmt == "fp8" and shape.get("prologue", "none") != "none":
            return "the cute projection's fp8 weights take no input prologue"
        kq = 16 if fmt == "fp8" else 8
        if shape.get("k") is not None and shape["k"] % kq:
            return f"the cute projection takes K a multiple of {kq} ({fmt} weights)"
        if shape.get("select", False) and shape.get("batch", 1) > 4:
            return "the cute projection fuses the selection at batch <= 4 (kernels/cute/proj_gemv.py)"
    return None


# ---- the entries --------------------------------------------------------------------------------------

_NONE = (None,)


def _proj_options_fit(case, opts: dict) -> bool:
    """The cute projection's `cluster` and `tile_m` split path "mma"'s work; the GEMV (path None / "gemv") refuses them
    by name, so a grid that sweeps them beside the paths (`--grid path=null,mma --grid tile_m=null,32`) times them
    with "mma" only instead of recording the GEMV's refusal as a row."""
    return opts.get("path") == "mma" or (opts.get("cluster") is None and opts.get("tile_m") is None)


_PROJ_OPTS = dict(
    option_axes={"path": {"triton": (None, "tma", "dot", "rows"), "cute": (None, "gemv", "mma")},
                 "cluster": {"cute": (None, 1, 2, 4, 8)}, "tile_m": {"cute": (None, 16, 32, 64)},
                 "block_n": {"triton": (None, 2, 4, 8, 16, 32, 64, 128, 256)},
                 "block_k": {"triton": (None, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)},
                 "split_k": {"triton": (None, *range(1, 57))}, "num_warps": {"triton": (None, 2, 4, 8)},
                 "num_stages": {"triton": (None, 1, 2, 3, 4, 5, 6, 8)}, "f16": {"triton": (None, False, True)},
                 "reduce": {"triton": (None, "last", "kernel")},
                 "pdl": {"triton": (None, False, True), "cute": (None, False, True)}},
    option_defaults={"path": _NONE, "cluster": _NONE, "tile_m": _NONE, "block_n": _NONE, "block_k": _NONE,
                     "split_k": _NONE, "num_warps": _NONE, "num_stages": _NONE, "f16": _NONE, "pdl": _NONE,
                     "reduce": _NONE},
    # timed as the decode step runs them: calls chained with programmatic dependent launch, each loading its first
    # weights while the call before finishes (the step's `pdl` switch); rows "triton_pdl" / "cute_pdl"
    variants={"triton_pdl": ("triton", {"pdl": True}), "cute_pdl": ("cute", {"pdl": True})},
    option_valid=_proj_options_fit,
)

PROJ = register(Op(
    name="proj", component="trunk", policy_key="proj",
    doc="one projection y = x W^T (+ residual): split-K GEMV at batch <= 16, tensor-core tiles above; bf16/fp8 W",
    axes=dict(preset=("tiny",), proj=("kda_q", "kda_b", "mla_dkv", "moe_router"), batch=(1, 3),
              wdtype=("bf16", "fp8"), residual=(False,), prologue=("none",)),
    make_inputs=make_proj, reference=ref_proj, written=tuple(f"y{i}" for i in range(MAX_OUT)), updated=(),
    tolerances=tolerances, tolerance_why=WHY, call=call_proj, nbytes=proj_bytes, flops=proj_flops, floor_bw="read",
    backends={"reference": "k3lab.ref.situ:linear", "triton": "k3lab_kernels.triton.proj_gemv:proj",
              "cute": "k3lab_kernels.cute.proj_gemv:proj"},
    valid=lambda c: c["preset"] in PRESETS and c["proj"] in NAMES and 1 <= c["batch"] <= _max_batch()
    and c["wdtype"] in ("bf16", "fp8") and c.get("prologue", "none") in PROLOGUES
    and (c.get("prologue", "none") == "none" or c["proj"] in PROLOGUES[c["prologue"]]),
    peers=proj_peers, test_file="tests/test_trunk.py", supports=proj_supports, rule_facts=proj_facts, **_PROJ_OPTS,
))

GROUP = register(Op(
    name="proj_group", component="trunk", policy_key="proj_group",
    doc="projections that read the same input as one launch over the concatenated weight, outputs apart",
    axes=dict(preset=("tiny",), group=tuple(GROUPS), batch=(1, 3), wdtype=("bf16", "fp8"), select=(False,)),
    make_inputs=make_proj, reference=ref_proj, written=tuple(f"y{i}" for i in range(MAX_OUT)) + ("idx", "weights"),
    updated=(),
    tolerances=tolerances, tolerance_why=WHY, call=call_group, nbytes=proj_bytes, flops=proj_flops,
    floor_bw="read",
    backends={"reference": "k3lab.ref.situ:linear", "triton": "k3lab_kernels.triton.proj_gemv:proj",
              "cute": "k3lab_kernels.cute.proj_gemv:proj"},
    valid=lambda c: c["preset"] in PRESETS and c["group"] in GROUPS and 1 <= c["batch"] <= _max_batch()
    and (not c.get("select", False) or (c["group"] == "moe_in" and c["batch"] <= 16)),
    peers=proj_peers, test_file="tests/test_trunk.py", supports=proj_supports, rule_facts=proj_facts, **_PROJ_OPTS,
))

ROUTER = register(Op(
    name="router_topk", component="trunk", policy_key="router_topk",
    doc="router selection after its projection: sigmoid, selection-only bias, top-k, renormalized weights",
    axes=dict(batch=(1, 5), experts=(896,), top_k=(16,), scores=("random", "near", "ties")),
    option_axes={"num_warps": {"triton": (None, 1, 2, 4, 8)},
                 "pdl": {"triton": (None, False, True), "cute": (None, False, True)}},
    option_defaults={"num_warps": _NONE, "pdl": _NONE},
    make_inputs=make_router, reference=ref_router, written=("idx", "weights"), updated=(),
    tolerances=tolerances, tolerance_why=WHY, call=call_router, nbytes=router_bytes, flops=router_flops,
    floor_bw="read",
    backends={"reference": "k3lab.components.trunk:topk_reference",
              "torch_compile": "k3lab.components.trunk:topk_reference",
              "triton": "k3lab_kernels.triton.router_topk:router_topk",
              "cute": "k3lab_kernels.cute.router_topk:router_topk"},
    valid=lambda c: 1 <= c["top_k"] <= min(c["experts"], 32) and c["batch"] >= 1,
    test_file="tests/test_trunk.py",
))

ATTNRES = register(Op(
    name="attnres_norm", component="trunk", policy_key="attnres_norm",
    doc="AttnRes partial update + softmax mix over blocks + [p] + RMSNorm of the mix, one launch",
    axes=dict(batch=(1, 3), n_blocks=(0, 1, 9), update=UPDATES, dim=(7168,)),
    option_axes={"num_warps": {"triton": (None, 1, 2, 4, 8, 16)}, "block_d": {"triton": (None, 128, 256, 512, 1024)},
                 "path": {"triton": (None, "split", "row")},
                 "cluster": {"cute": (None, 1, 2, 4, 8)}, "vec": {"cute": (None, 1, 2, 4, 8)},
                 "alpha": {"cute": (None, "threads", "twopass")}},
    option_defaults={"num_warps": _NONE, "block_d": _NONE, "path": _NONE, "cluster": _NONE, "vec": _NONE,
                     "alpha": _NONE},
    make_inputs=make_attnres, reference=ref_attnres, written=("out", "partial_out"), updated=(),
    tolerances=tolerances, tolerance_why=WHY, call=call_attnres, nbytes=attnres_bytes, flops=attnres_flops,
    floor_bw="read",
    backends={"reference": "k3lab.ref.attnres:attnres_norm", "torch_compile": "k3lab.ref.attnres:attnres_norm",
              "triton": "k3lab_kernels.triton.attnres_norm:attnres_norm",
              "cute": "k3lab_kernels.cute.attnres_norm:attnres_norm"},
    valid=lambda c: 0 <= c["n_blocks"] <= 9 and c["update"] in UPDATES and c["batch"] >= 1,
    peers=attnres_peers, test_file="tests/test_trunk.py",
))


def make_prefetch(case: Case, seed: int, device: str) -> dict:
    d = make_proj(Case.of("proj_group", preset=case["preset"], group=case["group"], batch=case["batch"],
                          wdtype=case["wdtype"]), seed, device)
    from k3lab.components.trunk import prefetch_plan

    plan = prefetch_plan(d["w"], case["batch"], case["budget"])
    return dict(w=d["w"], rec=torch.empty(max(plan["lines"], 1), dtype=torch.int64, device=device))


def ref_prefetch(d: dict, case: Case) -> dict:
    from k3lab.components.trunk import prefetch_lines, prefetch_plan

    p = prefetch_plan(d["w"], case["batch"], case["budget"])
    want = prefetch_lines(*d["w"].shape, p["ksplit"], p["span"], d["w"].element_size()) if p["lines"] else None
    return dict(rec=(want if want is not None else torch.full((1,), float("nan"))).to(torch.float64))


def call_prefetch(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import trunk

    return trunk.prefetch_l2(d["w"], case["batch"], budget=case["budget"], record=d["rec"], backend=backend,
                             ran=ran, **opts)


PREFETCH = register(Op(
    name="l2_prefetch", component="trunk", policy_key="l2_prefetch",
    doc="the prefetch switch: the first columns of every split-K range of an upcoming projection into L2",
    axes=dict(preset=("tiny",), group=("kda_in", "moe_in"), batch=(1, 3), wdtype=("bf16", "fp8"),
              budget=(1 << 16, 1 << 30)),
    make_inputs=make_prefetch, reference=ref_prefetch, written=("rec",), updated=(),
    tolerances=lambda c: dict(rec=0.0), tolerance_why="the record of the lines covered: exact indices",
    call=call_prefetch, nbytes=lambda c: 0, flops=lambda c: 0, floor_bw="read",
    backends={"reference": "k3lab.components.trunk:prefetch_lines",
              "triton": "k3lab_kernels.triton.l2_prefetch:prefetch", "cute": "k3lab_kernels.cute.l2_prefetch:prefetch"},
    valid=lambda c: c["group"] in GROUPS and c["budget"] >= 0 and 1 <= c["batch"] <= _max_batch(),
    test_file="tests/test_trunk.py",
))


# ---- the H200 evidence: named option sets per case, in the same call as the peers -------------------------

_BF = dict(preset="tp8", wdtype="bf16")
# (op, case, our option sets, peers): profiles/h200/trunk.json.gz, entries in priority order (h200_sweep).
H200_SWEEP: tuple[tuple[str, dict, tuple[dict, ...], tuple[str, ...]], ...] = (
    *(("router_topk", dict(batch=b, scores="random"), ({}, dict(pdl=True)), ()) for b in (1, 64)),
    *(("attnres_norm", dict(batch=b, n_blocks=9, update="add"), (dict(path="split"), dict(path="row")), ("fla",))
      for b in (1, 2, 4, 8, 16, 32, 64)),
    *(("proj", dict(_BF, proj=p, batch=b), ({},), ("cublas", "stream"))
      for b in (1, 8, 64) for p in ("kda_q", "kda_o", "mla_dkv", "moe_router", "moe_down", "shared_w1")),
    *(("proj_group", dict(preset="tp8", group=g, batch=1, wdtype="bf16"), ({},),
       ("cublas", "cublas_parts", "triton_parts")) for g in GROUPS),
    *(("proj", dict(preset="tp8", proj=p, batch=b, wdtype="fp8"), ({},), ("cublas", "stream"))
      for b in (1, 8) for p in ("kda_q", "kda_o", "moe_down")),
    *(("proj", dict(preset="tp16", proj=p, batch=b, wdtype="bf16"), ({},), ("cublas", "stream"))
      for b in (1, 64) for p in ("kda_q", "kda_o", "kda_b", "shared_w1", "shared_w2")),
    *(("proj", dict(_BF, proj="kda_q", batch=b), ({},), ("cublas",)) for b in (2, 4, 16, 32)),
    *(("proj_group", dict(preset="tp16", group=g, batch=1, wdtype="bf16"), ({},),
       ("cublas", "cublas_parts", "triton_parts")) for g in GROUPS),
)
# the exploration behind the defaults (profiles/h200/trunk_explore*.json.gz were made by the same function at
# commit d0dbd43, whose option sets included the variants measured and removed since: docs/NOTES_trunk.md)
_T = dict(path="tma")
H200_EXPLORE: tuple[tuple[str, dict, tuple[dict, ...], tuple[str, ...]], ...] = (
    *(("proj", dict(_BF, proj=p, batch=b),
       (dict(path="dot"), _T, dict(_T, num_stages=4), dict(_T, block_k=256, num_stages=3)), ("cublas", "stream"))
      for b in (1, 8) for p in ("kda_q", "kda_o", "moe_down", "mla_dkv")),
    *(("attnres_norm", dict(batch=b, n_blocks=9, update="add"),
       (dict(path="split", block_d=128, num_warps=4), dict(path="split", block_d=256, num_warps=8), dict(path="row")),
       ("fla",)) for b in (1, 64)),
)

# the input prologues against the stand-alone glue launches they replace (the step's `fuse_prologues` switch)
H200_PROLOGUE: tuple[tuple[str, dict, tuple[dict, ...], tuple[str, ...]], ...] = tuple(
    ("proj", dict(_BF, proj=p, batch=b, prologue=pro), ({}, dict(path="dot")),
     ("cublas", "unfused", "stream"))
    for b in (1, 4, 16) for p, pro in (("moe_up_shared", "rms+situ"), ("mla_uq", "rms"), ("moe_up", "rms"),
                                       ("shared_w2", "situ")))


def h200_sweep(out: str, *, reps: int = 10, deadline_s: float = 0.0, name: str = "trunk", entries=H200_SWEEP,
               device: str = "cuda", log=print):
    """The committed evidence: H200_SWEEP through `h200_explore` (each row checked against fp64, then timed
    with the inputs rotated past L2, beside the peers the entry names). Returns the bundle's path."""
    return h200_explore(out, reps=reps, deadline_s=deadline_s, name=name, entries=entries, device=device, log=log)


def h200_explore(out: str, *, reps: int = 10, deadline_s: float = 0.0, name: str = "trunk_explore",
                 entries=H200_EXPLORE, device: str = "cuda", log=print):
    """Each entry (op, case, option sets, peers): our kernel at every option set beside the named peers (of
    `proj_peers` / `attnres_peers`, the reference, torch_compile), on the same rotated input sets, every row
    checked against fp64 first (`k3lab.bench.runner.explore`); one bundle `name` under `out`. Returns its path."""
    from k3lab.bench import runner

    def impls(op, case, variants, peers, gpu):
        return ([runner._ours(op, case, "triton", dict(v)) for v in variants]
                + runner.named_peers(op, case, peers, gpu))

    return runner.explore(out, entries, impls, reps=reps, deadline_s=deadline_s, name=name, device=device, log=log)


def prefetch_experiment(out: str, *, groups=("kda_in", "moe_in"), batches=(1, 8),
                        budgets_mb=(0, 4, 8, 16, 24, 32, 48), n_blocks: int = 1, reps: int = 20,
                        name: str = "trunk_prefetch", preset: str = "tp8", device: str = "cuda", log=print):
    """Issue 13 item 6 (the `prefetch` switch): the next projection's time after an AttnRes phase, with its weight
    prefetched into L2 on a side stream beside that phase (`trunk.prefetch_l2`, budget b MB) and without (b = 0),
    as in the decode step: AttnRes + RMSNorm (n_blocks blocks, update "add") then the input group (preset, bf16),
    weights and activations rotated past L2 (one input set per call, graph replay). Rows per (group, batch, b):
    `seq` (AttnRes then the projection, the pair the step runs), `phase` (AttnRes with the prefetch beside it, no
    projection: what the prefetch costs the phase itself); and `proj` / `attnres` alone. Where it stops helping:
    the b at which `seq` stops falling. The bundle records the L2 size assumed. Returns the bundle's path."""
    from k3lab.harness import timing
    from k3lab.harness.bundle import Bundle
    from k3lab.switches import Switches

    pr = timing.probes(device)
    l2 = timing.l2_bytes() if device == "cuda" else 0
    bd = Bundle.new(name, switches=Switches(prefetch=True), copy_tbps=pr["copy_tbps"], read_tbps=pr["read_tbps"],
                    launch_floor_us=pr["launch_us"])
    bd.config = dict(preset=preset, groups=list(groups), batches=list(batches), budgets_mb=list(budgets_mb),
                     n_blocks=n_blocks,
                     update="add", reps=reps, l2_bytes_assumed=l2, mode="rotated", probes=pr)
    side = torch.cuda.Stream() if device == "cuda" else None  # (CPU: the smoke path, one stream)
    path = None
    for g in groups:
        for B in batches:
            _prefetch_case(bd, preset, g, B, budgets_mb, n_blocks, reps, pr, l2, side, device, log)
            if side is not None:
                torch.cuda.empty_cache()
            path = bd.save(out)
    log(f"bundle -> {path}")
    return path


def _prefetch_case(bd, preset: str, g: str, B: int, budgets_mb, n_blocks: int, reps: int, pr: dict, l2: int, side,
                   device: str, log) -> None:
    """prefetch_experiment's rows for one group and batch."""
    from k3lab.components import trunk
    from k3lab.harness import roofline, timing
    from k3lab.harness.bundle import Row

    case = GROUP.case(preset=preset, group=g, batch=B, wdtype="bf16")
    ac = ATTNRES.case(batch=B, n_blocks=n_blocks, update="add", dim=proj_shapes(preset)[GROUPS[g][0]][1])
    nb, ab = proj_bytes(case), attnres_bytes(ac)
    n = max(2, timing.rotation_count(nb, l2))
    sets = [(make_proj(case, 2000 + i, device), make_attnres(ac, 3000 + i, device)) for i in range(n)]

    def run(budget: int, proj: bool, attn: bool = True):
        def fn(d, a):
            cur = torch.cuda.current_stream() if side is not None else None
            if budget and cur is not None:
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    trunk.prefetch_l2(d["w"], B, budget=budget, backend="triton")
            elif budget:
                trunk.prefetch_l2(d["w"], B, budget=budget, backend="triton")
            if attn:
                call_attnres(a, ac, "triton", {})
            if budget and cur is not None:
                cur.wait_stream(side)
            if proj:
                call_group(d, case, "triton", {})
        return fn

    def row(label, fn, nbytes, **extra):
        t = timing.bench(fn, device=device, input_sets=sets, reps=reps, bytes_per_call=nbytes)
        fl = roofline.floor_from_probes(nbytes, 0, pr, "read")
        r = bd.add(Row.from_timing(f"{g}.b{B}.{label}", "triton", t, floor=fl, group=g, batch=B, **extra))
        log(f"{r.name:28s} {r.median_us:8.2f} us  (floor {r.floor_us:.2f})")

    row("proj", run(0, True, attn=False), nb)
    row("attnres", run(0, False), ab)
    for mb in budgets_mb:
        budget = int(mb * 2**20)
        plan = trunk.prefetch_plan(sets[0][0]["w"], B, budget)
        row(f"seq.{mb}MB", run(budget, True), nb + ab, budget_mb=mb, prefetched_bytes=plan["bytes"], plan=plan)
        if mb:
            row(f"phase.{mb}MB", run(budget, False), ab, budget_mb=mb, prefetched_bytes=plan["bytes"])
