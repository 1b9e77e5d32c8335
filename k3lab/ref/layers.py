"""One decoder layer, exact reference: KDA or gated MLA attention, dense or MoE MLP, and the AttnRes
layer loop with its block bookkeeping. Any dtype; float64 is the oracle.

KDA attention (h = the normed layer input; k3lab.ref.kda does the core):
    qkv = Wqkv h  (rows [q heads | k heads | v heads]),  f = Wfb (Wfa h),  b = Wb h,  gate = Wg h
    o   = kda_decode(qkv, f, b, gate, ...)  ;  out = Wo o
MLA attention: k3lab.ref.mla.mla_decode. MLP: k3lab.ref.dense (layer 0) or k3lab.ref.moe.

AttnRes loop for layer L, exactly as docs/MODEL.md, The stack (B = block list, p = the running partial):
    prefix = x
    if B: x = attnres(B, prefix; attn_res_norm, attn_res_proj)
    if L % block_size == 0: B.append(prefix); p = None      # a new block starts
    a = Attention(rms(x; input_norm))
    p = a if p is None else prefix + a
    x = attnres(B, p; mlp_res_norm, mlp_res_proj)
    m = MLP(rms(x; post_attn_norm))
    p = p + m ;  x = p
After L layers B holds ceil(L / block_size) blocks. x, B and p are stored in the activation dtype (x's
dtype); the AttnRes mixes are computed in float32 (float64 for the oracle) and go straight into the
RMSNorm that follows, which returns the activation dtype.

Positions: x may be [B, D] (one decode position) or [B, T, D] (T positions of each sequence, e.g.
verification with everything accepted); every step but the attention core is per token.
Tensor parallelism is not simulated here: with a TP slice the attention and MLP outputs are partial
sums whose all-reduce is omitted (fine for timing, not for numbers).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k3lab.ref.attnres import attnres
from k3lab.ref.dense import dense_mlp
from k3lab.ref.kda import kda_decode, kda_verify
from k3lab.ref.mla import MLACache, mla_verify
from k3lab.ref.moe import moe_forward
from k3lab.ref.rmsnorm import rms_norm
from k3lab.ref.situ import GLUWeights, linear

# ---- KDA attention ------------------------------------------------------------------------------

def kda_projections(h: torch.Tensor, w) -> dict[str, torch.Tensor]:
    """The four input projections of a KDA layer, in h's dtype: qkv, f, b, gate."""
    return {"qkv": linear(h, w.w_qkv), "f": linear(linear(h, w.w_fa), w.w_fb), "b": linear(h, w.w_b),
                "gate": linear(h, w.w_g)}


def kda_attention(h: torch.Tensor, w, state: torch.Tensor, conv_state: torch.Tensor):
    """One position. h [B, D] -> (out [B, D], new_state, new_conv_state). Functional."""
    pr = kda_projections(h, w)
    o, S, cs = kda_decode(pr["qkv"], pr["f"], pr["b"], pr["gate"], w.params, state, conv_state)
    return linear(o, w.w_o), S, cs


def kda_attention_verify(h: torch.Tensor, w, state: torch.Tensor, conv_state: torch.Tensor):
    """T positions in order. h [B, T, D] -> (out [B, T, D], states [B,T,H,K,V], convs [B,T,C,W-1])."""
    pr = kda_projections(h, w)
    o, states, convs = kda_verify(pr["qkv"], pr["f"], pr["b"], pr["gate"], w.params, state, conv_state)
    return linear(o, w.w_o), states, convs


# ---- per-layer state ----------------------------------------------------------------------------

@dataclass
class KDALayerState:
    state: torch.Tensor  # [B, H, D, D] float32 (float64 for the oracle)
    conv_state: torch.Tensor  # [B, 3*H*D, W-1] activation dtype


@dataclass
class MLALayerState:
    cache: MLACache
    lengths: torch.Tensor  # [B] positions already cached


