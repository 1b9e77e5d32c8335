"""Gated MLA component API (absorbed decode over the latent cache; k3lab.ref.mla has the maths).

    attend(q_lat, q_rope, cache, lengths, *, scale, backend="reference", partitions=1, pad_heads=0, dcp=1,
           dcp_layout="interleave", merge=True, out=None, lse=None, n_positions=None, ran=None, ...)
        -> (o_lat [B,T,H,C], lse [B,T,H]) over an already written cache (MLACache or PagedMLACache);
           merge=False -> the partials (o [B,K,T,H,C], lse [B,K,T,H]), K = dcp * partitions.
    combine(o_parts, lse_parts, w_uv, gate, out=None, *, backend, ran=None, ...) -> [B,T,H*Dv]
        the partials merged by log-sum-exp, times Wuv per head, times sigmoid(gate): what Wo reads.
    query(cq, q_norm, w_uq, w_uk, q_lat=None, q_rope=None, *, eps=1e-6, backend, pdl=None, ran=None)
        the q down-projection's output [B,Q] -> (q_lat [B,H,C], q_rope [B,H,Dr]): q_norm, Wuq and the absorption
        through Wuk (one launch on triton and cute).
    write_cache(kv, kv_norm, cache, lengths, *, eps=1e-6, backend, ran=None)
        the kv down-projection's output [B,T,C+Dr] -> [rms(c; kv_norm) | k_rope] written in place at
        positions lengths[b] .. lengths[b]+T-1 (lengths is not advanced: the caller owns it).
    decode(h, weights, cache, lengths, out=None, *, backend, partitions, pad_heads, dcp, dcp_layout, ran)
        -> out [B, D]: h [B, D] = the normed layer input; writes h's entry at lengths[b], attends
        positions <= lengths[b].
    verify(h, weights, cache, lengths, out=None, *, ...) -> out [B, T, D]: T positions per sequence, entries
        written at lengths .. lengths+T-1, causal among the new.

Options: partitions = split-KV pieces merged by log-sum-exp (1..512; None = the automatic choice of
k3lab_kernels.triton.mla_decode.default_partitions: the reference then uses 1); dcp = decode context
parallelism over `dcp` ranks emulated on one GPU (each rank's partials computed as that GPU would, all
merged by log-sum-exp); pad_heads = run the query heads as this many rows (0 = none; padded outputs
dropped). The Triton kernels' own knobs (block_n, block_m, num_warps, num_stages, block_v) default to
their heuristics.

Backends (the one dispatcher, k3lab.components.dispatch; kernels named in k3lab.ops.mla):
  reference      k3lab.ref.mla in the compute dtype (fp32, fp64 for fp64 inputs)
  torch_compile  torch.compile of the same reference functions
  triton         k3lab_kernels.triton.mla_decode / mla_combine / mla_cache_write (bf16 or fp8 caches) / mla_query
  cute           k3lab_kernels.cute.mla_query (query), k3lab_kernels.cute.mla_cache_write (write_cache; pdl option;
                 the same results as triton bit for bit) and k3lab_kernels.cute.mla_combine (combine; block_r and
                 pdl options; K3's C = 512, Dv = 128) and k3lab_kernels.cute.mla_decode (attend: one new position,
                 at most 16 heads, bf16 cache, no DCP; cluster / stages / partitions / pdl options); decode / verify
                 run the three on CuTe where the decode takes the shape
  aiter          attend through k3lab_kernels.aiter.mla_decode (AITER's kernel on ROCm, heads padded to 16, shards
                 merged here); refused with a message on CUDA
  auto           the measured table (data/mla_defaults.json; a rule's backend that cannot take the call's shape is
                 passed over; the reference where nothing else runs)
Each call takes `ran=[]` to get the record of what ran appended (op, backend asked and run, kernel,
options, shape, why). Argument errors are MLAArgumentError (a ValueError) naming the argument. Value checks
of `lengths` read it on the host (a device sync): pass check_values=False (and n_positions) on timed or
CUDA-graph-captured paths.
"""
from __future__ import annotations

import torch

from k3lab.components import dispatch
from k3lab.ref import mla as ref
from k3lab.ref.mla import DCP_LAYOUTS, MLACache, MLAWeights, PagedMLACache
from k3lab.ref.rmsnorm import compute_dtype
from k3lab.ref.situ import linear
from k3lab.switches import BackendUnavailable

COMPONENT = "mla"
MAX_PARTITIONS = 512  # = k3lab_kernels.triton.mla_decode.MAX_PARTITIONS (tests check they agree)
CACHES = (MLACache, PagedMLACache)
TRITON_CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
TRITON_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class MLAArgumentError(ValueError):
    """An argument of the MLA component API has the wrong type, shape, dtype, device or value."""


def _fail(name: str, msg: str):
    raise MLAArgumentError(f"{COMPONENT}: {name!r} {msg}")


