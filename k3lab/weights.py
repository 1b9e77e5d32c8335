"""Deterministic random weights at sensible scales, for any preset and any one GPU's slice.

Scales: projections N(0, 1/fan_in) (std 1/sqrt(fan_in), fan_in of the WHOLE matrix, so a TP slice
has the scale of the full one); norm weights 1 + N(0, 0.02^2); AttnRes vectors w_norm ~ 1 and
w_proj std 1/sqrt(D) (scores of order 1, so the mix is not one-hot); KDA A_log = log U(1, 16),
dt_bias N(0, 0.1^2), conv taps N(0, 0.5^2); router bias N(0, 0.1^2); embedding N(0, 1).

Seeding: every tensor is drawn piecewise, each piece from its own generator seeded by a hash of
(seed, layer, name, piece). Pieces are the units that tensor parallelism splits: one attention head
(rows of Wq/Wk/Wv/Wg/Wuq/Wgate/Wfb/Wb, columns of Wo, a head's Wuk/Wuv/conv taps/A_log/dt_bias), one
routed expert, and one of 16 row blocks of an MLP intermediate (per row when 16 blocks do not fit the
TP degree). Consequences: the same (seed, layer, name) gives the same tensor whichever other layers
are built; a TP rank's slice equals that slice of the TP1 tensor; `n_experts` = E gives the first E
experts of the full pool. Values depend on the generating device's RNG (CPU by default; pass
gen_device="cuda" to draw large pools on the GPU, reproducibly there).

Nothing larger than asked is allocated: one layer, one stack of layers, or a few experts.
Under TP the router, latent down/up projections, Wdq, Wdkv and Wfa are replicated (every rank
holds them whole); heads, the expert intermediate, the shared experts' and dense MLP's intermediate
are split.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from k3lab.config import ConfigError, GpuView
from k3lab.ref.kda import KDAParams
from k3lab.ref.mla import MLAWeights
from k3lab.ref.moe import ExpertWeight, MoEWeights
from k3lab.ref.router import RouterWeights
from k3lab.ref.situ import GLUWeights

__all__ = [
    "ExpertWeight",
    "GLUWeights",
    "KDAAttnWeights",
    "LayerWeights",
    "MLAWeights",
    "MoEWeights",
    "RouterWeights",
    "StackWeights",
    "make_dense",
    "make_kda_attn",
    "make_layer",
    "make_mla_attn",
    "make_moe",
    "make_stack",
    "nbytes",
]

_FMT = {"bf16": "dense", "fp8": "fp8", "mxfp4": "mxfp4"}


@dataclass
class KDAAttnWeights:
    """A KDA layer's projections on one GPU (H local heads of dim D), plus its core constants."""

    w_qkv: torch.Tensor  # [3*H*D, hidden]: rows [q heads | k heads | v heads], head-major
    w_fa: torch.Tensor  # [R, hidden] low-rank decay, replicated
    w_fb: torch.Tensor  # [H*D, R]
    w_b: torch.Tensor  # [H, hidden] beta logits
    w_g: torch.Tensor  # [H*D, hidden] output gate
    w_o: torch.Tensor  # [hidden, H*D]
    params: KDAParams

    @property
    def heads(self) -> int:
        return self.params.heads

    def nbytes(self) -> int:
        ts = [self.w_qkv, self.w_fa, self.w_fb, self.w_b, self.w_g, self.w_o, self.params.conv_w,
              self.params.A_log, self.params.dt_bias, self.params.o_norm_w]
        return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class LayerWeights:
    """One decoder layer on one GPU: attention (KDA or MLA), MLP (dense or MoE), norms, AttnRes vectors."""

    index: int
    attn_kind: str  # "kda" | "mla"
    mlp_kind: str  # "dense" | "moe"
    attn: Any  # KDAAttnWeights | MLAWeights
    mlp: Any  # GLUWeights | MoEWeights
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    attn_res_norm: torch.Tensor
    attn_res_proj: torch.Tensor
    mlp_res_norm: torch.Tensor
    mlp_res_proj: torch.Tensor


@dataclass
class StackWeights:
    view: GpuView
    layers: list[LayerWeights]
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor
    output_res_norm: torch.Tensor
    output_res_proj: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]
    meta: dict = field(default_factory=dict)