def new_layer_state(lw, batch: int, capacity: int, *, act_dtype: torch.dtype, state_dtype=None,
                    kv_dtype: str | None = None, device="cpu"):
    """Zero KDA state / empty MLA cache of `capacity` positions for layer weights `lw`."""
    if lw.attn_kind == "kda":
        p = lw.attn.params
        C = 3 * p.heads * p.head_dim
        sdt = state_dtype or (torch.float64 if act_dtype == torch.float64 else torch.float32)
        return KDALayerState(
            torch.zeros(batch, p.heads, p.head_dim, p.head_dim, dtype=sdt, device=device),
            torch.zeros(batch, C, p.conv_kernel - 1, dtype=act_dtype, device=device))
    w = lw.attn
    cache = MLACache.empty(batch, capacity, w.entry_width, dtype=act_dtype, device=device, kv_dtype=kv_dtype)
    return MLALayerState(cache, torch.zeros(batch, dtype=torch.long, device=device))


def attention_step(h: torch.Tensor, lw, st, **mla_kw) -> torch.Tensor:
    """The layer's attention on normed input h ([B, D] or [B, T, D]); advances `st` in place."""
    if lw.attn_kind == "kda":
        if h.dim() == 2:
            out, st.state, st.conv_state = kda_attention(h, lw.attn, st.state, st.conv_state)
            return out
        out, states, convs = kda_attention_verify(h, lw.attn, st.state, st.conv_state)
        st.state, st.conv_state = states[:, -1], convs[:, -1]
        return out
    T = 1 if h.dim() == 2 else h.shape[1]
    h3 = h.unsqueeze(1) if h.dim() == 2 else h
    out = mla_verify(h3, lw.attn, st.cache, st.lengths, **mla_kw)
    st.lengths = st.lengths + T
    return out.squeeze(1) if h.dim() == 2 else out


def mlp_step(h: torch.Tensor, mlp) -> torch.Tensor:
    """Dense SiTU-GLU or MoE on h [..., D] (tokens are independent)."""
    if isinstance(mlp, GLUWeights):
        return dense_mlp(h, mlp)
    return moe_forward(h.reshape(-1, h.shape[-1]), mlp).reshape(h.shape)


# ---- the AttnRes layer loop ---------------------------------------------------------------------

def attnres_layer(L: int, x: torch.Tensor, blocks: list[torch.Tensor], lw,
                  attn_fn: Callable[[torch.Tensor], torch.Tensor], mlp_fn: Callable[[torch.Tensor], torch.Tensor],
                  *, block_size: int, eps: float = 1e-6) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Layer L of the AttnRes loop. `lw` supplies input_norm, post_attn_norm, attn_res_norm/proj and
    mlp_res_norm/proj. attn_fn / mlp_fn take the normed input (activation dtype). Returns the new
    stream x (= p, activation dtype) and the block list (a new list when a block starts)."""
    act = x.dtype
    prefix = x
    h = attnres(blocks, prefix, lw.attn_res_norm, lw.attn_res_proj, eps) if blocks else prefix
    p = prefix
    if L % block_size == 0:
        blocks = blocks + [prefix]
        p = None
    a = attn_fn(rms_norm(h, lw.input_norm, eps, out_dtype=act))
    p = a if p is None else prefix + a
    h = attnres(blocks, p, lw.mlp_res_norm, lw.mlp_res_proj, eps)
    m = mlp_fn(rms_norm(h, lw.post_attn_norm, eps, out_dtype=act))
    p = p + m
    return p, blocks


def layer_step(x: torch.Tensor, blocks: list[torch.Tensor], lw, st, *, block_size: int, eps: float = 1e-6,
               **mla_kw: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One full layer (weights `lw`, state `st` advanced in place)."""
    return attnres_layer(lw.index, x, blocks, lw, lambda h: attention_step(h, lw, st, **mla_kw),
                         lambda h: mlp_step(h, lw.mlp), block_size=block_size, eps=eps)


def n_blocks_after(n_layers: int, block_size: int) -> int:
    """Blocks in B after layers 0..n_layers-1: one per layer index divisible by block_size."""
    return -(-n_layers // block_size)
