"""Per-layer builder for timing: one KDA or MLA decoder layer of a `GpuView`, split into components.

    layer = build_layer(view, "kda" | "mla", seed=0, n_experts=None, device="cuda", dtype=torch.bfloat16)
    for name, (fn, bytes_moved, flops) in layer.components().items():
        fn()                                  # zero-argument: reads/writes the layer's prepared buffers
    y = layer.step(x)                         # the whole layer = every component in order

A layer holds its weights (k3lab.weights), its state at `view.context` (KDA: random fp32 state and conv
state; MLA: a latent cache of view.context_per_gpu random positions plus room for the new ones, in
view.kv_dtype), the AttnRes history (n_blocks random block vectors), and `buf`, a dict of prepared
activations. `prepare()` (run at build) fills `buf` by running the layer once, so every component
callable can be timed alone, repeatedly: each reads its inputs from `buf` and stores its outputs there.
Calls are idempotent in shape: the MLA cache write always lands at the same positions and KDA state
is updated in place (its values drift, its size does not).

Tokens: N = batch * T with T = view.tokens_per_seq (draft_depth + 1). T > 1 runs the KDA core as
`verify` into preallocated state/conv histories and MLA with causal masking among the new positions.

Components, in order (kda | mla attention; the MLP is MoE except for layer 0's dense MLP):
    attnres_attn   mix over B + [x] fused with rms(.; input_norm)
    kda: qkv_proj, decay_proj (Wfa, Wfb, Wb), gate_proj (Wg), kda_core (k3lab.components.kda.decode,
         imported lazily), out_proj (Wo, plus the residual p = x + a)
    mla: q_proj (Wdq, q_norm, Wuq, absorb Wuk), kv_proj (Wdkv, kv_norm, cache write), attn (scores,
         softmax, o_lat over the cache), gate_proj (Wgate), out_proj (Wuv, gate, Wo, residual)
    attnres_mlp    mix over B' + [p] fused with rms(.; post_attn_norm)
    moe: router, latent_down, experts (only the experts the prepared routing selected), latent_up
         (rms(y; routed_norm), Wup), shared (the shared experts, plus p + routed + shared)
    dense (layer 0): dense_mlp (plus the residual)

bytes_moved = weight bytes read (storage format: bf16 2, fp8 1 + scales, MXFP4 0.5 + 1/32 per value)
+ activations read and written (activation dtype, float32 for the AttnRes mix inputs' history and y)
+ state / cache bytes read and written (KDA state read+write, conv state read+write; MLA cache: the
local history read once per sequence, new entries written). flops = 2 * multiply-adds of the matmuls
plus the attention / recurrence maths (elementwise work is not counted). Under TP the attention output
projection, the shared experts and the routed w2 output are partial sums: the all-reduce is not part
of any component here.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from k3lab import registry
from k3lab.components import moe as moe_comp
from k3lab.components.attnres import mix_norm
from k3lab.config import ConfigError, GpuView
from k3lab.ref import mla as mla_ref
from k3lab.ref import moe as moe_ref
from k3lab.ref import router as ref_router
from k3lab.ref.layers import KDALayerState, MLALayerState, n_blocks_after
from k3lab.ref.situ import linear, situ_glu_mlp
from k3lab.switches import BackendUnavailable, SwitchError, Switches
from k3lab.weights import LayerWeights, make_layer

Component = tuple[Callable[[], Any], int, int]

# backends with a path per component group; None = whatever the group's component module accepts (kda)
# "proj": triton runs the plain projections on the trunk kernel (Layer._lin); any other backend is torch matmuls
# (cuBLAS on a GPU), labelled "reference"
_IMPLEMENTED: dict[str, tuple[str, ...] | None] = {
    "attnres": ("reference", "torch_compile", "triton", "cute"),  # k3lab_kernels.{triton,cute}.attnres_norm
    "mla": ("reference", "torch_compile", "triton", "cute"),  # cute: decode (T = 1), cache write and combine
    "moe": ("reference", "torch_compile", "triton", "cute"),  # triton: moe_experts' paths; cute: MXFP4 (token, grouped)
    # triton / cute: trunk.route (the projection on the trunk kernel + router_topk on that backend; triton up to 16
    # rows: the selection in the projection's launch)
    "router": ("reference", "torch_compile", "triton", "cute"),
    "kda": None,
    "proj": ("reference", "torch_compile", "triton", "cute", "aiter"),
}  # proj on triton: the plain projections through k3lab.components.trunk.proj (Layer._lin); else torch
# paths that exist for some layers only: (group, backend) -> (whether this layer has it, why not)
_PATH_RULES = {("moe", "cute"): (lambda L: L.w.mlp_kind == "moe" and _moe_cute_takes(L),
                                 "the CuTe experts take MXFP4 experts (one token, or the grouped kernels' sizes) "
                                 "and bf16 / fp8 experts (one token, or the grouped twins' sizes: "
                                 "k3lab.ops.moe.experts_supports)"),
               ("mla", "cute"): (lambda L: L.kind == "mla" and _mla_cute_takes(L),
                                 "the CuTe MLA decode takes one new position over a bf16 cache of K3's widths "
                                 "(C = 512, Dr = 64), at most 16 heads, pad_heads 0 or 16")}


def _moe_cute_takes(L) -> bool:
    """Whether the CuTe experts take this MoE layer's tokens and pool (k3lab.ops.moe.experts_supports)."""
    from k3lab.ops.moe import experts_supports

    m = L.w.mlp
    return experts_supports("cute", dict(B=L.N, fmt=m.w1.fmt, K=m.router.top_k, I=m.w1.shape[1],
                                         L=m.w_down.shape[0])) is None