def _refuse_aiter(backend: str, op: str = "mla_decode") -> None:
    """Backend "aiter" runs AITER's MLA decode through k3lab_kernels.aiter.mla_decode on a ROCm GPU with AITER;
    anywhere else, and for the ops it has no adapter for, it is refused here with the reason."""
    if backend != "aiter":
        return
    if op == "mla_decode" and dispatch.can_run(op, "aiter"):
        return
    where = (f"this machine has a CUDA GPU ({torch.cuda.get_device_name()})" if torch.cuda.is_available()
             and torch.version.hip is None else "no ROCm GPU with AITER is visible here")
    what = ("runs AITER's MLA decode on AMD ROCm GPUs only" if op == "mla_decode"
            else f"has no {op} adapter (only the decode attention goes through AITER)")
    raise BackendUnavailable(f"{COMPONENT}: backend 'aiter' {what}, and {where}. Use backend='triton' "
                             f"(or 'reference').")


# ---- validation --------------------------------------------------------------------------------

def _tensor(name, t, dim=None, dtypes=None, device=None):
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        _fail(name, f"must have {dim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(name, f"must have dtype in {[str(d).replace('torch.', '') for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        _fail(name, f"must be on {device} (the device of the first tensor argument), got {t.device}")
    return t


def _floating(name, t):
    """An output the caller passes: a floating dtype on every backend (the reference writes any float dtype; an
    integer buffer would truncate the results silently)."""
    if not t.is_floating_point():
        _fail(name, f"must be a floating tensor, got {t.dtype}")


def _cache(cache, batch: int, width: int, device, triton: bool, kernel: str = "triton"):
    """triton: the kernels' layout checks too (kernel: the backend named in their messages)."""
    if not isinstance(cache, CACHES):
        _fail("cache", f"must be k3lab.ref.mla.MLACache or PagedMLACache, got {type(cache).__name__}")
    if cache.batch != batch or cache.width != width:
        shape = tuple(cache.data.shape) if isinstance(cache, MLACache) else (
            f"pool {tuple(cache.pool.shape)}, table {tuple(cache.block_table.shape)}")
        _fail("cache", f"must hold batch {batch} of width {width} (C + Dr), got {shape}")
    if cache.device != device:
        _fail("cache", f"must be on {device}, got {cache.device}")
    if triton:
        if cache.dtype not in TRITON_CACHE_DTYPES:
            _fail("cache", f"dtype must be bf16 or float8_e4m3fn for the {kernel} backend, got {cache.dtype}")
        if isinstance(cache, MLACache):
            if not cache.data.is_contiguous():
                _fail("cache", f"data must be contiguous for the {kernel} backend")
        elif not (cache.pool.is_contiguous() and cache.block_table.is_contiguous()):
            _fail("cache", f"pool and block_table must be contiguous for the {kernel} backend")
        if cache.scale is not None and (cache.scale.dtype != torch.float32 or not cache.scale.is_contiguous()):
            _fail("cache", f"fp8 scale must be a contiguous float32 tensor for the {kernel} backend")


def _lengths(lengths, batch: int, T: int, cache, device, check_values: bool) -> torch.Tensor:
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        lengths = torch.full((batch,), lengths, dtype=torch.long, device=device)
    if (not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (batch,)
            or lengths.dtype not in (torch.int32, torch.int64)):
        _fail("lengths", f"must be an int32/int64 tensor of shape [{batch}] (or an int), got "
                         f"{getattr(lengths, 'shape', type(lengths).__name__)} {getattr(lengths, 'dtype', '')}")
    if lengths.device != device:
        _fail("lengths", f"must be on {device}, got {lengths.device}")
    if check_values and (bool((lengths < 0).any()) or int(lengths.max()) + T > cache.capacity):
        _fail("lengths", f"+ {T} new positions must lie in 0..{cache.capacity} (the cache capacity), got "
                         f"{lengths.tolist()}")
    return lengths


def _int_opt(name, v, lo, hi=None, allow_none=False):
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        _fail(name, f"must be an int in {rng}{' or None' if allow_none else ''}, got {v!r}")


def _attend_opts(H: int, partitions, pad_heads, dcp, dcp_layout) -> None:
    _int_opt("partitions", partitions, 1, MAX_PARTITIONS, allow_none=True)
    _int_opt("dcp", dcp, 1)
    if isinstance(pad_heads, bool) or not isinstance(pad_heads, int) or (pad_heads and pad_heads < H):
        _fail("pad_heads", f"must be 0 (no padding) or an int >= the {H} query heads, got {pad_heads!r}")
    if dcp_layout not in DCP_LAYOUTS:
        _fail("dcp_layout", f"must be one of {DCP_LAYOUTS}, got {dcp_layout!r}")


def _out(name, t, shape, dtypes, device):
    _tensor(name, t, len(shape), dtypes, device)
    _floating(name, t)
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        _fail(name, "must be contiguous")
    return t


def _kv_args(cache) -> dict:
    if isinstance(cache, PagedMLACache):
        return dict(kv=cache.pool, kv_scale=cache.scale, block_table=cache.block_table)
    return dict(kv=cache.data, kv_scale=cache.scale, block_table=None)


def _cache_kind(cache) -> dict:
    return dict(page_size=cache.page_size if isinstance(cache, PagedMLACache) else 0,
                kv_dtype=str(cache.dtype).replace("torch.", ""), fp8_scale=cache.scale_mode)


# ---- attention -----------------------------------------------------------------------------------

def _pdl(pdl) -> bool:
    """pdl: None = the kernels' default (k3lab_kernels.triton.mla_decode.DEFAULT_PDL), or a bool: the split
    lets the next kernel start early and the merge / combine waits for it (programmatic dependent launch; a
    GPU feature, plain launches elsewhere with the same result)."""
    if pdl is None:
        from k3lab_kernels.triton.mla_decode import DEFAULT_PDL

        return DEFAULT_PDL
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be None (the default) or a bool, got {pdl!r}")
    return pdl


def attend(q_lat: torch.Tensor, q_rope: torch.Tensor, cache, lengths, *, scale: float, backend: str = "reference",
           partitions: int | None = 1, pad_heads: int = 0, dcp: int = 1, dcp_layout: str = "interleave",
           merge: bool = True, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
           n_positions: int | None = None, check_values: bool = True, block_n: int | None = None,
           block_m: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
           pdl: bool | None = None, preload_pages: int | None = None, host_chunk: bool | None = None,
           ksplit: int | None = None, lazy: bool | None = None, fuse_merge: bool | None = None,
           cluster: int | None = None, stages: int | None = None, pipe: bool | None = None,
           ran: list | None = None):
    """Attention of q_lat [B,T,H,C] / q_rope [B,T,H,Dr] over `cache` (entries of the T new positions
    already written), query t of sequence b seeing positions <= lengths[b] + t. Returns (o_lat [B,T,H,C],
    lse [B,T,H]): fp32 from triton, the compute dtype from the reference; `out` / `lse` (fp32, contiguous)
    are filled when given. merge=False returns the partials (triton: in a workspace reused by the next call
    of the same shape). n_positions = max(lengths) + T when the caller knows it (no host sync). The triton
    kernel multiplies bf16 queries on tensor cores: fp32 queries are rounded to bf16 first. Backend "cute"
    (k3lab_kernels.cute.mla_decode: one new position, bf16, no DCP) takes `cluster`, `stages` and `pipe` (the
    pipelined chunk loop; None: the kernel's default_loop of the history), `partitions` as clusters a sequence; the
    Triton knobs (block_n, ...) are Triton's."""
    _refuse_aiter(backend)
    _tensor("q_lat", q_lat, 4)
    dev = q_lat.device
    _tensor("q_rope", q_rope, 4, None, dev)
    if q_rope.shape[:3] != q_lat.shape[:3]:
        _fail("q_rope", f"must agree with q_lat [B,T,H,C] {tuple(q_lat.shape)} on B, T, H; got {tuple(q_rope.shape)}")
    B, T, H, C = q_lat.shape
    if B < 1 or T < 1 or H < 1:
        _fail("q_lat", f"must have B, T, H >= 1, got {tuple(q_lat.shape)}")
    _attend_opts(H, partitions, pad_heads, dcp, dcp_layout)
    if not isinstance(merge, bool):
        _fail("merge", f"must be a bool, got {merge!r}")
    from k3lab.ops import mla as mla_ops  # the registry entry's names (imported here: it imports this module's users)

    be, auto_opts, why = dispatch.select("mla_decode", backend, B=B, T=T,
                                         shape=mla_ops.decode_shape(B, T, H, C, q_rope.shape[-1], cache, dcp,
                                                                    pad_heads))
    tri = be == "triton"
    for name, v in (("cluster", cluster), ("stages", stages), ("pipe", pipe)):
        if v is not None and be != "cute":
            _fail(name, f"is an option of backend 'cute', not {be!r}")
    for name, v in (("lazy", lazy), ("fuse_merge", fuse_merge)):
        if v is not None and be != "triton":
            _fail(name, f"is an option of backend 'triton', not {be!r}")
        if v is not None and not isinstance(v, bool):
            _fail(name, f"must be None (the kernel's default) or a bool, got {v!r}")
    if fuse_merge and not merge:
        _fail("fuse_merge", "merges inside the split: it needs merge=True (merge=False returns the partials)")
    if tri:
        _tensor("q_lat", q_lat, 4, TRITON_ACT_DTYPES)
        _tensor("q_rope", q_rope, 4, TRITON_ACT_DTYPES)
    _cache(cache, B, C + q_rope.shape[-1], dev, tri or be == "cute", kernel=be)
    lengths = _lengths(lengths, B, T, cache, dev, check_values)
    if n_positions is not None:
        _int_opt("n_positions", n_positions, T, cache.capacity)
    if be == "cute":
        for name, v in (("block_n", block_n), ("block_m", block_m), ("num_warps", num_warps),
                        ("num_stages", num_stages), ("preload_pages", preload_pages), ("host_chunk", host_chunk),
                        ("ksplit", ksplit)):
            if v is not None:
                _fail(name, "is an option of backend 'triton', not 'cute'")
        n_max = n_positions or (int(lengths.max()) + T if check_values else None)
        kv = _kv_args(cache)
        knobs = dict(partitions=partitions, cluster=cluster, stages=stages, pdl=pdl, pipe=pipe)
        res = dispatch.kernel("mla_decode", be)(q_lat, q_rope, kv["kv"], lengths, o_lat=out, lse=lse, scale=scale,
                                                block_table=kv["block_table"], merge=merge, n_max=n_max, **knobs)
        dispatch.record(ran, op="mla_decode", backend_requested=backend, backend=be, why=why,
                        kernel=dispatch.kernel_path("mla_decode", be), options=knobs,
                        shape=dict(B=B, T=T, H=H, C=C, capacity=cache.capacity, **_cache_kind(cache)),
                        notes=f"partials K={res[1].shape[1] if not merge else 'merged'}"
                              + ("" if partitions else " (automatic partitions)"))
        return res
    K_shape = None
    if be == "aiter":  # k3lab_kernels.aiter.mla_decode: AITER's kernel, heads padded to 16, shards merged here
        if not merge:
            _fail("merge", "must be True with backend 'aiter' (the adapter returns merged results)")
        if pad_heads not in (0, 16):
            _fail("pad_heads", f"must be 0 or 16 with backend 'aiter' (AITER runs 16 heads), got {pad_heads}")
        o, l = dispatch.kernel("mla_decode", be)(q_lat, q_rope, cache, lengths, scale=scale, dcp=dcp,
                                                 dcp_layout=dcp_layout, num_kv_splits=partitions)
        if out is not None:
            o = out.copy_(o)
        if lse is not None:
            l = lse.copy_(l)
        dispatch.record(ran, op="mla_decode", backend_requested=backend, backend=be, why=why,
                        kernel=dispatch.kernel_path("mla_decode", be),
                        options=dict(partitions=partitions, dcp=dcp, dcp_layout=dcp_layout, pad_heads=16),
                        shape=dict(B=B, T=T, H=H, C=C, capacity=cache.capacity, **_cache_kind(cache)),
                        notes="AITER mla_decode_fwd, heads padded to 16")
        return o, l
    if tri:
        from k3lab_kernels.triton.mla_decode import default_partitions

        n_max = n_positions or (int(lengths.max()) + T if check_values else cache.capacity)
        P = partitions or auto_opts.get("partitions") or default_partitions(
            B, n_max, T=T, H=H, pad_heads=pad_heads, dcp=dcp, block_n=block_n, block_m=block_m)
        K_shape = dcp * P
    else:
        P = partitions or 1
    if merge:
        if out is not None:
            _out("out", out, (B, T, H, C), (torch.float32,) if tri else None, dev)
        if lse is not None:
            _out("lse", lse, (B, T, H), (torch.float32,) if tri else None, dev)
    elif out is not None or lse is not None:
        _fail("out", "and 'lse' are for merged results; with merge=False the partials come back in a workspace")
    opts = dict(partitions=P, pad_heads=pad_heads, dcp=dcp, dcp_layout=dcp_layout, merge=merge)
    rec = dict(op="mla_decode", backend_requested=backend, backend=be, why=why,
               shape=dict(B=B, T=T, H=H, C=C, capacity=cache.capacity, **_cache_kind(cache)))
    if tri:
        from k3lab_kernels.triton.mla_decode import BLOCK_N_ALLOWED, PRELOAD_ALLOWED

        for name, v, allowed in (("block_n", block_n, BLOCK_N_ALLOWED), ("block_m", block_m, (16, 32, 64)),
                                 ("num_warps", num_warps, (1, 2, 4, 8, 16)),
                                 ("num_stages", num_stages, (1, 2, 3, 4, 5))):
            if v is not None and (isinstance(v, bool) or v not in allowed):
                _fail(name, f"must be None (the kernel's heuristic) or one of {allowed}, got {v!r}")
        if preload_pages is not None and (isinstance(preload_pages, bool) or preload_pages not in PRELOAD_ALLOWED):
            _fail("preload_pages", f"must be None (the kernel's rule) or one of {PRELOAD_ALLOWED}, "
                                   f"got {preload_pages!r}")
        fn = dispatch.kernel("mla_decode", be)
        if host_chunk is not None and not isinstance(host_chunk, bool):
            _fail("host_chunk", f"must be None (the kernel's default) or a bool, got {host_chunk!r}")
        from k3lab_kernels.triton.mla_decode import KSPLIT_ALLOWED, ksplit_takes

        if ksplit is not None and (isinstance(ksplit, bool) or ksplit not in KSPLIT_ALLOWED):
            _fail("ksplit", f"must be None (the kernel's default) or one of {KSPLIT_ALLOWED}, got {ksplit!r}")
        if ksplit == 4 and not ksplit_takes(C):
            _fail("ksplit", f"4 needs a latent width that is a power of two and a multiple of 64, got C={C}")
        knobs = dict(block_n=block_n, block_m=block_m, num_warps=num_warps, num_stages=num_stages,
                     pdl=_pdl(pdl), preload_pages=preload_pages, host_chunk=host_chunk, ksplit=ksplit, lazy=lazy,
                     fuse_merge=fuse_merge)
        q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
        q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
        plan: dict = {}
        res = fn(q_lat, q_rope, lengths=lengths, o_lat=out, lse=lse, scale=scale, partitions=P, pad_heads=pad_heads,
                 dcp=dcp, dcp_layout=dcp_layout, merge=merge, **_kv_args(cache), **knobs,
                 n_max=n_max if n_positions is not None or check_values else None, plan_out=plan)
        dispatch.record(ran, kernel=dispatch.kernel_path("mla_decode", be), options=dict(opts, **knobs), **rec,
                        notes=f"partials K={K_shape}" + ("" if partitions else " (automatic partitions)")
                        + "; ran " + ", ".join(f"{k} {v}" for k, v in plan.items()))
        return res
    kv = cache.read(compute_dtype(q_lat))
    n = n_positions if n_positions is not None else int(lengths.max()) + T
    f = ref.mla_attend if merge else ref.mla_attend_partials
    if be == "torch_compile":
        f = dispatch.compiled(f"mla.{f.__name__}", f)
        kernel = f"torch.compile({dispatch.kernel_path('mla_decode', be)})"
    else:
        kernel = dispatch.kernel_path("mla_decode", be)
    o, l = f(q_lat, q_rope, kv, lengths, scale=scale, partitions=P, dcp=dcp, dcp_layout=dcp_layout,
             pad_heads=pad_heads, n_positions=n)
    if out is not None:
        o = out.copy_(o)
    if lse is not None:
        l = lse.copy_(l)
    dispatch.record(ran, kernel=kernel, options=opts, **rec,
                    notes="" if partitions else "partitions=None: the reference runs one piece")
    return o, l


# ---- combine -------------------------------------------------------------------------------------

def combine(o_parts: torch.Tensor, lse_parts: torch.Tensor | None, w_uv: torch.Tensor, gate: torch.Tensor,
            out: torch.Tensor | None = None, *, backend: str = "reference", block_v: int | None = None,
            block_r: int | None = None, num_warps: int | None = None, pdl: bool | None = None,
            premerge: bool | None = None, ran: list | None = None) -> torch.Tensor:
    """Partials o [B,K,T,H,C] / lse [B,K,T,H] (or a merged o_lat [B,T,H,C] with lse None), Wuv [H,C,Dv],
    gate logits [B,T,H*Dv] -> out [B,T,H*Dv] = merge(o) @ Wuv[h] * sigmoid(gate) (bf16 from triton, the
    compute dtype from the reference; `out` filled when given). premerge (triton): the partials merged by the
    split's merge kernel first (None: the kernel's rule; k3lab_kernels.triton.mla_combine)."""
    _refuse_aiter(backend, "mla_combine")
    _tensor("o_parts", o_parts)
    dev = o_parts.device
    if o_parts.dim() == 4:
        if lse_parts is not None:
            _fail("lse_parts", "must be None when o_parts is an already merged o_lat [B,T,H,C]")
    elif o_parts.dim() != 5:
        _fail("o_parts", f"must be [B,K,T,H,C] partials or a merged [B,T,H,C], got {tuple(o_parts.shape)}")
    o5 = o_parts if o_parts.dim() == 5 else o_parts.unsqueeze(1)
    B, K, T, H, C = o5.shape
    if lse_parts is not None:
        _tensor("lse_parts", lse_parts, 4, None, dev)
        if tuple(lse_parts.shape) != (B, K, T, H):
            _fail("lse_parts", f"must have shape {(B, K, T, H)}, got {tuple(lse_parts.shape)}")
    _tensor("w_uv", w_uv, 3, None, dev)
    if w_uv.shape[:2] != (H, C):
        _fail("w_uv", f"must be [H={H}, C={C}, Dv], got {tuple(w_uv.shape)}")
    Dv = w_uv.shape[2]
    _tensor("gate", gate, 3, None, dev)
    if tuple(gate.shape) != (B, T, H * Dv):
        _fail("gate", f"must have shape {(B, T, H * Dv)}, got {tuple(gate.shape)}")
    # auto asks the rules with the partials merged (k) and passes over a kernel that cannot take the call; a named
    # backend keeps its own argument checks below (and builds no facts)
    facts = None
    if backend == "auto":
        dt = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
        facts = dict(k=K, C=C, Dv=Dv, parts_dtype=dt(o5), w_dtype=dt(w_uv), gate_dtype=dt(gate), block_v=block_v,
                     block_r=block_r, num_warps=num_warps, premerge=premerge)
    be, auto_opts, why = dispatch.select("mla_combine", backend, B=B, T=T, shape=facts)
    rec = dict(op="mla_combine", backend_requested=backend, backend=be, why=why, shape=dict(B=B, K=K, T=T, H=H, C=C,
                                                                                           Dv=Dv))
    if be == "cute":
        from k3lab_kernels.cute.mla_combine import BLOCK_R_ALLOWED as CUTE_BLOCK_R

        if (C, Dv) != (512, 128):
            _fail("w_uv", f"must be [H, 512, 128] for the cute backend (K3's C and Dv), got {tuple(w_uv.shape)}")
        _tensor("o_parts", o_parts, None, (torch.float32,))
        if lse_parts is not None:
            _tensor("lse_parts", lse_parts, None, (torch.float32,))
        _tensor("w_uv", w_uv, None, (torch.bfloat16,))
        _tensor("gate", gate, None, (torch.bfloat16,))
        from k3lab.ops.mla import COMBINE_TRITON_OPTIONS

        named = dict(block_v=block_v, num_warps=num_warps, premerge=premerge)
        given = [k for k in COMBINE_TRITON_OPTIONS if named[k] is not None]
        if given:
            _fail(given[0], "is a triton option; the cute kernel runs 32 columns and 4 warps a CTA and merges the "
                  "partials itself (its option: block_r)")
        if block_r is not None and (isinstance(block_r, bool) or block_r not in CUTE_BLOCK_R):
            _fail("block_r", f"must be None or one of {CUTE_BLOCK_R} on the cute backend, got {block_r!r}")
        if pdl is not None and not isinstance(pdl, bool):
            _fail("pdl", f"must be None or a bool, got {pdl!r}")
        if out is not None:
            _out("out", out, (B, T, H * Dv), (torch.bfloat16,), dev)
        c = lambda t: t if t is None or t.is_contiguous() else t.contiguous()  # noqa: E731
        y = dispatch.kernel("mla_combine", be)(c(o_parts), c(lse_parts), c(w_uv), c(gate), out, block_r=block_r,
                                               pdl=pdl)
        dispatch.record(ran, kernel=dispatch.kernel_path("mla_combine", be), options=dict(block_r=block_r, pdl=pdl),
                        **rec)
        return y
    if be == "triton":
        from k3lab_kernels.triton.mla_combine import BLOCK_R_ALLOWED, BLOCK_V_ALLOWED

        _tensor("o_parts", o_parts, None, (torch.float32,))
        if lse_parts is not None:
            _tensor("lse_parts", lse_parts, None, (torch.float32,))
        _tensor("w_uv", w_uv, None, (torch.bfloat16,))
        _tensor("gate", gate, None, (torch.bfloat16, torch.float16, torch.float32))
        if block_v is not None and (block_v not in BLOCK_V_ALLOWED or Dv % block_v):
            _fail("block_v", f"must be one of {BLOCK_V_ALLOWED} dividing Dv={Dv}, got {block_v!r}")
        if block_r is not None and (isinstance(block_r, bool) or block_r not in BLOCK_R_ALLOWED):
            _fail("block_r", f"must be None or one of {BLOCK_R_ALLOWED} (1 = the one-row kernel), got {block_r!r}")
        if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16)):
            _fail("num_warps", f"must be None or one of (1, 2, 4, 8, 16), got {num_warps!r}")
        if premerge is not None and not isinstance(premerge, bool):
            _fail("premerge", f"must be None or a bool, got {premerge!r}")
        if premerge is None:  # auto's rule may name it (data/mla_defaults.json: many partials merged first)
            premerge = auto_opts.get("premerge")
        if out is not None:
            _out("out", out, (B, T, H * Dv), (torch.bfloat16,), dev)
        c = lambda t: t if t is None or t.is_contiguous() else t.contiguous()  # noqa: E731
        y = dispatch.kernel("mla_combine", be)(c(o_parts), c(lse_parts), c(w_uv), c(gate), out, block_v=block_v,
                                               block_r=block_r, num_warps=num_warps, pdl=_pdl(pdl),
                                               premerge=premerge)
        dispatch.record(ran, kernel=dispatch.kernel_path("mla_combine", be),
                        options=dict(block_v=block_v, block_r=block_r, num_warps=num_warps, premerge=premerge), **rec)
        return y
    if out is not None:
        _out("out", out, (B, T, H * Dv), None, dev)
    lse5 = lse_parts if lse_parts is not None else torch.zeros(B, 1, T, H, dtype=o5.dtype, device=dev)
    fn = ref.mla_combine
    kernel = dispatch.kernel_path("mla_combine", be)
    if be == "torch_compile":
        fn, kernel = dispatch.compiled("mla.combine", ref.mla_combine), f"torch.compile({kernel})"
    y = fn(o5, lse5, w_uv, gate)
    if out is not None:
        y = out.copy_(y)
    dispatch.record(ran, kernel=kernel, options={}, **rec)
    return y


# ---- the absorbed query step ---------------------------------------------------------------------


def query(cq: torch.Tensor, q_norm: torch.Tensor, w_uq: torch.Tensor, w_uk: torch.Tensor,
          q_lat: torch.Tensor | None = None, q_rope: torch.Tensor | None = None, *, eps: float = 1e-6,
          backend: str = "reference", pdl: bool | None = None, ran: list | None = None) -> tuple:
    """The q down-projection's output cq [B, Q] -> (q_lat [B, H, C], q_rope [B, H, Dr]): rms(cq; q_norm) through Wuq
    [H (Dn + Dr), Q], the nope part absorbed through Wuk [H, Dn, C] (k3lab.ref.mla.mla_query); q_lat / q_rope filled
    when given (any strides with a unit inner one: views of the step's buffers). triton / cute: one launch
    (k3lab_kernels.{triton,cute}.mla_query, bf16, batch <= 4); pdl as the other kernels (None: the enclosing
    pdl_chain)."""
    _refuse_aiter(backend, "mla_query")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
        _fail("eps", f"must be a positive finite number, got {eps!r}")
    _tensor("cq", cq, 2)
    dev = cq.device
    B, Q = cq.shape
    _tensor("q_norm", q_norm, 1, None, dev)
    _tensor("w_uk", w_uk, 3, None, dev)
    H, Dn, C = w_uk.shape
    _tensor("w_uq", w_uq, 2, None, dev)
    if q_norm.shape[0] != Q:
        _fail("q_norm", f"must be [{Q}] (cq's width), got {tuple(q_norm.shape)}")
    if w_uq.shape[1] != Q or w_uq.shape[0] % H or w_uq.shape[0] // H <= Dn:
        _fail("w_uq", f"must be [{H} (Dn {Dn} + Dr), {Q}] with Dr > 0, got {tuple(w_uq.shape)}")
    Dr = w_uq.shape[0] // H - Dn
    for name, t, w in (("q_lat", q_lat, C), ("q_rope", q_rope, Dr)):
        if t is not None:
            _tensor(name, t, 3, None, dev)
            _floating(name, t)
            if tuple(t.shape) != (B, H, w):
                _fail(name, f"must be [{B}, {H}, {w}], got {tuple(t.shape)}")
    if pdl is not None and not isinstance(pdl, bool):
        _fail("pdl", f"must be None or a bool, got {pdl!r}")
    be, _, why = dispatch.select("mla_query", backend, B=B, T=1, shape=dict(B=B, H=H, Q=Q, Dn=Dn, Dr=Dr, C=C))
    rec = dict(op="mla_query", backend_requested=backend, backend=be, why=why,
               shape=dict(B=B, H=H, Q=Q, Dn=Dn, Dr=Dr, C=C))
    if be in ("triton", "cute"):
        lat = q_lat if q_lat is not None else torch.empty(B, H, C, dtype=cq.dtype, device=dev)
        rope = q_rope if q_rope is not None else torch.empty(B, H, Dr, dtype=cq.dtype, device=dev)
        dispatch.kernel("mla_query", be)(cq, q_norm, w_uq, w_uk, lat, rope, eps=float(eps), pdl=pdl)
        dispatch.record(ran, kernel=dispatch.kernel_path("mla_query", be), options=dict(pdl=pdl), **rec)
        return lat, rope
    if pdl:
        _fail("pdl", f"pdl=True (programmatic dependent launch) needs a kernel backend (triton or cute), not {be!r}")
    fn = ref.mla_query
    kernel = dispatch.kernel_path("mla_query", be)
    if be == "torch_compile":
        fn, kernel = dispatch.compiled("mla.query", ref.mla_query), f"torch.compile({kernel})"
    lat, rope = fn(cq, q_norm, w_uq, w_uk, float(eps))
    if q_lat is not None:
        lat = q_lat.copy_(lat)
    if q_rope is not None:
        rope = q_rope.copy_(rope)
    dispatch.record(ran, kernel=kernel, options={}, **rec)
    return lat, rope


# ---- cache write ---------------------------------------------------------------------------------

def write_cache(kv: torch.Tensor, kv_norm: torch.Tensor, cache, lengths, *, eps: float = 1e-6,
                backend: str = "reference", pdl: bool | None = None, check_values: bool = True,
                ran: list | None = None) -> None:
    """kv [B,T,C+Dr] (the kv down-projection's output) -> [rms(c; kv_norm) | k_rope] written in place
    at positions lengths[b] .. lengths[b]+T-1 of `cache` (fp8: quantized with the cache's scale scheme).
    pdl (triton and cute): programmatic dependent launch, the kernel loads lengths, the block table and
    kv_norm before it waits for the previous kernel (which must write none of them, nor a per-tensor scale);
    None: triton follows the enclosing pdl.pdl_chain, cute is off. The cute kernel
    (k3lab_kernels.cute.mla_cache_write) is K3's shape only (C = 512, Dr = 64)."""
    _refuse_aiter(backend, "mla_cache_write")
    _tensor("kv", kv, 3)
    dev = kv.device
    B, T, W = kv.shape
    _tensor("kv_norm", kv_norm, 1, None, dev)
    C = kv_norm.shape[0]
    if not 0 < C < W:
        _fail("kv_norm", f"must have C < C + Dr = {W} entries, got {C}")
    if pdl is not None and not isinstance(pdl, bool):
        _fail("pdl", f"must be None (off) or a bool, got {pdl!r}")
    be, _, why = dispatch.select("mla_cache_write", backend, B=B, T=T)
    if pdl and be not in ("triton", "cute"):
        _fail("pdl", f"pdl=True (programmatic dependent launch) needs a kernel backend (triton or cute), not {be!r}")
    kern = be in ("triton", "cute")  # a kernel (not the torch reference) writes the cache
    if kern:
        _tensor("kv", kv, 3, TRITON_ACT_DTYPES)
        _tensor("kv_norm", kv_norm, 1, TRITON_ACT_DTYPES)
    if be == "cute" and (C, W) != (512, 576):
        _fail("kv", f"must be [B, T, 576] with kv_norm [512] for the cute backend (K3's C = 512 + Dr = 64), got "
                    f"width {W}, C = {C}")
    _cache(cache, B, W, dev, kern, be)
    lengths = _lengths(lengths, B, T, cache, dev, check_values)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
        _fail("eps", f"must be a positive finite number, got {eps!r}")
    rec = dict(op="mla_cache_write", backend_requested=backend, backend=be, why=why,
               shape=dict(B=B, T=T, W=W, **_cache_kind(cache)))
    if kern:
        kw = _kv_args(cache)
        fn = dispatch.kernel("mla_cache_write", be)
        opts = {} if pdl is None else dict(pdl=pdl)
        if be == "cute":  # 8- / 16-byte vector loads: strides of 4 elements and an aligned base, else a copy
            es = kv.element_size()
            if kv.stride(-1) != 1 or kv.stride(0) % 4 or kv.stride(1) % 4 or kv.data_ptr() % (4 * es):
                kv = kv.contiguous()
            opts = dict(pdl=bool(pdl))
        elif kv.stride(-1) != 1:
            kv = kv.contiguous()
        fn(kv, kv_norm.contiguous(), kw["kv"], lengths, eps=float(eps), scale=kw["kv_scale"],
           block_table=kw["block_table"], **opts)
        dispatch.record(ran, kernel=dispatch.kernel_path("mla_cache_write", be), options=opts, **rec)
        return
    kernel = dispatch.kernel_path("mla_cache_write", be)
    entry = ref.mla_cache_entry
    if be == "torch_compile":  # the entry's maths compiled; the scatter into the cache stays eager
        entry, kernel = dispatch.compiled("mla.cache_entry", ref.mla_cache_entry), f"torch.compile({kernel})"
    cache.write(lengths, entry(kv, kv_norm, float(eps)))
    dispatch.record(ran, kernel=kernel, options={}, **rec)


# ---- the layer's attention -----------------------------------------------------------------------

def _check_layer(h, weights, cache, T_axis: bool):
    if not isinstance(weights, MLAWeights):
        raise MLAArgumentError(f"{COMPONENT}: 'weights' must be k3lab.ref.mla.MLAWeights, got "
                               f"{type(weights).__name__}")
    D = weights.w_dq.shape[1]
    want = "[B, T, D]" if T_axis else "[B, D]"
    if not isinstance(h, torch.Tensor) or h.dim() != (3 if T_axis else 2) or h.shape[-1] != D:
        raise MLAArgumentError(f"{COMPONENT}: 'h' must be {want} with D={D}, got {tuple(getattr(h, 'shape', ()))}")
    _cache(cache, h.shape[0], weights.entry_width, h.device, False)


def verify(h: torch.Tensor, weights: MLAWeights, cache, lengths, out: torch.Tensor | None = None, *,
           backend: str = "reference", partitions: int | None = 1, pad_heads: int = 0, dcp: int = 1,
           dcp_layout: str = "interleave", ran: list | None = None) -> torch.Tensor:
    """T positions per sequence (module docstring). The projections are torch matmuls (cuBLAS on a GPU);
    triton runs the cache write, the split attention and the combine (merge + Wuv + gate) as kernels, cute the
    same three on its kernels (the decode merging its own pieces) where its decode takes the shape."""
    _refuse_aiter(backend, "the MLA layer")
    _check_layer(h, weights, cache, True)
    B, T, _ = h.shape
    lengths = _lengths(lengths, B, T, cache, h.device, True)
    _attend_opts(weights.heads, partitions, pad_heads, dcp, dcp_layout)
    from k3lab.ops import mla as mla_ops  # the registry entry's names (imported here: it imports this module's users)

    be, _, _ = dispatch.select("mla_decode", backend, B=B, T=T,
                               shape=mla_ops.decode_shape(B, T, weights.heads, weights.kv_lora, weights.rope_dim, cache,
                                                          dcp, pad_heads))
    q_nope, q_rope = ref.mla_q(h, weights)
    q_lat = ref.absorb_q(q_nope, weights)
    kw = dict(partitions=partitions, pad_heads=pad_heads, dcp=dcp, dcp_layout=dcp_layout, ran=ran)
    if be in ("triton", "cute"):  # the cache write, the decode and the combine (Wuv + gate) on that backend's kernels
        ckv = linear(h, weights.w_dkv)
        gate = linear(h, weights.w_gate)  # before the attention: the combine follows the split directly (PDL)
        write_cache(ckv, weights.kv_norm, cache, lengths, eps=float(weights.eps), backend=be, ran=ran)
        if be == "triton":  # the partials go to the combine, which merges them
            o_p, l_p = attend(q_lat, q_rope, cache, lengths, scale=weights.scale, backend=be, merge=False, **kw)
        else:  # the CuTe decode merges its pieces itself (its cluster in DSMEM, then the merge kernel)
            o_p, l_p = attend(q_lat, q_rope, cache, lengths, scale=weights.scale, backend=be, **kw)[0], None
        y = combine(o_p, l_p, weights.w_uv, gate, backend=be, ran=ran)
        y = linear(y.to(h.dtype), weights.w_o)
    else:
        # projections and the cache write stay eager (the write is in place); the attention core and
        # output path go through the backend
        cache.write(lengths, ref.mla_kv_entry(h, weights))
        o_lat, _ = attend(q_lat, q_rope, cache, lengths, scale=weights.scale, backend=be, **kw)
        fn = ref.mla_out if be == "reference" else dispatch.compiled("mla.out", ref.mla_out)
        y = fn(o_lat, h, weights)
    return dispatch.write_out(COMPONENT, y, out)


def decode(h: torch.Tensor, weights: MLAWeights, cache, lengths, out: torch.Tensor | None = None, *,
           backend: str = "reference", partitions: int | None = 1, pad_heads: int = 0, dcp: int = 1,
           dcp_layout: str = "interleave", ran: list | None = None) -> torch.Tensor:
    """One position per sequence: h [B, D] -> out [B, D] (module docstring)."""
    _refuse_aiter(backend, "the MLA layer")
    _check_layer(h, weights, cache, False)
    y = verify(h.unsqueeze(1), weights, cache, lengths, None, backend=backend, partitions=partitions,
               pad_heads=pad_heads, dcp=dcp, dcp_layout=dcp_layout, ran=ran).squeeze(1)
    return dispatch.write_out(COMPONENT, y, out)
