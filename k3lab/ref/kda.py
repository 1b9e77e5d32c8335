"""KDA (Kimi Delta Attention) exact reference: decode step, multi-token verify with rollback, and a
naive chunked prefill. Any dtype; pass float64 tensors for the oracle.

Per head h (K = V = head_dim), with the fp32 (or fp64) recurrent state S[h] of shape K x V:

    q, k, v = silu(causal_conv1d_update(conv_state, [q, k, v], conv_w))   # depthwise, kernel W
    q, k    = l2norm(q), l2norm(k)                                       # over the head dim
    g       = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))                # log-decay per key channel
    beta    = sigmoid(b)
    S       = exp(g)[:, None] * S
    S       = S + beta * outer(k, v - S^T k)
    o       = (S^T q) / sqrt(K)
    out     = rms(o; o_norm_w) * sigmoid(gate)

Layouts (the contract every backend follows):
    qkv        [B, 3*H*D]      pre-conv projections, channels [q heads | k heads | v heads], head-major
    f          [B, H*D]        decay input (Wfb Wfa h)
    b          [B, H]          beta logits
    gate       [B, H*D]        output-gate logits
    state      [B, H, D, D]    S[b, h, key, value]
    conv_state [B, 3*H*D, W-1] the last W-1 pre-conv inputs, oldest first
    out        [B, H*D]
Multi-token forms add a T axis after B.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KDAParams:
    """Per-layer KDA constants on one GPU (H heads of dim D)."""

    conv_w: torch.Tensor  # [3*H*D, W]
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H*D]
    o_norm_w: torch.Tensor  # [D]
    eps: float = 1e-6
    lower_bound: float = -5.0

    @property
    def heads(self) -> int:
        return self.A_log.shape[0]

    @property
    def head_dim(self) -> int:
        return self.o_norm_w.shape[0]

    @property
    def conv_kernel(self) -> int:
        return self.conv_w.shape[1]

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> KDAParams:
        def cv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device or t.device, dtype=dtype or t.dtype)

        return KDAParams(cv(self.conv_w), cv(self.A_log), cv(self.dt_bias), cv(self.o_norm_w), self.eps,
                         self.lower_bound)


def conv_update(x: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor):
    """Depthwise causal conv over the window [conv_state, x], then silu. Returns (y, new_state).
    x [B, C], conv_state [B, C, W-1], conv_w [C, W]."""
    window = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, W]
    y = (window * conv_w.to(x.dtype)).sum(-1)
    return F.silu(y), window[..., 1:]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)), f [..., H*D] -> [..., H, D]."""
    H = A_log.shape[0]
    f = (f + dt_bias).unflatten(-1, (H, -1))
    return lower_bound * torch.sigmoid(torch.exp(A_log)[:, None] * f)


def delta_step(q, k, v, g, beta, S):
    """One recurrence step. q,k,v,g [B,H,D], beta [B,H], S [B,H,K,V] -> (o [B,H,V], S_new)."""
    S = torch.exp(g)[..., None] * S
    kS = torch.einsum("bhk,bhkv->bhv", k, S)
    S = S + beta[..., None, None] * k[..., :, None] * (v - kS)[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q, S) / math.sqrt(q.shape[-1])
    return o, S


