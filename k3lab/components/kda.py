"""KDA component API (docs/CONTRACTS.md): decode / verify / commit / prefill.

Which implementation runs comes from the one dispatcher (k3lab.components.dispatch) and the registry
(k3lab.ops.kda names every kernel):
  reference      k3lab.ref.kda computed in fp32 (inputs upcast), results copied into the caller's
                 in-place buffers (state, conv_state, out, hists).
  torch_compile  torch.compile of the fp32 reference decode step; verify/commit/prefill run the reference
                 (the record says so).
  triton         k3lab_kernels.triton.kda_{decode,verify,prefill} (one launch for decode/verify).
  cute           k3lab_kernels.cute.kda_{decode,verify,prefill} (same signatures as the Triton wrappers).
  aiter          refused (no AITER KDA kernels in this workbench).
  auto           the measured winner per op, batch and T (k3lab.policy reads data/kda_defaults.json:
                 backend and tile_v); the torch reference without a GPU. The Triton interpreter on CPU is
                 never picked by auto: it is for logic tests.

Every argument is validated at this boundary (shape, dtype, device, contiguity, tile_v, lengths and
num_accepted ranges, backend availability); errors are `KDAArgumentError` (a ValueError) naming the
argument. Value-range checks (lengths, num_accepted) read the tensor on the host, which is a device
sync: pass `check_values=False` on timed / CUDA-graph-captured paths (the kernels clamp instead).

Each call returns `out` (commit returns None). Pass `ran=[]` to get the record of what ran appended to
that list (a `k3lab.components.dispatch.Ran`: op, backend asked, backend run, kernel, options, why).
"""
from __future__ import annotations

import torch

from k3lab.components import dispatch
from k3lab.ref import kda as ref
from k3lab.ref.kda import KDAParams

TILE_V_ALLOWED = (4, 8, 16, 32, 64, 128)
STATE_DTYPES = (torch.float32, torch.bfloat16)
INVERSES = ("fp32", "bf16")


class KDAArgumentError(ValueError):
    """An argument of the KDA component API has the wrong shape, dtype, device, layout or value."""


# ---- validation --------------------------------------------------------------------------------

def _fail(name: str, msg: str):
    raise KDAArgumentError(f"KDA argument {name!r}: {msg}")


def _check(name, t, shape, dtypes, device):
    if not isinstance(t, torch.Tensor):
        _fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(name, f"expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        _fail(name, f"expected device {device} (same as qkv), got {t.device}")
    if not t.is_contiguous():
        _fail(name, "expected a contiguous tensor")


def _check_params(p, device):
    if not isinstance(p, KDAParams):
        _fail("params", f"expected k3lab.ref.kda.KDAParams, got {type(p).__name__}")
    H, D = p.heads, p.head_dim
    if p.conv_w.dim() != 2:
        _fail("params.conv_w", f"expected shape [3*H*D, W], got {tuple(p.conv_w.shape)}")
    if p.A_log.dim() != 1:
        _fail("params.A_log", f"expected shape [H], got {tuple(p.A_log.shape)}")
    if p.o_norm_w.dim() != 1:
        _fail("params.o_norm_w", f"expected shape [D], got {tuple(p.o_norm_w.shape)}")
    fl = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    _check("params.conv_w", p.conv_w, (3 * H * D, p.conv_w.shape[1]), fl, device)
    _check("params.A_log", p.A_log, (H,), fl, device)
    _check("params.dt_bias", p.dt_bias, (H * D,), fl, device)
    _check("params.o_norm_w", p.o_norm_w, (D,), fl, device)
    if p.conv_kernel < 2:
        _fail("params.conv_w", f"conv kernel width must be >= 2, got {p.conv_kernel}")
    if D & (D - 1) or D < 16:
        _fail("params.o_norm_w", f"head dim D must be a power of two >= 16, got {D}")
    return H, D, p.conv_kernel


def _validate(qkv, f, b, gate, params, state, conv_state, T=None):
    """Shapes for one position (T=None) or T positions. Returns (B, T, H, D, W)."""
    if not isinstance(qkv, torch.Tensor):
        _fail("qkv", f"expected a torch.Tensor, got {type(qkv).__name__}")
    dev = qkv.device
    H, D, W = _check_params(params, dev)
    C = 3 * H * D
    lead_n = 1 if T is None else 2
    if qkv.dim() != lead_n + 1:
        _fail("qkv", f"expected {lead_n + 1} dims ({'[B,3HD]' if T is None else '[B,T,3HD]'}), got shape "
                     f"{tuple(qkv.shape)}")
    lead = tuple(qkv.shape[:lead_n])
    B = lead[0]
    if B < 1:
        _fail("qkv", "batch must be >= 1")
    act = (torch.bfloat16,)
    _check("qkv", qkv, lead + (C,), act, dev)
    _check("f", f, lead + (H * D,), act, dev)
    _check("b", b, lead + (H,), act, dev)
    _check("gate", gate, lead + (H * D,), act, dev)
    _check("state", state, (B, H, D, D), STATE_DTYPES, dev)
    _check("conv_state", conv_state, (B, C, W - 1), act, dev)
    return B, (lead[1] if T is not None else 1), H, D, W


def _check_tile(tile_v, D, default):
    if tile_v is None:
        return min(default, D)
    if isinstance(tile_v, bool) or tile_v not in TILE_V_ALLOWED:
        _fail("tile_v", f"expected one of {TILE_V_ALLOWED}, got {tile_v!r}")
    if D % tile_v:
        _fail("tile_v", f"head dim D={D} must be divisible by tile_v={tile_v}")
    return tile_v


def _out(out, shape, dev, name="out"):
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=dev)
    _check(name, out, shape, (torch.bfloat16,), dev)
    return out