def nbytes(obj: Any) -> int:
    """Bytes of every tensor reachable from a weights object (dataclasses, lists, tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(nbytes(getattr(obj, f)) for f in obj.__dataclass_fields__ if f not in ("view", "meta"))
    return 0


# ---- the piecewise seeded generator ------------------------------------------------------------

class _Gen:
    def __init__(self, seed: int, device, dtype: torch.dtype, gen_device=None):
        self.seed = int(seed)
        self.device = torch.device(device)
        self.dtype = dtype
        self.gen_device = torch.device(gen_device or "cpu")

    def _g(self, key: tuple) -> torch.Generator:
        h = hashlib.sha256(repr((self.seed,) + tuple(key)).encode()).digest()
        return torch.Generator(device=self.gen_device).manual_seed(int.from_bytes(h[:8], "little") >> 1)

    def randn(self, key: tuple, shape, std: float = 1.0) -> torch.Tensor:
        """fp32 on the target device."""
        t = torch.randn(*shape, generator=self._g(key), device=self.gen_device, dtype=torch.float32)
        return (t * std).to(self.device)

    def uniform(self, key: tuple, shape, lo: float, hi: float) -> torch.Tensor:
        t = torch.rand(*shape, generator=self._g(key), device=self.gen_device, dtype=torch.float32)
        return (lo + (hi - lo) * t).to(self.device)

    # helpers returning self.dtype
    def mat(self, key, shape, std):
        return self.randn(key, shape, std).to(self.dtype)

    def norm(self, key, n):
        return (1.0 + self.randn(key, (n,), 0.02)).to(self.dtype)

    def per_head(self, key, heads: range, piece_shape, std, dim: int = 0) -> torch.Tensor:
        """Concatenate one piece per global head index along `dim` (fp32)."""
        return torch.cat([self.randn(key + (h,), piece_shape, std) for h in heads], dim=dim)


def _units(inter: int, tp: int) -> int:
    """Row blocks an MLP intermediate is drawn in: 16 when that splits evenly under tp, else per row."""
    if inter % 16 == 0 and 16 % tp == 0:
        return 16
    return inter


def _inter_rows(gen: _Gen, key: tuple, inter: int, tp: int, rank: int, cols: int, std: float,
                transpose: bool = False) -> torch.Tensor:
    """Rank `rank`'s slice of an [inter, cols] matrix (or, transpose=True, [cols, inter]'s columns)."""
    if inter % tp:
        raise ConfigError(f"tp={tp} must divide the MLP intermediate {inter}")
    n = _units(inter, tp)
    rows = inter // n
    mine = range(rank * n // tp, (rank + 1) * n // tp)
    if transpose:
        return torch.cat([gen.randn(key + (u,), (cols, rows), std) for u in mine], dim=1)
    return torch.cat([gen.randn(key + (u,), (rows, cols), std) for u in mine], dim=0)


def _check_rank(view: GpuView, rank: int) -> None:
    if not 0 <= rank < view.tp:
        raise ConfigError(f"rank={rank} must be in 0..{view.tp - 1} for tp={view.tp}")


def _heads(view: GpuView, rank: int) -> range:
    return range(rank * view.heads, (rank + 1) * view.heads)


# ---- per component -----------------------------------------------------------------------------

def _gen(seed, device, dtype, gen_device) -> _Gen:
    return _Gen(seed, device, dtype, gen_device)


def make_kda_attn(view: GpuView, layer: int, seed: int = 0, *, rank: int = 0, device="cpu",
                  dtype=torch.bfloat16, gen_device=None) -> KDAAttnWeights:
    _check_rank(view, rank)
    cfg = view.cfg
    g = _gen(seed, device, dtype, gen_device)
    D, Hd, R, W = cfg.hidden_size, cfg.kda_head_dim, cfg.kda_decay_rank, cfg.kda_conv_kernel
    hs = _heads(view, rank)
    k = ("L", layer, "kda")
    sd = D ** -0.5
    w_qkv = torch.cat([g.per_head(k + (n,), hs, (Hd, D), sd) for n in ("wq", "wk", "wv")]).to(dtype)
    conv_w = torch.cat([g.per_head(k + (n,), hs, (Hd, W), 0.5) for n in ("conv_q", "conv_k", "conv_v")])
    A_log = torch.cat([torch.log(g.uniform(k + ("A_log", h), (1,), 1.0, 16.0)) for h in hs])
    fp = torch.float64 if dtype == torch.float64 else torch.float32
    params = KDAParams(
        conv_w=conv_w.to(dtype),
        A_log=A_log.to(fp),
        dt_bias=g.per_head(k + ("dt_bias",), hs, (Hd,), 0.1).to(fp),
        o_norm_w=g.norm(k + ("o_norm",), Hd),
        eps=cfg.rms_norm_eps,
        lower_bound=cfg.kda_gate_lower_bound,
    )
    return KDAAttnWeights(
        w_qkv=w_qkv,
        w_fa=g.mat(k + ("wfa",), (R, D), sd),
        w_fb=g.per_head(k + ("wfb",), hs, (Hd, R), R ** -0.5).to(dtype),
        w_b=g.per_head(k + ("wb",), hs, (1, D), sd).to(dtype),
        w_g=g.per_head(k + ("wg",), hs, (Hd, D), sd).to(dtype),
        w_o=g.per_head(k + ("wo",), hs, (D, Hd), (cfg.num_attention_heads * Hd) ** -0.5, dim=1).to(dtype),
        params=params,
    )


def make_mla_attn(view: GpuView, layer: int, seed: int = 0, *, rank: int = 0, device="cpu",
                  dtype=torch.bfloat16, gen_device=None) -> MLAWeights:
    _check_rank(view, rank)
    cfg = view.cfg
    g = _gen(seed, device, dtype, gen_device)
    D, Q, C = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    hs = _heads(view, rank)
    k = ("L", layer, "mla")
    return MLAWeights(
        w_dq=g.mat(k + ("wdq",), (Q, D), D ** -0.5),
        q_norm=g.norm(k + ("q_norm",), Q),
        w_uq=g.per_head(k + ("wuq",), hs, (Dn + Dr, Q), Q ** -0.5).to(dtype),
        w_dkv=g.mat(k + ("wdkv",), (C + Dr, D), D ** -0.5),
        kv_norm=g.norm(k + ("kv_norm",), C),
        w_uk=torch.stack([g.randn(k + ("wuk", h), (Dn, C), C ** -0.5) for h in hs]).to(dtype),
        w_uv=torch.stack([g.randn(k + ("wuv", h), (C, Dv), C ** -0.5) for h in hs]).to(dtype),
        w_gate=g.per_head(k + ("wgate",), hs, (Dv, D), D ** -0.5).to(dtype),
        w_o=g.per_head(k + ("wo",), hs, (D, Dv), (cfg.num_attention_heads * Dv) ** -0.5, dim=1).to(dtype),
        qk_rope_dim=Dr,
        eps=cfg.rms_norm_eps,
    )


def _glu(g: _Gen, key: tuple, hidden: int, inter: int, tp: int, rank: int, b1: float, b2: float) -> GLUWeights:
    sd_in, sd_out = hidden ** -0.5, inter ** -0.5
    return GLUWeights(
        w1=_inter_rows(g, key + ("w1",), inter, tp, rank, hidden, sd_in).to(g.dtype),
        w3=_inter_rows(g, key + ("w3",), inter, tp, rank, hidden, sd_in).to(g.dtype),
        w2=_inter_rows(g, key + ("w2",), inter, tp, rank, hidden, sd_out, transpose=True).to(g.dtype),
        b1=b1, b2=b2,
    )


def make_dense(view: GpuView, layer: int, seed: int = 0, *, rank: int = 0, device="cpu",
               dtype=torch.bfloat16, gen_device=None) -> GLUWeights:
    _check_rank(view, rank)
    cfg = view.cfg
    g = _gen(seed, device, dtype, gen_device)
    return _glu(g, ("L", layer, "dense"), cfg.hidden_size, cfg.dense_intermediate_size, view.tp, rank,
                cfg.situ_b1, cfg.situ_b2)


def make_moe(view: GpuView, layer: int, seed: int = 0, *, rank: int = 0, n_experts: int | None = None,
             device="cpu", dtype=torch.bfloat16, expert_dtype: str | None = None,
             gen_device=None) -> MoEWeights:
    """`n_experts` = build only the first E experts of the pool (the router then scores those E)."""
    _check_rank(view, rank)
    cfg = view.cfg
    E = cfg.n_routed_experts if n_experts is None else int(n_experts)
    if not cfg.num_experts_per_tok <= E <= cfg.n_routed_experts:
        raise ConfigError(f"n_experts={n_experts} must be in {cfg.num_experts_per_tok}..{cfg.n_routed_experts} "
                          f"(at least top-k={cfg.num_experts_per_tok})")
    edt = expert_dtype or view.expert_dtype
    if edt not in _FMT:
        raise ConfigError(f"expert_dtype must be one of {tuple(_FMT)}, got {edt!r}")
    fmt = _FMT[edt]
    g = _gen(seed, device, dtype, gen_device)
    D, Lat, I = cfg.hidden_size, cfg.moe_latent_size, cfg.moe_intermediate_size
    k = ("L", layer, "moe")
    if fmt == "mxfp4" and (Lat % 32 or (I // view.tp) % 32):
        raise ConfigError(f"mxfp4 experts need the latent ({Lat}) and the per-GPU intermediate "
                          f"({I // view.tp}) to be multiples of 32")
    router = RouterWeights(
        w=torch.cat([g.randn(k + ("router", e), (1, D), D ** -0.5) for e in range(E)]).to(dtype),
        e_bias=torch.cat([g.randn(k + ("e_bias", e), (1,), 0.1) for e in range(E)]).to(
            torch.float64 if dtype == torch.float64 else torch.float32),
        top_k=cfg.num_experts_per_tok,
        scaling=cfg.routed_scaling_factor,
    )

    def pool(name: str, transpose: bool) -> ExpertWeight:
        sd = (I ** -0.5) if transpose else (Lat ** -0.5)
        pieces = [ExpertWeight.quantize(
            _inter_rows(g, k + ("expert", e, name), I, view.tp, rank, Lat, sd, transpose).to(
                dtype if fmt == "dense" else torch.float32).unsqueeze(0), fmt) for e in range(E)]
        data = torch.cat([p.data for p in pieces])
        scale = None if fmt == "dense" else torch.cat([p.scale for p in pieces])
        return ExpertWeight(fmt, data, scale)

    shared = [_glu(g, k + ("shared", j), D, cfg.shared_intermediate_size, view.tp, rank, cfg.situ_b1, cfg.situ_b2)
              for j in range(cfg.n_shared_experts)]
    return MoEWeights(
        router=router,
        w_down=g.mat(k + ("wdown",), (Lat, D), D ** -0.5),
        w1=pool("w1", False), w3=pool("w3", False), w2=pool("w2", True),
        routed_norm=g.norm(k + ("routed_norm",), Lat),
        w_up=g.mat(k + ("wup",), (D, Lat), Lat ** -0.5),
        shared=shared, eps=cfg.rms_norm_eps, b1=cfg.situ_b1, b2=cfg.situ_b2,
    )


def make_layer(view: GpuView, layer: int, seed: int = 0, *, rank: int = 0, attn_kind: str | None = None,
               mlp_kind: str | None = None, n_experts: int | None = None, device="cpu", dtype=torch.bfloat16,
               expert_dtype: str | None = None, gen_device=None) -> LayerWeights:
    """Layer `layer` of `view.cfg` (kinds from the config's layout unless forced)."""
    cfg = view.cfg
    ak = attn_kind or cfg.layer_kind(layer)
    mk = mlp_kind or cfg.mlp_kind(layer)
    if ak not in ("kda", "mla"):
        raise ConfigError(f"attn_kind must be 'kda' or 'mla', got {ak!r}")
    if mk not in ("dense", "moe"):
        raise ConfigError(f"mlp_kind must be 'dense' or 'moe', got {mk!r}")
    kw = {"rank": rank, "device": device, "dtype": dtype, "gen_device": gen_device}
    attn = (make_kda_attn if ak == "kda" else make_mla_attn)(view, layer, seed, **kw)
    if mk == "dense":
        mlp = make_dense(view, layer, seed, **kw)
    else:
        mlp = make_moe(view, layer, seed, n_experts=n_experts, expert_dtype=expert_dtype, **kw)
    g = _gen(seed, device, dtype, gen_device)
    D = cfg.hidden_size
    k = ("L", layer)
    return LayerWeights(
        index=layer, attn_kind=ak, mlp_kind=mk, attn=attn, mlp=mlp,
        input_norm=g.norm(k + ("input_norm",), D),
        post_attn_norm=g.norm(k + ("post_attn_norm",), D),
        attn_res_norm=g.norm(k + ("attn_res_norm",), D),
        attn_res_proj=g.mat(k + ("attn_res_proj",), (D,), D ** -0.5),
        mlp_res_norm=g.norm(k + ("mlp_res_norm",), D),
        mlp_res_proj=g.mat(k + ("mlp_res_proj",), (D,), D ** -0.5),
    )


def make_stack(view: GpuView, seed: int = 0, *, n_layers: int | None = None, n_experts: int | None = None,
               device="cpu", dtype=torch.bfloat16, expert_dtype: str | None = None,
               gen_device=None) -> StackWeights:
    """Layers 0..n_layers-1 (default all) plus embedding, final norm, output AttnRes and lm_head.
    Meant for small configs (`tiny`): the full model does not fit anywhere."""
    cfg = view.cfg
    n = cfg.num_hidden_layers if n_layers is None else int(n_layers)
    if not 1 <= n <= cfg.num_hidden_layers:
        raise ConfigError(f"n_layers={n_layers} must be in 1..{cfg.num_hidden_layers}")
    layers = [make_layer(view, i, seed, n_experts=n_experts, device=device, dtype=dtype,
                         expert_dtype=expert_dtype, gen_device=gen_device) for i in range(n)]
    g = _gen(seed, device, dtype, gen_device)
    D, V = cfg.hidden_size, cfg.vocab_size
    k = ("stack",)
    return StackWeights(
        view=view, layers=layers,
        embed=g.mat(k + ("embed",), (V, D), 1.0),
        final_norm=g.norm(k + ("final_norm",), D),
        output_res_norm=g.norm(k + ("output_res_norm",), D),
        output_res_proj=g.mat(k + ("output_res_proj",), (D,), D ** -0.5),
        lm_head=g.mat(k + ("lm_head",), (V, D), D ** -0.5),
        meta={"seed": seed, "n_layers": n},
    )