def _mla_cute_takes(L) -> bool:
    """Whether k3lab_kernels.cute.mla_decode takes this MLA layer's attention (k3lab.ops.mla.decode_supports)."""
    from k3lab.ops.mla import decode_shape, decode_supports

    w = L.w.attn
    return decode_supports("cute", decode_shape(L.B, L.T, w.heads, w.kv_lora, w.rope_dim, L.state.cache,
                                                pad_heads=L.switches.pad_heads)) is None


def _nb(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _mix(blocks, x, vecs, eps, be, ran=None):
    """AttnRes + RMSNorm of `x` over `blocks`; the triton / cute kernels take rows [N, D]: [B, T, D] runs flattened.
    A fused backend that the `auto` rule for these rows names too runs through `auto`, so that the rule's measured
    options (the CuTe kernel's cluster / vec / alpha by batch: data/trunk_defaults.json) apply and the component's
    record says which rule ran; the step resolves the group's `auto` to that backend (k3lab.step.resolve_switches),
    and a backend named without options would otherwise take the kernel's own choice."""
    if be in ("triton", "cute"):
        from k3lab.components import dispatch

        D = x.shape[-1]
        if dispatch.select("attnres_norm", "auto", B=x.numel() // D)[0] == be:
            be = "auto"
        if x.dim() > 2:
            y = mix_norm([t.reshape(-1, D) for t in blocks], x.reshape(-1, D), *vecs, eps=eps, backend=be, ran=ran)
            return y.view(x.shape)
    return mix_norm(blocks, x, *vecs, eps=eps, backend=be, ran=ran)


def _default_index(view: GpuView, kind: str) -> int:
    cfg = view.cfg
    for i in range(1, cfg.num_hidden_layers):
        if cfg.layer_kind(i) == kind:
            return i
    if cfg.layer_kind(0) == kind:
        return 0
    raise ConfigError(f"the config has no {kind!r} layer")


# Layer.align_twin: how far an expert the router left out may score above one it picked, on the layer's own input
# and weights in fp64, for the picks to count as right (the kernels sum fp32 logits over K = 7168: ~1e-5 on a score)
ALIGN_OWN_TOL = 1e-4


class Layer:
    """One layer on one GPU, ready for per-component timing (see the module docstring)."""

    def __init__(self, view: GpuView, weights: LayerWeights, *, device, dtype: torch.dtype, seed: int = 0,
                 n_blocks: int | None = None, switches: Switches | None = None, fp8_scale: str = "tensor"):
        self.view = view
        self.w = weights
        self.kind = weights.attn_kind
        self.index = weights.index
        self.device = torch.device(device)
        self.dtype = dtype
        self.seed = seed
        self.switches = switches or Switches()
        self.fp8_scale = fp8_scale
        self.T = view.tokens_per_seq
        self.B = view.batch
        self.N = self.B * self.T
        self.n_blocks = n_blocks_after(self.index, view.cfg.attnres_block_size) if n_blocks is None else n_blocks
        self.block_start = self.index % view.cfg.attnres_block_size == 0
        self.buf: dict[str, Any] = {}
        self._group_of: dict[str, str] = {}
        self._groups: dict[str, str] = {}
        self.ran: dict[str, str] = {}  # component -> backend it runs under
        # component -> the component API's record of its last call (k3lab.components.dispatch.Ran as a dict:
        # backend, kernel, options, why), where the layer keeps one (the AttnRes, KDA core, MLA attention, experts)
        self.records: dict[str, dict[str, Any]] = {}
        # weights concatenated for one launch (("glu", ids): _glu's pair; "decay"), the owners' attributes views
        self._cat: dict[Any, Any] = {}
        self.skipped: dict[str, str] = {}  # component -> why it is left out of components()
        # drawn on the CPU so a CPU float64 build and a GPU bf16 build of the same seed hold the same values
        self._gen = torch.Generator(device="cpu").manual_seed(seed + 7919 * (self.index + 1))
        self.state = self.alloc_state()
        self.prepare()

    # ---- state and inputs ------------------------------------------------------------------------
    def _randn(self, *shape, std=1.0, dtype=None) -> torch.Tensor:
        t = torch.randn(*shape, generator=self._gen, dtype=torch.float32)
        return (t * std).to(device=self.device, dtype=dtype or self.dtype)

    def alloc_state(self, context: int | None = None):
        """KDA: random state (std 0.1, fp32 or the kda_state_dtype switch) and conv state. MLA: a cache of
        `context` (default view.context_per_gpu) random positions (+ T free slots), lengths = context."""
        if self.kind == "kda":
            p = self.w.attn.params
            sdt = torch.bfloat16 if self.switches.kda_state_dtype == "bf16" else torch.float32
            if self.dtype == torch.float64:
                sdt = torch.float64
            C = 3 * p.heads * p.head_dim
            st = KDALayerState(self._randn(self.B, p.heads, p.head_dim, p.head_dim, std=0.1, dtype=sdt),
                               self._randn(self.B, C, p.conv_kernel - 1))
            return st
        ctx = self.view.context_per_gpu if context is None else context
        w = self.w.attn
        kv_dtype = self.view.kv_dtype if self.dtype != torch.float64 else None
        cache = mla_ref.MLACache.empty(self.B, ctx + self.T, w.entry_width, dtype=self.dtype, device=self.device,
                                       kv_dtype=kv_dtype, fp8_scale=self.fp8_scale)
        chunk = 4096
        for a in range(0, ctx, chunk):
            n = min(chunk, ctx - a)
            ent = self._randn(self.B, n, w.entry_width, dtype=torch.float32)
            cache.write(torch.full((self.B,), a, dtype=torch.long, device=self.device), ent)
        return MLALayerState(cache, torch.full((self.B,), ctx, dtype=torch.long, device=self.device))

    def prepare(self) -> None:
        """Random stream x and block history, then one full pass so every buffer holds real values."""
        D = self.view.cfg.hidden_size
        lead = (self.B, self.T) if self.T > 1 else (self.B,)
        self.buf["x"] = self._randn(*lead, D)
        self.buf["blocks"] = [self._randn(*lead, D) for _ in range(self.n_blocks)]
        if self.kind == "kda":
            p = self.w.attn.params
            H, Dh = p.heads, p.head_dim
            self.buf["o"] = torch.empty(*lead, H * Dh, dtype=self.dtype, device=self.device)
            if self.T > 1:
                st = self.state
                self.kda_state_hist()
                self.buf["conv_hist"] = torch.empty(self.B, self.T, *st.conv_state.shape[1:],
                                                    dtype=st.conv_state.dtype, device=self.device)
        for fn, _, _ in self.components(all_components=True).values():
            fn()

    # ---- components ------------------------------------------------------------------------------
    def kda_checkpoint(self) -> int:
        """The KDA verify's checkpoint c for this layer's batch and T (the `kda_checkpoint` switch: "auto" is the
        component's measured rule, k3lab.components.kda.default_checkpoint; a fixed c above T keeps the last
        position only, i.e. c = T)."""
        from k3lab.components.kda import default_checkpoint
        c = self.switches.kda_checkpoint
        return default_checkpoint(self.B, self.T) if c == "auto" else min(c, self.T)

    def kda_state_hist(self) -> torch.Tensor:
        """The verify path's state_hist buffer, (re)allocated when its slots (k3lab.components.kda.history_slots at
        this layer's checkpoint) differ from the buffer's, e.g. after the `kda_checkpoint` switch changed."""
        from k3lab.components.kda import history_slots
        st, h = self.state, self.buf.get("state_hist")
        n = history_slots(self.T, self.kda_checkpoint(), self.B)
        if h is None or h.shape[1] != n:
            h = self.buf["state_hist"] = torch.empty(self.B, n, *st.state.shape[1:], dtype=st.state.dtype,
                                                     device=self.device)
        return h

    def _backend(self, group: str) -> str | None:
        """The backend a component group runs under, or None when that backend has no path for it."""
        be = self.switches.backend.get(group, "reference")
        impl = _IMPLEMENTED.get(group)
        if impl is not None and be not in impl:
            return None
        rule = _PATH_RULES.get((group, be))
        if rule is not None and not rule[0](self):
            return None
        return be

    def components(self, *, all_components: bool = False) -> OrderedDict[str, Component]:
        """name -> (zero-argument callable returning its output, bytes_moved, flops), in layer order.
        Components whose requested backend has no implementation are left out (see `self.skipped`)
        unless all_components=True, which runs them on the reference path (used by prepare)."""
        comps: OrderedDict[str, Component] = OrderedDict()
        comps["attnres_attn"] = self._attnres("attn")
        comps.update(registry.layer_part(self.kind)(self))
        comps["attnres_mlp"] = self._attnres("mlp")
        comps.update(registry.layer_part(self.w.mlp_kind)(self))
        self.ran = {n: g for n, g in self._groups.items()}
        self.skipped = {}
        out: OrderedDict[str, Component] = OrderedDict()
        for name, comp in comps.items():
            group = self._group_of[name]
            be = self._backend(group)
            if be is None:
                want = self.switches.backend.get(group)
                rule = _PATH_RULES.get((group, want))
                self.skipped[name] = (f"backend {want!r} has no {group!r} path here "
                                      + (f"({rule[1]})" if rule is not None and want in (_IMPLEMENTED[group] or ())
                                         else f"(implemented: {_IMPLEMENTED[group]})"))
                if not all_components:
                    continue
            out[name] = comp
        return out

    def step(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """The whole layer on stream x ([B, D], or [B, T, D] when T > 1); returns the new stream.
        Refuses when some component's requested backend has no path (no silent fallback)."""
        if x is not None:
            if x.shape != self.buf["x"].shape:
                raise ValueError(f"Layer.step: x must have shape {tuple(self.buf['x'].shape)}, got {tuple(x.shape)}")
            self.buf["x"] = x.to(device=self.device, dtype=self.dtype)
        comps = self.components()
        if self.skipped:
            raise BackendUnavailable(f"Layer.step: components without a path for the requested backend: "
                                     f"{self.skipped}")
        for fn, _, _ in comps.values():
            fn()
        return self.buf["x_out"]

    # helpers
    @property
    def e(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def _mm(self, w: torch.Tensor, n_in: int | None = None) -> tuple[int, int]:
        """(bytes, flops) of N tokens through w [out, in]."""
        out, inn = w.shape[0], w.shape[-1] if n_in is None else n_in
        return _nb(w) + self.N * (inn + out) * self.e, 2 * self.N * inn * out

    def _reg(self, name: str, group: str) -> str:
        self._group_of[name] = group
        be = self._backend(group)
        if group == "proj":  # the projections run on the trunk kernel (`_lin`) or as torch matmuls
            be = "triton" if self._proj_kernel() else "reference"
        self._groups[name] = "reference" if be is None else be
        return self._groups[name]

    def _proj_kernel(self) -> bool:
        """Whether the "proj" group's plain projections run on the trunk projection kernel: backend triton, bf16,
        at most the kernel's batch (k3lab.components.trunk.MAX_BATCH tokens)."""
        from k3lab.components.trunk import MAX_BATCH

        return self._backend("proj") == "triton" and self.dtype == torch.bfloat16 and self.N <= MAX_BATCH

    def _lin(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ residual) in x's dtype: one `trunk.proj` launch (the residual added in its epilogue) when
        `_proj_kernel()`, else torch (cuBLAS on a GPU). The norms and SiTU between projections take the kernels on
        the same condition (`_norm`: the glue's; `_glu`: the projection's prologue); the decode step fuses further
        (groups by shared input, prologues: `k3lab.step._fused_parts`)."""
        if not self._proj_kernel():
            y = linear(x, w)
            return y if residual is None else residual + y
        from k3lab.components import trunk

        r = None if residual is None else residual.reshape(-1, residual.shape[-1]).contiguous()
        y = trunk.proj(x.reshape(-1, x.shape[-1]).contiguous(), w, residual=r, backend="triton")
        return y.view(*x.shape[:-1], w.shape[0])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms(x; weight) in the compute dtype: the glue's RMSNorm launch when `_proj_kernel()` (fp32 maths, one
        rounding), else the reference."""
        from k3lab.ref.rmsnorm import rms_norm

        if not self._proj_kernel():
            return rms_norm(x, weight, eps, out_dtype=self.dtype)
        from k3lab.components import glue

        y = glue.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps=float(eps), backend="triton")
        return y.view(*x.shape[:-1], x.shape[-1])

    def _cat_once(self, key: Any, *specs: tuple[list, int]) -> tuple[torch.Tensor, ...]:
        """The weights concatenated for one launch, each spec ([(owner, attribute), ...], dim), made on first use and
        kept under `key`; the owners' attributes are re-pointed at views of the result (k3lab.step._cat_rows: no
        second copy)."""
        if key not in self._cat:
            from k3lab.step import _cat_rows

            self._cat[key] = tuple(_cat_rows(attrs, dim=dim) for attrs, dim in specs)
        return self._cat[key]

    def _glu(self, x: torch.Tensor, gs, residual: torch.Tensor | None = None) -> torch.Tensor:
        """sum_i W2_i situ(W1_i x, W3_i x) (+ residual) over the SiTU-GLU MLPs `gs` (the shared experts; the dense
        MLP alone). With `_proj_kernel()` and one pair of SiTU constants: two launches of the trunk projection, every
        w1 and w3 as one weight [W1_1; ..; W3_1; ..] (so its output is [g | u]), then every w2 as one weight
        [W2_1 | W2_2 ..] over the SiTU prologue with the residual in its epilogue (above the step's
        PROLOGUE_MAX_TOKENS, where the step measured the prologues slower, the SiTU is the glue's own launch between
        them; the weights are concatenated once, when first used); else torch, one MLP at a time."""
        gs = list(gs)
        consts = {(float(g.b1), float(g.b2)) for g in gs}
        if not self._proj_kernel() or len(consts) != 1:
            y = None
            for g in gs:
                t = situ_glu_mlp(x, g)
                y = t if y is None else y + t
            return y if residual is None else residual + y
        from k3lab.components import trunk

        w13, w2 = self._cat_once(("glu",) + tuple(id(g) for g in gs),
                                 ([(g, "w1") for g in gs] + [(g, "w3") for g in gs], 0), ([(g, "w2") for g in gs], 1))
        gu = trunk.proj(x.reshape(-1, x.shape[-1]).contiguous(), w13, backend="triton")
        r = None if residual is None else residual.reshape(-1, residual.shape[-1]).contiguous()
        b1, b2 = consts.pop()
        from k3lab.step import PROLOGUE_MAX_TOKENS

        if gu.shape[0] <= PROLOGUE_MAX_TOKENS:  # the SiTU in w2's launch (measured slower above: the step's rule)
            y = trunk.proj(gu, w2, residual=r, prologue=("situ", b1, b2), backend="triton")
        else:
            from k3lab.components import glue

            y = trunk.proj(glue.situ_glu(gu, b1=b1, b2=b2, backend="triton"), w2, residual=r, backend="triton")
        return y.view(*x.shape[:-1], w2.shape[0])

    def _keep(self, name: str, rec: list) -> None:
        """The last record a component call appended (what ran: backend, kernel, options), kept by name."""
        if rec:
            self.records[name] = rec[-1].to_dict()

    def _attnres(self, which: str) -> Component:
        lw, b = self.w, self.buf
        D = self.view.cfg.hidden_size
        eps = self.view.cfg.rms_norm_eps
        name = f"attnres_{which}"
        be = self._reg(name, "attnres")
        if which == "attn":
            vecs = (lw.attn_res_norm, lw.attn_res_proj, lw.input_norm)

            def fn():
                # with no blocks the spec skips the mix; a softmax over the single source x is 1, so the
                # fused call computes the same rms(x; input_norm)
                rec = []
                b["h"] = _mix(b["blocks"], b["x"], vecs, eps, be, rec)
                self._keep(name, rec)
                b["blocks_mlp"] = b["blocks"] + [b["x"]] if self.block_start else b["blocks"]
                return b["h"]
            n_src = self.n_blocks + 1
        else:
            vecs = (lw.mlp_res_norm, lw.mlp_res_proj, lw.post_attn_norm)

            def fn():
                rec = []
                b["h2"] = _mix(b["blocks_mlp"], b["p"], vecs, eps, be, rec)
                self._keep(name, rec)
                return b["h2"]
            n_src = self.n_blocks + (1 if self.block_start else 0) + 1
        return fn, _nb(*vecs) + self.N * D * self.e * (n_src + 1), 6 * self.N * D * n_src

    def kda_part(self) -> OrderedDict[str, Component]:
        w, b, st = self.w.attn, self.buf, self.state
        p = w.params
        H, Dh, W = p.heads, p.head_dim, p.conv_kernel
        D = self.view.cfg.hidden_size
        c = OrderedDict()
        self._reg("qkv_proj", "proj")

        def qkv():
            b["qkv"] = self._lin(b["h"], w.w_qkv)
            return b["qkv"]
        c["qkv_proj"] = (qkv, *self._mm(w.w_qkv))
        self._reg("decay_proj", "proj")

        def decay():
            if self._proj_kernel():  # Wfa and Wb read h: one group launch over [Wfa; Wb], then Wfb
                from k3lab.components import trunk

                (w_fab,) = self._cat_once("decay", ([(w, "w_fa"), (w, "w_b")], 0))
                h = self._flat(b["h"]).contiguous()
                fa = torch.empty(h.shape[0], w.w_fa.shape[0], dtype=h.dtype, device=h.device)
                bb = torch.empty(h.shape[0], w.w_b.shape[0], dtype=h.dtype, device=h.device)
                trunk.proj_group(h, w_fab, [fa, bb], backend="triton")
                b["f"] = self._lin(fa, w.w_fb).view(*b["h"].shape[:-1], w.w_fb.shape[0])
                b["b"] = bb.view(*b["h"].shape[:-1], w.w_b.shape[0])
            else:
                b["f"] = self._lin(self._lin(b["h"], w.w_fa), w.w_fb)
                b["b"] = self._lin(b["h"], w.w_b)
            return b["f"], b["b"]
        R = w.w_fa.shape[0]
        c["decay_proj"] = (decay, _nb(w.w_fa, w.w_fb, w.w_b) + self.N * (D + 2 * R + H * Dh + H) * self.e,
                           2 * self.N * (D * R + R * H * Dh + D * H))
        self._reg("gate_proj", "proj")

        def gate():
            b["gate"] = self._lin(b["h"], w.w_g)
            return b["gate"]
        c["gate_proj"] = (gate, *self._mm(w.w_g))
        be = self._reg("kda_core", "kda")
        tv = self.switches.kda_tile_v  # "auto": the component's measured rule (data/kda_defaults.json)
        tile_v = None if tv == "auto" else min(tv, Dh)  # a tile cannot be wider than the head (tiny: D = 16)

        oracle = self.dtype != torch.bfloat16  # the KDA component takes bf16 activations only
        if oracle:
            self._groups["kda_core"] = "reference (k3lab.ref.kda directly: non-bf16 oracle build)"

        def core():
            ck = self.kda_checkpoint() if self.T > 1 else 1
            if self.T > 1:
                self.kda_state_hist()  # the switch may have changed since prepare
            if oracle:
                from k3lab.ref import kda as kref
                if self.T == 1:
                    o, S, cs = kref.kda_decode(b["qkv"], b["f"], b["b"], b["gate"], p, st.state, st.conv_state)
                    st.state.copy_(S)
                    st.conv_state.copy_(cs)
                else:  # verify (the kernels' contract): the history is written, the state is left for the commit
                    o, Sh, ch = kref.kda_verify(b["qkv"], b["f"], b["b"], b["gate"], p, st.state, st.conv_state,
                                                checkpoint=ck)
                    b["state_hist"].copy_(Sh)
                    b["conv_hist"].copy_(ch)
                b["o"].copy_(o)
                return b["o"]
            from k3lab.components import kda  # written by another engineer; imported when first run
            rec = []
            if self.T == 1:
                kda.decode(b["qkv"], b["f"], b["b"], b["gate"], p, st.state, st.conv_state, b["o"], backend=be,
                           tile_v=tile_v, pdl=self.switches.kda_pdl, ran=rec)
            else:
                kda.verify(b["qkv"], b["f"], b["b"], b["gate"], p, st.state, st.conv_state, b["o"],
                           state_hist=b["state_hist"], conv_hist=b["conv_hist"], backend=be, tile_v=tile_v,
                           pdl=self.switches.kda_pdl, checkpoint=ck, ran=rec)
            self._keep("kda_core", rec)
            return b["o"]
        from k3lab.ops.kda import kda_bytes, kda_flops  # the registry's one formula
        c["kda_core"] = (core, kda_bytes(self.B, H, self.T, D=Dh, W=W, state_bytes=st.state.element_size(),
                                         checkpoint=self.kda_checkpoint() if self.T > 1 else 1),
                         kda_flops(self.B, H, self.T, Dh))
        self._reg("out_proj", "proj")

        def out():
            b["p"] = self._lin(b["o"], w.w_o, residual=None if self.block_start else b["x"])
            return b["p"]
        ob, of = self._mm(w.w_o)
        c["out_proj"] = (out, ob + self.N * D * self.e * 2, of)
        return c

    def mla_part(self) -> OrderedDict[str, Component]:
        w, b, st = self.w.attn, self.buf, self.state
        H, C, Dn, Dr, Dv = w.heads, w.kv_lora, w.nope_dim, w.rope_dim, w.v_dim
        D = self.view.cfg.hidden_size
        sw = self.switches
        lead3 = (lambda t: t if self.T > 1 else t.unsqueeze(1))
        c = OrderedDict()
        self._reg("q_proj", "proj")

        def q():
            if not self._proj_kernel():
                qn, qr = mla_ref.mla_q(lead3(b["h"]), w)
                b["q_lat"], b["q_rope"] = mla_ref.absorb_q(qn, w), qr
                return b["q_lat"], b["q_rope"]
            from k3lab.components import mla as mla_comp
            from k3lab_kernels.triton.mla_query import MAX_BATCH as QUERY_MAX_BATCH

            h3 = lead3(b["h"])
            cq = self._lin(h3.reshape(-1, D), w.w_dq)  # [N, Q]
            if cq.shape[0] <= QUERY_MAX_BATCH:  # q_norm, Wuq and Wuk's absorption in one launch
                lat, rope = mla_comp.query(cq, w.q_norm, w.w_uq, w.w_uk, eps=float(w.eps), backend="triton")
            else:  # the norm's launch, Wuq on the trunk kernel, the absorption by torch
                qq = self._lin(self._norm(cq, w.q_norm, w.eps), w.w_uq).unflatten(-1, (H, Dn + Dr))
                lat, rope = mla_ref.absorb_q(qq[..., :Dn], w), qq[..., Dn:]
            b["q_lat"], b["q_rope"] = lat.view(*h3.shape[:-1], H, C), rope.reshape(*h3.shape[:-1], H, Dr)
            return b["q_lat"], b["q_rope"]
        Q = w.w_dq.shape[0]
        c["q_proj"] = (q, _nb(w.w_dq, w.q_norm, w.w_uq, w.w_uk) + self.N * (D + Q + H * (C + Dr)) * self.e,
                       2 * self.N * (D * Q + Q * H * (Dn + Dr) + H * Dn * C))
        self._reg("kv_proj", "proj")

        def kv():
            # both paths return the projection's output: the written entries are checked downstream (attn reads
            # them) and by the cache-write op's own tests
            ckv = self._lin(lead3(b["h"]), w.w_dkv)
            self.mla_write_cache(ckv)
            return ckv
        kv_e = st.cache.data.element_size()
        c["kv_proj"] = (kv, _nb(w.w_dkv, w.kv_norm) + self.N * D * self.e + self.N * (C + Dr) * kv_e,
                        2 * self.N * D * (C + Dr))
        be = self._reg("attn", "mla")

        def attn():
            from k3lab.components import mla as mla_comp
            # triton: split + merge kernels into o_lat (fp32); the combine kernel (out_proj) then applies Wuv and
            # the gate to it. The cache holds lengths + T positions exactly (alloc_state), so n_positions is its
            # capacity: no host sync, graph-capturable.
            parts = None if sw.mla_partitions == "auto" else sw.mla_partitions  # None: the kernel's choice
            rec = []
            b["o_lat"], _ = mla_comp.attend(b["q_lat"], b["q_rope"], st.cache, st.lengths, scale=w.scale,
                                            backend=be, partitions=parts, pad_heads=sw.pad_heads,
                                            n_positions=st.cache.capacity, check_values=False, ran=rec)
            self._keep("attn", rec)
            return b["o_lat"]
        S = int(st.lengths.max()) + self.T
        Hp = max(H, sw.pad_heads)
        cache_read = self.B * S * (C + Dr) * kv_e + (_nb(st.cache.scale) if st.cache.scale is not None else 0)
        c["attn"] = (attn, cache_read + self.N * Hp * (C + Dr) * self.e + self.N * H * C * 4,
                     2 * self.N * Hp * S * (C + Dr + C))
        self._reg("gate_proj", "proj")

        def gate():  # the logits: the output path applies the sigmoid (triton: inside the combine kernel)
            b["mla_gate"] = self._lin(b["h"], w.w_gate)
            return b["mla_gate"]
        c["gate_proj"] = (gate, *self._mm(w.w_gate))
        self._reg("out_proj", "proj")

        def out():  # Wuv + sigmoid(gate) (on triton: the combine kernel), then Wo
            b["p"] = self._lin(self.mla_wo_input(b["mla_gate"]), w.w_o, residual=None if self.block_start else b["x"])
            return b["p"]
        ob, of = self._mm(w.w_o)
        c["out_proj"] = (out, ob + _nb(w.w_uv) + self.N * (H * C * 4 + H * Dv + 2 * D) * self.e,
                         of + 2 * self.N * H * C * Dv)
        return c

    def mla_write_cache(self, ckv: torch.Tensor) -> None:
        """kv_norm of the new entries ckv [B, T, C + Dr] (the kv down-projection's output) and their in-place write
        into the cache at the sequences' lengths: the MLA component's kernel when the mla group runs on triton,
        else the reference (also the decode step's path, `k3lab.step._fused_parts`)."""
        w, st = self.w.attn, self.state
        be = self._backend("mla")
        if be in ("triton", "cute"):  # the component's kernel of that backend (k3lab_kernels.*.mla_cache_write)
            from k3lab.components import mla as mla_comp
            mla_comp.write_cache(ckv, w.kv_norm, st.cache, st.lengths, eps=float(w.eps), backend=be,
                                 check_values=False)
            return
        C = w.kv_lora
        c_n = mla_ref.rms_norm(ckv[..., :C], w.kv_norm, w.eps)
        st.cache.write(st.lengths, torch.cat([c_n, ckv[..., C:]], dim=-1))

    def mla_wo_input(self, gate: torch.Tensor) -> torch.Tensor:
        """The MLA output projection's input [..., H * Dv] (the stream's leading shape): per head o_lat Wuv times
        sigmoid(gate logits), from buf["o_lat"]; the combine kernel on triton, else torch (also the decode
        step's path)."""
        w, b = self.w.attn, self.buf
        be = self._backend("mla")
        if be in ("triton", "cute"):  # the combine kernel of that backend (k3lab_kernels.*.mla_combine)
            from k3lab.components import mla as mla_comp
            g = (gate if self.T > 1 else gate.unsqueeze(1)).contiguous()
            y = mla_comp.combine(b["o_lat"], None, w.w_uv, g, backend=be)
            return (y if self.T > 1 else y.squeeze(1)).to(self.dtype)
        o_lat = b["o_lat"] if self.T > 1 else b["o_lat"].squeeze(1)
        o = torch.einsum("...hc,hcv->...hv", o_lat.to(self.dtype), w.w_uv)
        return o.flatten(-2) * torch.sigmoid(gate)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1])

    def moe_part(self) -> OrderedDict[str, Component]:
        m, b = self.w.mlp, self.buf
        D, Lat = self.view.cfg.hidden_size, m.w_down.shape[0]
        E, k = m.router.n_experts, m.router.top_k
        c = OrderedDict()
        be_r = self._reg("router", "router")

        def router():
            if be_r in ("triton", "cute"):  # the router projection (fp32 logits) and top-k kernels of the trunk
                from k3lab.components import trunk
                b["idx"], b["wk"] = trunk.route(self._flat(b["h2"]), m.router, backend=be_r)
            else:
                b["idx"], b["wk"] = moe_comp.route(self._flat(b["h2"]), m.router, backend=be_r)
            return b["idx"], b["wk"]  # compared as the dense gate matrix (check_form), outside the timed call
        c["router"] = (router, m.router.nbytes() + self.N * (D * self.e + k * 12), 2 * self.N * D * E)
        self._reg("latent_down", "proj")

        def down():
            b["z"] = self._lin(self._flat(b["h2"]), m.w_down)
            return b["z"]
        c["latent_down"] = (down, *self._mm(m.w_down))
        be_e = self._reg("experts", "moe")
        tile = self.switches.moe_tile_n  # the triton experts' block_n; the references have no tile (their twins
        if tile != "auto" and be_e == "cute":  # keep the switches), the CuTe kernels' tiles are fixed: refused
            raise SwitchError(f"switch 'moe_tile_n' = {tile!r} sets the triton experts' tile (intermediate rows a "
                              f"program); the routed experts run on 'cute' here, whose tiles are compile-time "
                              f"constants (kernels/cute/moe_grouped.py, moe_experts.py): use 'auto' or the moe "
                              f"backend 'triton'")

        def experts():
            kw = dict(check_values=False) if be_e in ("triton", "cute") else {}  # no host sync in a captured step
            if tile != "auto" and be_e == "triton":
                kw["block_n"] = min(tile, m.w1.shape[1])  # a tile no wider than the slice (tiny: I = 32)
            rec = []
            b["y"] = moe_comp.experts(b["z"], b["idx"], b["wk"], m, backend=be_e, ran=rec, **kw)
            self._keep("experts", rec)
            return b["y"]
        n_used = int(torch.unique(b["idx"]).numel()) if "idx" in b else min(E, self.N * k)
        I_loc = m.w1.shape[1]
        ew = m.w1.nbytes(n_used) + m.w3.nbytes(n_used) + m.w2.nbytes(n_used)
        c["experts"] = (experts, ew + self.N * Lat * (self.e + 4) + self.N * k * 12,
                        self.N * k * 6 * Lat * I_loc)
        self._reg("latent_up", "proj")

        def up():
            if self._proj_kernel():  # the routed norm's launch, then Wup on the trunk kernel
                b["routed"] = self._lin(self._norm(b["y"], m.routed_norm, m.eps), m.w_up)
            else:
                b["routed"] = moe_ref.latent_up(b["y"], m, self.dtype)
            return b["routed"]
        ub, uf = self._mm(m.w_up)
        c["latent_up"] = (up, ub + _nb(m.routed_norm) + self.N * Lat * (4 - self.e), uf)
        self._reg("shared", "proj")

        def shared():
            h2 = self._flat(b["h2"])
            if self._proj_kernel():  # p + routed, then the shared experts' two launches add it in their epilogue
                b["x_out"] = self._glu(h2, m.shared, residual=self._flat(b["p"]) + b["routed"]).view(b["p"].shape)
            else:
                b["x_out"] = b["p"] + self._glu(h2, m.shared, residual=b["routed"]).reshape(b["p"].shape)
            return b["x_out"]
        sb = sum(_nb(sh.w1, sh.w3, sh.w2) for sh in m.shared)
        sI = sum(sh.w1.shape[0] for sh in m.shared)
        c["shared"] = (shared, sb + self.N * D * self.e * 4, 6 * self.N * D * sI)
        return c

    def check_form(self, name: str, out: Any) -> Any:
        """What the check compares of component `name`'s output (k3lab.harness.checker.check_twin; the timed call
        returns the output as it is): the router's (idx, weights) as the dense [N, E] gate matrix, so the order of
        the picks does not count (a swap of near-tied experts between a bf16 and an fp64 run: align_twin)."""
        if name != "router" or not isinstance(out, tuple):
            return out
        idx, wk = out
        return torch.zeros(idx.shape[0], self.w.mlp.router.n_experts, dtype=wk.dtype, device=wk.device).scatter(
            1, idx, wk)

    def align_twin(self, twin: Layer, name: str) -> tuple[torch.Tensor, str] | None:
        """After component `name` ran on this layer and on its fp64 twin (k3lab.harness.checker.check_twin): where
        this layer's router took other experts than the twin's and its picks are right for what it was given, the
        twin takes this layer's experts (weights renormalized from its own fp64 scores) for the router's row and
        every component after it. Returns (the twin's router output under that selection, a note), or None where
        there is nothing to align or the picks are not explained.
        The rule: each token's picks are k distinct experts, and they are the top-k of this layer's own input and
        weights scored in fp64 (no expert left out beats one picked by more than ALIGN_OWN_TOL): the difference
        from the twin then comes from the inputs and weights the layers hold (bf16 against fp64, and in a decode
        step every earlier layer's rounding), not from the router's arithmetic. A wrong pick (a dropped top expert,
        a repeated id) fails this and its row fails."""
        if name != "router" or "idx" not in self.buf or "idx" not in twin.buf:
            return None
        idx = self.buf["idx"].to("cpu", torch.int64)
        tidx = twin.buf["idx"].to("cpu", torch.int64)
        rt, r = twin.w.mlp.router, self.w.mlp.router
        E = rt.n_experts
        if idx.shape != tidx.shape or bool(((idx < 0) | (idx >= E)).any()):
            return None
        srt = idx.sort(-1).values
        if bool((srt[:, 1:] == srt[:, :-1]).any()):  # a repeated expert is never a near-tie
            return None
        moved = (srt != tidx.sort(-1).values).any(-1)
        if not bool(moved.any()):
            return None
        f64 = dict(device="cpu", dtype=torch.float64)
        h_here = self._flat(self.buf["h2"]).to(**f64)
        # this layer's own maths (its input, its stored weights), in fp64
        own = (ref_router.router_scores(h_here, ref_router.RouterWeights(w=r.w.to(**f64), e_bias=r.e_bias))
               + r.e_bias.to(**f64))
        here = torch.zeros(idx.shape[0], E, dtype=torch.bool).scatter(1, idx, True)
        slack = own.masked_fill(here, -math.inf).amax(-1) - own.masked_fill(~here, math.inf).amin(-1)
        if bool((slack[moved] > ALIGN_OWN_TOL).any()):
            return None
        s_twin = ref_router.router_scores(twin._flat(twin.buf["h2"]).to(**f64), rt).to(torch.float64)
        biased = s_twin + rt.e_bias.to(**f64)
        there = torch.zeros_like(here).scatter(1, tidx, True)
        gap = (biased.masked_fill(~(there & ~here), -math.inf).amax(-1)
               - biased.masked_fill(~(here & ~there), math.inf).amin(-1))
        sel = s_twin.gather(-1, idx)
        wk = sel / sel.sum(-1, keepdim=True) * rt.scaling
        twin.buf["idx"], twin.buf["wk"] = idx.to(twin.buf["idx"].device), wk.to(twin.buf["wk"])
        n = int(moved.sum())
        note = (f"{n} of {idx.shape[0]} tokens took experts the fp64 twin did not; each pick is the top-"
                f"{idx.shape[1]} of this layer's own input and weights in fp64 (its last pick ahead of the first "
                f"left out by {-float(slack[moved].max()):.1e}, -{ALIGN_OWN_TOL:g} allowed), the twin's scores "
                f"put them at most {float(gap[moved].max()):.1e} below its own; the twin follows this layer's "
                f"experts from here")
        return twin.check_form("router", (idx, wk)), note

    def dense_part(self) -> OrderedDict[str, Component]:
        m, b = self.w.mlp, self.buf
        D = self.view.cfg.hidden_size
        self._reg("dense_mlp", "proj")

        def dense():
            b["x_out"] = self._glu(b["h2"], [m], residual=b["p"])
            return b["x_out"]
        return OrderedDict(dense_mlp=(dense, _nb(m.w1, m.w3, m.w2) + self.N * D * self.e * 3,
                                      6 * self.N * D * m.w1.shape[0]))

    def floor_bw(self, name: str) -> str:
        """The bandwidth a component's floor uses: "copy" for the KDA core (its state is read and written),
        "read" for the rest (weights and caches are read)."""
        return "copy" if name == "kda_core" else "read"

    def summary(self) -> list[dict[str, Any]]:
        """[{name, backend, bytes, flops}] of the components that run, for a table."""
        comps = self.components()
        return [{"name": n, "backend": self.ran[n], "bytes": bb, "flops": ff} for n, (_, bb, ff) in comps.items()]


AUTO_EXPERT_POOL_BYTES = 2 << 30
AUTO_EXPERTS = 64


def auto_n_experts(view: GpuView) -> int:
    """n_experts="auto": the whole pool when one layer's slice of it, as stored, is <= 2 GiB, else the first 64
    experts. Stored: bf16 2 bytes a value (a float64 CPU twin holds the values dense: the bf16 pool is ~7.4 GB at
    TP8, its twin 30 GB), fp8 1 byte + a scale a row, MXFP4 codes and E8M0 scales (k3lab.mxfp4.mxfp4_nbytes; the
    twins of both keep the codes and dequantize only the chosen experts). So at TP8 MXFP4 builds all 896 experts
    (1.97 GB; issue 14's "the full 896-expert pool of one layer"), fp8 and bf16 64."""
    from k3lab.mxfp4 import mxfp4_nbytes

    cfg = view.cfg
    Lat, inter = cfg.moe_latent_size, view.expert_inter
    if view.expert_dtype == "mxfp4":
        per_expert = 2 * mxfp4_nbytes((inter, Lat)) + mxfp4_nbytes((Lat, inter))
    elif view.expert_dtype == "fp8":
        per_expert = 3 * Lat * inter + 4 * (2 * inter + Lat)
    else:
        per_expert = 3 * Lat * inter * 2
    if cfg.n_routed_experts * per_expert <= AUTO_EXPERT_POOL_BYTES:
        return cfg.n_routed_experts
    return max(cfg.num_experts_per_tok, min(cfg.n_routed_experts, AUTO_EXPERTS))


def build_layer(view: GpuView, kind: str, seed: int = 0, n_experts: int | str | None = "auto", *, device="cpu",
                dtype: torch.dtype = torch.bfloat16, backend: str | None = None, switches: Switches | None = None,
                layer_index: int | None = None, n_blocks: int | None = None, rank: int = 0, gen_device="cpu",
                fp8_scale: str = "tensor") -> Layer:
    """Build one `kind` ("kda" | "mla") layer of `view` on `device`.

    layer_index: default the first layer of that kind after layer 0 (1 for KDA, 3 for MLA in K3).
    n_experts: None = the whole pool; an int E = the first E experts (the router chooses among those);
        "auto" (default) = see `auto_n_experts`. The count built is `layer.n_experts`.
    backend: sets every component's backend (overrides `switches.backend`); components whose backend has
        no path here are left out of `.components()` and named in `layer.skipped`.
    n_blocks: the AttnRes history length (default: the real one at that index, ceil(index / block_size)).
    gen_device: where weights are drawn ("cpu" default: the same values on every device; "cuda" draws
        big pools fast, reproducibly on that device only)."""
    if kind not in ("kda", "mla"):
        raise ConfigError(f"build_layer: kind must be 'kda' or 'mla', got {kind!r}")
    if backend is not None:
        switches = (switches or Switches()).replace(backend={c: backend for c in Switches().backend})
    if n_experts == "auto":
        n_experts = auto_n_experts(view)
    idx = _default_index(view, kind) if layer_index is None else layer_index
    dev = torch.device(device)
    w = make_layer(view, idx, seed, rank=rank, attn_kind=kind, n_experts=n_experts, device=dev, dtype=dtype,
                   gen_device=gen_device)
    layer = Layer(view, w, device=dev, dtype=dtype, seed=seed, n_blocks=n_blocks, switches=switches,
                  fp8_scale=fp8_scale)
    layer.n_experts = w.mlp.router.n_experts if w.mlp_kind == "moe" else 0
    return layer


__all__ = ["Component", "Layer", "build_layer"]