def _f32(*ts):
    return [t.float() for t in ts]


# ---- decode --------------------------------------------------------------------------------------

def ref_decode_fp32(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, state, conv_state, eps, lb):
    """The reference decode step in fp32 (what the reference and torch_compile backends run)."""
    p = KDAParams(conv_w, A_log, dt_bias, o_norm_w, eps, lb)
    return ref.kda_decode(qkv.float(), f.float(), b.float(), gate.float(), p.to(torch.float32),
                          state.float(), conv_state, dtype=torch.float32, out_dtype=torch.bfloat16)


def _check_pdl(pdl, be):
    """pdl (the kda_pdl switch): programmatic dependent launch, implemented by the CuTe kernels only."""
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be a bool, got {pdl!r}")
    if pdl and be != "cute":
        _fail("pdl", f"pdl=True (programmatic dependent launch) is implemented by the cute backend only; "
                     f"the backend here is {be!r}")


def _select(op, backend, B, T, tile_v, D, W):
    """(backend, tile_v given or from the auto rule, why) through the one dispatcher (the shape passed, so that
    `auto` passes over a kernel that cannot take it: the CuTe kernels at head_dim 128 and conv width 4 only)."""
    be, opts, why = dispatch.select(op, backend, B=B, T=T, shape=dict(D=D, W=W, T=T))
    if tile_v is None and opts.get("tile_v") and opts["tile_v"] <= D:
        tile_v = opts["tile_v"]
    return be, tile_v, why


def _sd(state):
    return str(state.dtype).replace("torch.", "")


