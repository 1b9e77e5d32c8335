"""K3 model configuration, presets, and the per-GPU view (TP / DCP / batch / context / dtypes).

`K3Config` holds every field of the model configuration (docs/MODEL.md, The stack). It loads from a Hugging Face
style `config.json`
(fields may sit under `text_config`); unknown fields are kept in `extra` and ignored. `GpuView`
is what one GPU sees: heads and expert slices after tensor parallelism, the MLA history share
under decode context parallelism, and the batch / context / draft depth / dtypes of a run.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


class ConfigError(ValueError):
    """A configuration field is missing, has the wrong type, or contradicts another field."""


@dataclass(frozen=True)
class K3Config:
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    vocab_size: int = 163840
    rms_norm_eps: float = 1e-6
    # KDA
    kda_head_dim: int = 128
    kda_conv_kernel: int = 4
    kda_gate_lower_bound: float = -5.0
    kda_decay_rank: int = 128  # rank of the low-rank decay input Wfb(Wfa h); not pinned by the spec
    # MLA
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # layout: indices of the gated MLA layers; None = the 3:1 pattern (one MLA after three KDA)
    mla_layers: tuple[int, ...] | None = None
    # MoE
    n_routed_experts: int = 896
    num_experts_per_tok: int = 16
    n_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    moe_latent_size: int = 3584
    shared_intermediate_size: int = 3072
    dense_intermediate_size: int = 18432
    first_k_dense: int = 1
    routed_scaling_factor: float = 1.0
    # SiTU-GLU
    situ_b1: float = 4.0
    situ_b2: float = 25.0
    # Attention Residuals
    attnres_block_size: int = 12
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        if self.mla_layers is not None:
            return tuple(sorted(self.mla_layers))
        return tuple(i for i in range(self.num_hidden_layers) if i % 4 == 3)

    def layer_kind(self, i: int) -> str:
        if not 0 <= i < self.num_hidden_layers:
            raise ConfigError(f"layer index {i} outside 0..{self.num_hidden_layers - 1}")
        return "mla" if i in set(self.mla_layer_ids) else "kda"

    def mlp_kind(self, i: int) -> str:
        return "dense" if i < self.first_k_dense else "moe"

    @property
    def n_kda_layers(self) -> int:
        return self.num_hidden_layers - len(self.mla_layer_ids)

    # ---- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        ints = [f.name for f in dataclasses.fields(self) if f.type in ("int", int)]
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"config field {name!r} must be a positive int, got {v!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}")
        if self.kda_gate_lower_bound >= 0:
            raise ConfigError(f"kda_gate_lower_bound must be negative, got {self.kda_gate_lower_bound}")
        if self.mla_layers is not None:
            bad = [i for i in self.mla_layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ConfigError(f"mla_layers holds indices outside 0..{self.num_hidden_layers - 1}: {bad}")
        if self.first_k_dense > self.num_hidden_layers:
            raise ConfigError("first_k_dense exceeds num_hidden_layers")

    # ---- io ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> K3Config:
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        if "text_config" in d and isinstance(d["text_config"], dict):
            d = {**{k: v for k, v in d.items() if k != "text_config"}, **d["text_config"]}
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        aliases = {"n_experts": "n_routed_experts", "moe_topk": "num_experts_per_tok"}
        kw: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in d.items():
            k2 = aliases.get(k, k)
            if k2 in names:
                kw[k2] = tuple(v) if k2 == "mla_layers" and v is not None else v
            else:
                extra[k] = v
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [r for r in required if r not in kw]
        if missing:
            raise ConfigError(f"config is missing required fields {missing}")
        return cls(**kw, extra=extra)

    @classmethod
    def from_json(cls, path: str | Path) -> K3Config:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        return cls.from_dict(json.loads(p.read_text()))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        if d["mla_layers"] is not None:
            d["mla_layers"] = list(d["mla_layers"])
        return d


def k3_full() -> K3Config:
    """The released K3 dimensions (data/k3_config.json)."""
    return K3Config.from_json(DATA_DIR / "k3_config.json")


def k3_tiny() -> K3Config:
    """Same structure as K3 (KDA + MLA layers, AttnRes blocks, latent MoE + shared, dense layer 0),
    small enough that a whole stack runs on a 2-core CPU in seconds."""
    return K3Config(
        hidden_size=64, num_hidden_layers=8, num_attention_heads=4, vocab_size=256,
        kda_head_dim=16, kda_decay_rank=8,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2,
        moe_intermediate_size=32, moe_latent_size=32, shared_intermediate_size=32,
        dense_intermediate_size=128, attnres_block_size=3,
    )


KV_DTYPES = ("bf16", "fp8")
EXPERT_DTYPES = ("bf16", "fp8", "mxfp4")


@dataclass(frozen=True)
class GpuView:
    """What one GPU sees of `cfg` under TP `tp` and DCP `dcp` at a given batch/context."""

    cfg: K3Config
    tp: int = 1
    dcp: int = 1
    batch: int = 1
    context: int = 1024
    draft_depth: int = 0
    act_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    expert_dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("tp", "dcp", "batch", "context", "draft_depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ConfigError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
        h = self.cfg.num_attention_heads
        if self.tp < 1 or h % self.tp:
            raise ConfigError(f"tp={self.tp} must divide num_attention_heads={h}")
        if self.cfg.moe_intermediate_size % self.tp:
            raise ConfigError(f"tp={self.tp} must divide moe_intermediate_size={self.cfg.moe_intermediate_size}")
        if self.dcp < 1:
            raise ConfigError(f"dcp must be a positive int, got {self.dcp}")
        if self.batch < 1:
            raise ConfigError(f"batch must be >= 1, got {self.batch}")
        if self.context < 1:
            raise ConfigError(f"context must be >= 1, got {self.context}")
        if not 0 <= self.draft_depth <= 7:
            raise ConfigError(f"draft_depth must be in 0..7, got {self.draft_depth}")
        if self.act_dtype != "bf16":
            raise ConfigError(f"act_dtype must be 'bf16', got {self.act_dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ConfigError(f"expert_dtype must be one of {EXPERT_DTYPES}, got {self.expert_dtype!r}")

    @property
    def heads(self) -> int:
        """KDA heads and MLA query heads on this GPU."""
        return self.cfg.num_attention_heads // self.tp

    @property
    def kda_width(self) -> int:
        return self.heads * self.cfg.kda_head_dim

    @property
    def expert_inter(self) -> int:
        """Routed-expert intermediate slice on this GPU (TP on the 3072)."""
        return self.cfg.moe_intermediate_size // self.tp

    @property
    def context_per_gpu(self) -> int:
        """MLA history positions held by this GPU (DCP shards positions)."""
        return -(-self.context // self.dcp)

    @property
    def tokens_per_seq(self) -> int:
        """Positions per sequence in one step: 1 for plain decode, draft_depth + 1 for verification."""
        return self.draft_depth + 1

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cfg"}
        d["heads"] = self.heads
        return d


PRESETS = ("full", "tp8", "tp16", "tiny")


def preset(name: str, **kw: Any) -> GpuView:
    """`full` (real dims, TP1), `tp8`, `tp16` (one GPU's slice), `tiny` (CPU-sized, same structure)."""
    if name == "full":
        return GpuView(k3_full(), tp=1, **kw)
    if name == "tp8":
        return GpuView(k3_full(), tp=8, **kw)
    if name == "tp16":
        return GpuView(k3_full(), tp=16, **kw)
    if name == "tiny":
        kw.setdefault("context", 64)
        return GpuView(k3_tiny(), tp=1, **kw)
    raise ConfigError(f"preset must be one of {PRESETS}, got {name!r}")