def gated_out_norm(o: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms(o; w) * sigmoid(gate), per head. o [B,H,D], gate [B,H*D] -> [B,H*D]."""
    o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * w
    return (o.flatten(-2) * torch.sigmoid(gate))


def _prep(qkv, f, b, p: KDAParams, conv_state, dtype):
    """Conv + silu + l2norm + gate + beta for one position. Returns q,k,v,g,beta,new_conv_state."""
    H, D = p.heads, p.head_dim
    y, new_conv = conv_update(qkv.to(dtype), conv_state, p.conv_w.to(dtype))
    q, k, v = y.unflatten(-1, (3, H, D)).unbind(-3)
    q, k = l2norm(q), l2norm(k)
    g = kda_gate(f.to(dtype), p.A_log.to(dtype), p.dt_bias.to(dtype), p.lower_bound)
    beta = torch.sigmoid(b.to(dtype))
    return q, k, v, g, beta, new_conv


def kda_decode(qkv, f, b, gate, p: KDAParams, state, conv_state, *, dtype=None, out_dtype=None):
    """One decode step (T = 1). Functional: returns (out [B,H*D], new_state, new_conv_state).
    Computes in `dtype` (default: the state's dtype); `out` is cast to `out_dtype` (default qkv's)."""
    dtype = dtype or state.dtype
    q, k, v, g, beta, new_conv = _prep(qkv, f, b, p, conv_state, dtype)
    o, S = delta_step(q, k, v, g, beta, state.to(dtype))
    out = gated_out_norm(o, gate.to(dtype), p.o_norm_w.to(dtype), p.eps)
    return out.to(out_dtype or qkv.dtype), S, new_conv.to(conv_state.dtype)


def checkpoint_positions(T: int, checkpoint: int | None = None) -> list[int]:
    """The positions whose state a verify with `checkpoint` c keeps: slot s holds the state after position
    min((s + 1) c, T) - 1, for s < ceil(T / c). c = 1 (None): every position; c = T: the last only."""
    c = checkpoint or 1
    return [min((s + 1) * c, T) - 1 for s in range(-(-T // c))]


def slots_written(n: int, T: int, checkpoint: int | None = None) -> int:
    """How many leading slots a ragged verify writes for a sequence of n (1..T) positions: the slots whose
    position is < n (n // c when n < T, every slot when n = T); the others are left untouched."""
    c = checkpoint or 1
    return -(-T // c) if n >= T else n // c


def replay_plan(n: int, T: int, checkpoint: int | None = None) -> tuple[int, int, int]:
    """How a commit of n accepted positions (p = n - 1) gets the state after p from a verify with `checkpoint` c:
    (slot, t0, r) = start from slot `slot` (-1: the start state, which verify never writes), then run the r
    positions t0 .. t0 + r - 1 (= p). A slot position (n a multiple of c, or n = T) is a copy: r = 0.
    Otherwise slot = n // c - 1, t0 = (n // c) c and r = n mod c (1 .. c - 1)."""
    c = checkpoint or 1
    if n % c == 0 or n == T:
        return (n - 1) // c, n, 0
    q = n // c
    return q - 1, q * c, n - q * c


def kda_verify(qkv, f, b, gate, p: KDAParams, state, conv_state, *, dtype=None, out_dtype=None, checkpoint=None):
    """T positions of each sequence in order (speculative verification).
    qkv [B,T,3HD], f [B,T,HD], b [B,T,H], gate [B,T,HD].
    Returns (out [B,T,HD], states [B,S,H,K,V], conv_states [B,T,C,W-1]): the conv window after every
    position and the state after each checkpoint position (`checkpoint_positions`: S = ceil(T / c) slots;
    checkpoint None or 1 = every position), so a rejected suffix can be rolled back with `kda_rollback`
    (c = 1) or `kda_commit` (any c)."""
    T = qkv.shape[1]
    outs, states, convs = [], [], []
    S, cs = state, conv_state
    for t in range(T):
        o, S, cs = kda_decode(qkv[:, t], f[:, t], b[:, t], gate[:, t], p, S, cs, dtype=dtype,
                              out_dtype=out_dtype)
        outs.append(o)
        states.append(S)
        convs.append(cs)
    keep = checkpoint_positions(T, checkpoint)
    return torch.stack(outs, 1), torch.stack([states[t] for t in keep], 1), torch.stack(convs, 1)


def kda_rollback(states: torch.Tensor, conv_states: torch.Tensor, num_accepted: torch.Tensor):
    """Pick each sequence's state after its last accepted position. num_accepted [B] in 1..T
    (position 0, the verified token itself, is always kept). Returns (state, conv_state)."""
    B, T = states.shape[:2]
    n = num_accepted.to(torch.long)
    if n.shape != (B,) or bool(((n < 1) | (n > T)).any()):
        raise ValueError(f"num_accepted must be shape [{B}] with values in 1..{T}, got {num_accepted}")
    idx = torch.arange(B, device=states.device)
    return states[idx, n - 1], conv_states[idx, n - 1]


def kda_commit(states, conv_states, num_accepted, qkv, f, b, p: KDAParams, state, conv_state, *, checkpoint=None,
               dtype=None):
    """The state and conv state after each sequence's last accepted position p = n_b - 1, from a verify with
    `checkpoint` c (states [B, ceil(T/c), H, K, V], conv_states [B, T, C, W-1]) and the verify's own inputs
    (qkv [B,T,3HD], f [B,T,HD], b [B,T,H]) and start state / conv state (only read): a slot position copies its
    slot; any other p runs the recurrence from the last slot before p (or the start state) over the positions in
    between (`replay_plan`), its conv window from conv_states (or the start conv state). Computes in `dtype`
    (default: the state's). Returns (state [B,H,K,V], conv_state [B,C,W-1]); the naive twin of the kernels'
    commit (a loop over sequences)."""
    B, T = conv_states.shape[:2]
    n = num_accepted.to("cpu", torch.long)
    if n.shape != (B,) or bool(((n < 1) | (n > T)).any()):
        raise ValueError(f"num_accepted must be shape [{B}] with values in 1..{T}, got {num_accepted}")
    dtype = dtype or state.dtype
    S_out, c_out = [], []
    for bb in range(B):
        nb = int(n[bb])
        slot, t0, r = replay_plan(nb, T, checkpoint)
        S = (states[bb, slot] if slot >= 0 else state[bb]).to(dtype)[None]
        cs = (conv_states[bb, t0 - 1] if t0 > 0 else conv_state[bb])[None]
        for t in range(t0, t0 + r):
            q, k, v, g, beta, cs = _prep(qkv[bb:bb + 1, t], f[bb:bb + 1, t], b[bb:bb + 1, t], p, cs, dtype)
            _, S = delta_step(q, k, v, g, beta, S)
        S_out.append(S[0])
        c_out.append(conv_states[bb, nb - 1])
    return torch.stack(S_out), torch.stack(c_out)


# ---- chunked prefill -------------------------------------------------------------------------

def kda_prefill_sequential(qkv, f, b, gate, p: KDAParams, state, conv_state, *, dtype=None):
    """Prefill by repeated single steps: the oracle for the chunked forms. Shapes as kda_verify."""
    out, states, convs = kda_verify(qkv, f, b, gate, p, state, conv_state, dtype=dtype)
    return out, states[:, -1], convs[:, -1]


def _chunk_prep(qkv, f, b, p, conv_state, dtype):
    """Run the conv/norm/gate prologue over all L positions. Returns q,k,v,g [B,L,H,D], beta [B,L,H]."""
    L = qkv.shape[1]
    qs, ks, vs, gs, bs = [], [], [], [], []
    cs = conv_state
    for t in range(L):
        q, k, v, g, beta, cs = _prep(qkv[:, t], f[:, t], b[:, t], p, cs, dtype)
        qs.append(q), ks.append(k), vs.append(v), gs.append(g), bs.append(beta)
    st = lambda xs: torch.stack(xs, 1)  # noqa: E731
    return st(qs), st(ks), st(vs), st(gs), st(bs), cs


def chunk_intra(q, k, v, g, beta, inverse_dtype=torch.float32):
    """One chunk's local quantities, for heads batched in front: q,k,v,g [..., C, D], beta [..., C].

    With G_t = cumsum(g)_t and the pairwise decay E_ts = exp(G_t - G_s) (<= 1 for s <= t):
      A_ts  = beta_t * sum_d k_t k_s E_ts            (s < t; strictly lower triangular)
      T     = (I + A)^-1                             # the numerically sensitive 64x64 inverse
      W     = T diag(beta) (k * exp(G))              # C x K: how the start state leaks into u
      U0    = T diag(beta) v                         # C x V: pseudo-values with a zero start state
    so that the delta pseudo-values are u = U0 - W S0.
    `inverse_dtype` = bf16 rounds A's entries to bf16 before the (fp32) inversion, to study the loss.
    """
    C = q.shape[-2]
    G = torch.cumsum(g, dim=-2)  # [..., C, D]
    E = torch.exp(G[..., :, None, :] - G[..., None, :, :])  # [..., t, s, D]; used only for s <= t
    tri_strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    tri = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    E = torch.where(tri[..., None], E, torch.zeros((), dtype=E.dtype, device=E.device))
    A = beta[..., :, None] * torch.einsum("...td,...sd,...tsd->...ts", k, k, E)
    A = A.masked_fill(~tri_strict, 0)
    if inverse_dtype == torch.bfloat16:
        A = A.to(torch.bfloat16).to(A.dtype)
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    W = Tm @ (beta[..., None] * k * torch.exp(G))
    U0 = Tm @ (beta[..., None] * v)
    return G, E, W, U0


def kda_prefill_chunked(qkv, f, b, gate, p: KDAParams, state, conv_state, *, chunk: int = 64,
                        dtype=None, inverse_dtype=torch.float32, grouped: bool = False):
    """Chunked prefill (chunks of `chunk` positions). Returns (out [B,L,HD], final state, conv_state).

    Per chunk with start state S0 (u = U0 - W S0, see chunk_intra):
      o_t   = scale * [ (q_t * exp(G_t)) S0 + sum_{s<=t} (sum_d q_t k_s E_ts) u_s ]
      S_end = exp(G_C) * S0 + sum_s (k_s * exp(G_C - G_s)) u_s^T
    grouped=False carries S0 chunk to chunk; grouped=True first writes each chunk as an affine map
    S_end = M S0 + N, combines the maps by an ordered scan to get every chunk's start state, then
    evaluates every chunk's outputs independently (the form that lets chunks replay in parallel).
    """
    dtype = dtype or state.dtype
    L = qkv.shape[1]
    D = p.head_dim
    q, k, v, g, beta, new_conv = _chunk_prep(qkv, f, b, p, conv_state, dtype)
    # heads in front: [B, H, L, D]
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    beta = beta.transpose(1, 2)
    n_chunks = -(-L // chunk)
    scale = 1.0 / math.sqrt(D)
    S = state.to(dtype)
    pieces = []
    for c in range(n_chunks):
        sl = slice(c * chunk, min((c + 1) * chunk, L))
        pieces.append((q[..., sl, :], k[..., sl, :], v[..., sl, :], g[..., sl, :], beta[..., sl]))
    intra = [chunk_intra(*pc, inverse_dtype=inverse_dtype) for pc in pieces]

    def chunk_out(pc, it, S0):
        qc, kc, vc, gc, bc = pc
        G, E, W, U0 = it
        u = U0 - W @ S0
        Cn = qc.shape[-2]
        tri = torch.tril(torch.ones(Cn, Cn, dtype=torch.bool, device=qc.device))
        Aqk = torch.einsum("...td,...sd,...tsd->...ts", qc, kc, E).masked_fill(~tri, 0)
        o = scale * ((qc * torch.exp(G)) @ S0 + Aqk @ u)
        GC = G[..., -1:, :]
        S_end = torch.exp(GC).transpose(-1, -2) * S0 + (kc * torch.exp(GC - G)).transpose(-1, -2) @ u
        return o, S_end

    outs = []
    if not grouped:
        for pc, it in zip(pieces, intra):
            o, S = chunk_out(pc, it, S)
            outs.append(o)
    else:
        # affine summaries: S_end = M S0 + N
        starts = []
        eye = torch.eye(D, dtype=S.dtype, device=S.device)
        for pc, it in zip(pieces, intra):
            starts.append(S)
            _, kc, _, _, _ = pc
            G, _, W, U0 = it
            GC = G[..., -1:, :]
            Kd = (kc * torch.exp(GC - G)).transpose(-1, -2)  # [.., D, C]
            M = torch.exp(GC).transpose(-1, -2) * eye - Kd @ W
            N = Kd @ U0
            S = M @ S + N
        for pc, it, S0 in zip(pieces, intra, starts):
            o, _ = chunk_out(pc, it, S0)
            outs.append(o)
    o = torch.cat(outs, dim=-2).transpose(1, 2)  # [B, L, H, D]
    o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + p.eps) * p.o_norm_w.to(dtype)
    out = o.flatten(-2) * torch.sigmoid(gate.to(dtype))
    return out.to(qkv.dtype), S, new_conv.to(conv_state.dtype)


# ---- inputs ----------------------------------------------------------------------------------

def make_kda_inputs(B: int, H: int, D: int = 128, T: int | None = None, W: int = 4, *, seed: int = 0,
                    dtype=torch.bfloat16, device="cpu", state_scale: float = 0.1):
    """Fresh random KDA inputs at realistic scales (never zeros). T=None gives the decode layout."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    C = 3 * H * D
    lead = (B,) if T is None else (B, T)

    def rn(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s)

    inputs = dict(
        qkv=rn(*lead, C).to(dtype),
        f=rn(*lead, H * D).to(dtype),
        b=rn(*lead, H).to(dtype),
        gate=rn(*lead, H * D).to(dtype),
    )
    params = KDAParams(
        conv_w=rn(C, W, s=0.5).to(dtype),
        A_log=torch.log(torch.empty(H).uniform_(1, 16, generator=gen)).float(),
        dt_bias=rn(H * D, s=0.5).float(),
        o_norm_w=(1 + rn(D, s=0.1)).to(dtype),
    )
    state = rn(B, H, D, D, s=state_scale).float()
    conv_state = rn(B, C, W - 1).to(dtype)
    inputs = {k2: v.to(device) for k2, v in inputs.items()}
    return inputs, params.to(device=device), state.to(device), conv_state.to(device)