def decode(qkv, f, b, gate, params, state, conv_state, out=None, *, backend="reference", tile_v=None,
           num_warps=None, pdl=False, ran=None):
    """One position: updates `state` (fp32/bf16) and `conv_state` (bf16) in place, writes out [B,H*D]
    bf16 and returns it. tile_v: value columns per program (triton/cute only; validated always);
    None = the whole head (D, i.e. 128 for K3) or the auto rule's. pdl (cute only): launch with
    programmatic dependent launch; the kernel directly before on the stream must not write `state` /
    `conv_state` (see k3lab_kernels.cute.kda_decode). ran: a list to append the record of what ran to."""
    B, _, H, D, W = _validate(qkv, f, b, gate, params, state, conv_state)
    be, tile_v, why = _select("kda_decode", backend, B, 1, tile_v, D, W)
    _check_pdl(pdl, be)
    tile_v = _check_tile(tile_v, D, 128)
    out = _out(out, (B, H * D), qkv.device)
    rec = dict(op="kda_decode", backend_requested=backend, backend=be, why=why, shape=dict(B=B, H=H, D=D),
               options=dict(tile_v=tile_v, state_dtype=_sd(state), pdl=pdl))
    if be == "triton":
        from k3lab_kernels.triton.kda_decode import default_num_warps
        dispatch.kernel("kda_decode", be)(qkv, f, b, gate, params, state, conv_state, out, tile_v=tile_v,
                                          num_warps=num_warps)
        dispatch.record(ran, kernel=dispatch.kernel_path("kda_decode", be), **rec,
                        notes=f"num_warps={num_warps or default_num_warps(D, tile_v)}")
        return out
    if be == "cute":
        dispatch.kernel("kda_decode", be)(qkv, f, b, gate, params, state, conv_state, out, tile_v=tile_v, pdl=pdl)
        dispatch.record(ran, kernel=dispatch.kernel_path("kda_decode", be), **rec)
        return out
    args = (qkv, f, b, gate, params.conv_w, params.A_log, params.dt_bias, params.o_norm_w, state, conv_state,
            float(params.eps), float(params.lower_bound))
    if be == "torch_compile":
        fn = dispatch.compiled(f"kda.decode.{qkv.device}.{state.dtype}", ref_decode_fp32, dynamic=True)
        kernel = "torch.compile(" + dispatch.kernel_path("kda_decode", be) + ")"
    else:
        fn, kernel = ref_decode_fp32, "k3lab.components.kda:ref_decode_fp32 (k3lab.ref.kda in fp32)"
    o, S, cs = fn(*args)
    out.copy_(o)
    state.copy_(S)
    conv_state.copy_(cs)
    rec["options"]["tile_v"] = None
    dispatch.record(ran, kernel=kernel, **rec, notes="tile_v not used by this backend")
    return out


# ---- verify / commit -----------------------------------------------------------------------------

def _check_lengths(lengths, B, T, dev, check_values):
    if lengths is None:
        return
    _check("lengths", lengths, (B,), (torch.int32,), dev)
    if check_values:
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 1 or hi > T:
            _fail("lengths", f"values must lie in 1..T={T}, got min {lo} max {hi}")


# The `auto` checkpoint (H200, 12 heads, fp32 state; docs/NOTES_kda.md, fourteenth session): the c that gave the
# shortest verify + commit at T = 8 with sequence b accepting 1 + b mod T (profiles/h200/kda_ckpt.json.gz (git history
# at dca2865) and kda_commit_tiles.json.gz, both retired for room): c = 4 from batch 8 (B = 8 / 16 / 64: 23.9 / 43.0
# / 127.6 us a cycle against 28.5 / 55.4 / 172.2 at c = 1); batch 1 keeps every state (11.8 us against 12.2 at c = 4).
# T < 8 and batches 2..7: c = 1 (their commits were not measured).
AUTO_CHECKPOINT = ((8, 8, 4),)  # (min T, min batch, c)


def default_checkpoint(B: int, T: int) -> int:
    """The checkpoint `checkpoint="auto"` resolves to for B sequences of T positions (verify and commit alike)."""
    for t_min, b_min, c in AUTO_CHECKPOINT:
        if T >= t_min and B >= b_min:
            return min(c, T)
    return 1


def history_slots(T: int, checkpoint=None, B: int = 1) -> int:
    """The state_hist slots a verify of T positions writes: ceil(T / c) (c resolved as `verify` does)."""
    return -(-T // _check_checkpoint(checkpoint, T, B))


def _check_checkpoint(checkpoint, T, B=1):
    """checkpoint: None (= 1), "auto" (`default_checkpoint(B, T)`) or an int c in 1..T; returns c."""
    if checkpoint is None:
        return 1
    if checkpoint == "auto":
        return default_checkpoint(B, T)
    if isinstance(checkpoint, bool) or not isinstance(checkpoint, int) or checkpoint < 1:
        _fail("checkpoint", f"expected None, \"auto\" or an int >= 1, got {checkpoint!r}")
    if checkpoint > T:
        _fail("checkpoint", f"must be at most T={T} (c = T keeps the last position's state only), got {checkpoint}")
    return checkpoint


def verify(qkv, f, b, gate, params, state, conv_state, out=None, *, state_hist, conv_hist, lengths=None,
           checkpoint=None, backend="reference", tile_v=None, num_warps=None, check_values=True, pdl=False,
           ran=None):
    """T positions from the start state (state/conv_state only read). Writes out [B,T,HD] bf16,
    state_hist [B,S,H,D,D] (state dtype), conv_hist [B,T,3HD,W-1] bf16 (the window after every position).
    checkpoint c (None = 1, today's contract: a state after every position): S = ceil(T / c) slots, slot s =
    the state after position min((s + 1) c, T) - 1 (c = T: the last position only); `commit` with the same c
    recomputes any other position's state. "auto": `default_checkpoint(B, T)` (the measured cycle's best;
    `history_slots` sizes state_hist for it). lengths [B] int32 in 1..T: positions >= lengths[b] are not
    computed and their out / conv_hist entries, and the slots whose position is >= lengths[b], are left
    untouched. tile_v None = 8 for triton (its measured best at B=1, T=4 on the H200), 128 for cute; with
    backend="auto" the tile comes from data/kda_defaults.json. pdl: as in `decode` (cute only; the kernel
    directly before must not write `state` / `conv_state`, e.g. a commit of the same sequences)."""
    B, T, H, D, W = _validate(qkv, f, b, gate, params, state, conv_state, T=True)
    if not 1 <= T <= 8:
        _fail("qkv", f"verify takes T in 1..8 positions, got T={T}")
    ck = _check_checkpoint(checkpoint, T, B)
    NS = -(-T // ck)
    be, tile_v, why = _select("kda_verify", backend, B, T, tile_v, D, W)
    _check_pdl(pdl, be)
    tile_v = _check_tile(tile_v, D, 128 if be == "cute" else 8)
    dev = qkv.device
    out = _out(out, (B, T, H * D), dev)
    _check("state_hist", state_hist, (B, NS, H, D, D), (state.dtype,), dev)
    _check("conv_hist", conv_hist, (B, T, 3 * H * D, W - 1), (torch.bfloat16,), dev)
    _check_lengths(lengths, B, T, dev, check_values)
    rec = dict(op="kda_verify", backend_requested=backend, backend=be, why=why,
               shape=dict(B=B, T=T, H=H, D=D, ragged=lengths is not None),
               options=dict(tile_v=tile_v, state_dtype=_sd(state), pdl=pdl, checkpoint=ck))
    if be == "triton":
        from k3lab_kernels.triton.kda_decode import default_num_warps
        dispatch.kernel("kda_verify", be)(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist,
                                          lengths=lengths, tile_v=tile_v, num_warps=num_warps, checkpoint=ck)
        dispatch.record(ran, kernel=dispatch.kernel_path("kda_verify", be), **rec,
                        notes=f"num_warps={num_warps or default_num_warps(D, tile_v, verify=True)}"
                        + (" ragged" if lengths is not None else " uniform"))
        return out
    if be == "cute":
        fn = dispatch.kernel("kda_verify", be)
        row_warps = __import__(fn.__module__, fromlist=["default_row_warps"]).default_row_warps(tile_v, B, H, T)
        fn(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths=lengths, tile_v=tile_v,
           row_warps=row_warps, pdl=pdl, checkpoint=ck)
        dispatch.record(ran, kernel=dispatch.kernel_path("kda_verify", be), **rec,
                        notes=f"row_warps={row_warps}" + (" ragged" if lengths is not None else ""))
        return out
    o, S, cs = ref.kda_verify(*_f32(qkv, f, b, gate), params.to(torch.float32), state.float(), conv_state,
                              dtype=torch.float32, out_dtype=torch.bfloat16, checkpoint=ck)
    if lengths is None:
        out.copy_(o)
        state_hist.copy_(S)
        conv_hist.copy_(cs)
    else:
        n = lengths.to(torch.long).cpu()
        for bb in range(B):
            k = int(n[bb])
            out[bb, :k].copy_(o[bb, :k])
            state_hist[bb, :ref.slots_written(k, T, ck)].copy_(S[bb, :ref.slots_written(k, T, ck)])
            conv_hist[bb, :k].copy_(cs[bb, :k])
    rec["options"]["tile_v"] = None
    dispatch.record(ran, kernel="k3lab.ref.kda:kda_verify (fp32)", **rec,
                    notes="torch_compile runs the reference for verify" if be == "torch_compile" else "")
    return out


def commit(state_hist, conv_hist, num_accepted, state, conv_state, *, checkpoint=None, qkv=None, f=None, b=None,
           params=None, tile_v=None, backend="reference", check_values=True, ran=None):
    """Keep each sequence's first n_b = num_accepted[b] verified positions (num_accepted [B] int in 1..T):
    state[b] = the state after position p = n_b - 1, conv_state[b] = conv_hist[b, p].
    checkpoint c (None = 1; "auto" as in `verify`): the verify's; state_hist [B, ceil(T/c), H, D, D], conv_hist
    [B, T, 3HD, W-1]. A slot position p (n_b a multiple of c, or n_b = T) copies its slot (c = 1: always); any
    other p recomputes the state from the last slot before p (or from `state`, the start state verify never
    writes) over the n_b mod c positions in between, from the verify's inputs qkv [B,T,3HD], f [B,T,HD], b [B,T,H]
    and params (required when c >= 2) and conv_hist, and writes it into `state` in place. tile_v: the triton
    replay's value tile (None = `default_commit_tile(B, c)`, the H200 measurement). The triton backend reads
    num_accepted on the device only (with check_values=False no host sync); the reference loops over sequences on
    the host (fp32 recurrence); cute has no commit kernel: c = 1 the torch gather, c >= 2 the triton replay (the
    reference where triton cannot run)."""
    if not isinstance(state_hist, torch.Tensor) or state_hist.dim() != 5:
        _fail("state_hist", "expected a tensor [B,S,H,D,D]")
    if not isinstance(conv_hist, torch.Tensor) or conv_hist.dim() != 4:
        _fail("conv_hist", "expected a tensor [B,T,3HD,W-1]")
    B, _, H, D, _ = state_hist.shape
    T = conv_hist.shape[1]
    dev = state_hist.device
    if T < 1:
        _fail("conv_hist", "expected T >= 1 positions")
    ck = _check_checkpoint(checkpoint, T, B)
    NS = -(-T // ck)
    _check("state_hist", state_hist, (B, NS, H, D, D), STATE_DTYPES, dev)
    _check("conv_hist", conv_hist, (B, T, 3 * H * D, conv_hist.shape[-1]), (torch.bfloat16,), dev)
    _check("state", state, (B, H, D, D), (state_hist.dtype,), dev)
    _check("conv_state", conv_state, (B, 3 * H * D, conv_hist.shape[-1]), (torch.bfloat16,), dev)
    _check("num_accepted", num_accepted, (B,), (torch.int32, torch.int64), dev)
    if ck > 1:
        for name, t in (("qkv", qkv), ("f", f), ("b", b), ("params", params)):
            if t is None:
                _fail(name, f"commit with checkpoint={ck} recomputes the states between slots: pass the verify's "
                            "qkv, f, b and params")
        Hp, Dp, Wp = _check_params(params, dev)
        if (Hp, Dp, Wp - 1) != (H, D, conv_hist.shape[-1]):
            _fail("params", f"heads {Hp}, head dim {Dp}, conv width {Wp} do not match state_hist / conv_hist "
                            f"(H={H}, D={D}, W-1={conv_hist.shape[-1]})")
        act = (torch.bfloat16,)
        _check("qkv", qkv, (B, T, 3 * H * D), act, dev)
        _check("f", f, (B, T, H * D), act, dev)
        _check("b", b, (B, T, H), act, dev)
    from k3lab_kernels.triton.kda_verify import default_commit_tile
    tile_v = _check_tile(tile_v, D, default_commit_tile(B, ck))
    if check_values:
        lo, hi = int(num_accepted.min()), int(num_accepted.max())
        if lo < 1 or hi > T:
            _fail("num_accepted", f"values must lie in 1..T={T}, got min {lo} max {hi}")
    if backend == "auto":
        be = "triton" if dispatch.can_run("kda_verify", "triton") else "reference"
    else:
        be, _, _ = dispatch.select("kda_verify", backend, B=B, T=T)
    run = be
    if be == "cute" and ck > 1:
        run = "triton" if dispatch.can_run("kda_verify", "triton") else "reference"
    notes = "cute has no commit kernel" if be == "cute" else ""
    if run == "triton":
        from k3lab_kernels.triton.kda_verify import commit as tcommit
        tcommit(state_hist, conv_hist, num_accepted, state, conv_state, checkpoint=ck, qkv=qkv, f=f, b=b,
                params=params, tile_v=tile_v)
        kernel = ("k3lab_kernels.triton.kda_verify:commit (_gather_rows_kernel x2)" if ck == 1 else
                  "k3lab_kernels.triton.kda_verify:commit (_kda_replay_kernel + _gather_rows_kernel)")
    elif ck == 1:  # reference, torch_compile and cute: the torch gather
        S, cs = ref.kda_rollback(state_hist, conv_hist, num_accepted)
        state.copy_(S)
        conv_state.copy_(cs)
        kernel = "k3lab.ref.kda:kda_rollback + copy_"
    else:
        S, cs = ref.kda_commit(state_hist, conv_hist, num_accepted, *_f32(qkv, f, b), params.to(torch.float32),
                               state, conv_state, checkpoint=ck, dtype=torch.float32)
        state.copy_(S)
        conv_state.copy_(cs)
        kernel = "k3lab.ref.kda:kda_commit (fp32) + copy_"
    dispatch.record(ran, op="kda_commit", backend_requested=backend, backend=be, kernel=kernel,
                    options=dict(state_dtype=_sd(state), checkpoint=ck, tile_v=tile_v if run == "triton" else None),
                    shape=dict(B=B, T=T, H=H, D=D), notes=notes)


# ---- prefill ---------------------------------------------------------------------------------------

def prefill(qkv, f, b, gate, params, state, conv_state, out=None, *, chunk=64, inverse="fp32", grouped=False,
            backend="reference", tile_v=None, ran=None):
    """L positions per sequence, chunked. Writes out [B,L,HD] bf16, updates state/conv_state in place.
    inverse: "fp32" | "bf16" (A rounded to bf16 before the 64x64 inverse); grouped: chunk summaries
    + ordered scan + parallel chunk outputs. tile_v: value tile of the triton/cute state passes (>= 16)."""
    B, L, H, D, W = _validate(qkv, f, b, gate, params, state, conv_state, T=True)
    if chunk not in (16, 32, 64):
        _fail("chunk", f"expected one of (16, 32, 64), got {chunk!r}")
    if inverse not in INVERSES:
        _fail("inverse", f"expected one of {INVERSES}, got {inverse!r}")
    if not isinstance(grouped, bool):
        _fail("grouped", f"expected a bool, got {grouped!r}")
    tile_v = _check_tile(tile_v, D, 32)
    dev = qkv.device
    out = _out(out, (B, L, H * D), dev)
    be, _, why = dispatch.select("kda_prefill", backend, B=B, T=L, shape=dict(D=D, W=W, T=L))
    rec = dict(op="kda_prefill", backend_requested=backend, backend=be, why=why,
               shape=dict(B=B, L=L, H=H, D=D), options=dict(chunk=chunk, inverse=inverse, grouped=grouped,
                                                            tile_v=tile_v, state_dtype=_sd(state)))
    if be in ("triton", "cute"):
        if tile_v < 16:
            _fail("tile_v", f"the {be} prefill needs tile_v >= 16, got {tile_v}")
        if be == "triton":
            launches = "prep,intra,summary,scan,out,norm,conv" if grouped else "prep,intra,seq,norm,conv"
        else:
            launches = "prep,intra,summary,scan,out,norm+conv" if grouped else "prep,intra,chunks,norm+conv"
        dispatch.kernel("kda_prefill", be)(qkv, f, b, gate, params, state, conv_state, out, chunk=chunk,
                                           inverse=inverse, grouped=grouped, tile_v=tile_v)
        dispatch.record(ran, kernel=dispatch.kernel_path("kda_prefill", be), **rec,
                        notes=f"{'grouped' if grouped else 'sequential'} ({launches})")
        return out
    inv_dtype = torch.bfloat16 if inverse == "bf16" else torch.float32
    o, S, cs = ref.kda_prefill_chunked(*_f32(qkv, f, b, gate), params.to(torch.float32), state.float(),
                                       conv_state, chunk=chunk, dtype=torch.float32, inverse_dtype=inv_dtype,
                                       grouped=grouped)
    out.copy_(o)
    state.copy_(S)
    conv_state.copy_(cs)
    rec["options"]["tile_v"] = None
    dispatch.record(ran, kernel="k3lab.ref.kda:kda_prefill_chunked (fp32)", **rec,
                    notes="torch_compile runs the reference for prefill" if be == "torch_compile" else "")
    return out
