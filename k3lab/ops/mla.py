"""Gated MLA in the registry: decode attention (split-KV + merge), the combine (merge + Wuv + gate), the
cache write (kv_norm + in-place write) and the absorbed query step (q_norm + Wuq + Wuk). The maths is
k3lab.ref.mla; the API k3lab.components.mla; the kernels are named in each entry's backends table.

Axes (the default grid is small so the CPU interpreter runs it in seconds; the GPU bench passes its own):
    heads        query heads on one GPU: 12 (TP8), 6 (TP16), 16
    batch        sequences, 1..64
    context      positions already cached before the step (lengths), 1..128K (1M at batch 1, fp8)
    T            new positions per sequence (draft depth + 1), 1..8, causal among themselves
    page_size    0 = contiguous cache [B, S_max, 576]; 1, 16, 64 = PagedMLACache pages
    kv_dtype     "bf16" or "fp8" (e4m3), with fp8_scale "tensor" (one scale) or "token" (one per position)
    ragged       False: every sequence at `context`; True: lengths spread evenly from `context` down to 1
    partitions   split-KV pieces 1..512, or "auto" (k3lab_kernels.triton.mla_decode.default_partitions)
    pad_heads    0 or 16 (the query heads run as a 16-row tile)
    dcp, dcp_layout   DCP-N emulated on one GPU (1..16; "interleave" or "contiguous")
The cache's unused rows (past each sequence's visible positions, spare pages) hold NaN: a kernel that
reads a row it must not see fails the check.

Peers (`k3lab bench mla` with peers on): FlashInfer's batch MLA decode fa3 / fa2 (k3lab.bench.peers_mla)
where it applies (GPU with its JIT, T = 1, bf16 cache, no DCP), on the same inputs and fp64 check.

Bytes (the one formula, `decode_bytes` / `combine_bytes` / `write_bytes`):
    decode   cache rows read once per sequence: sum_b (lengths[b] + T) * 576 * e (e = 2 bf16, 1 fp8; + 4 a
             row for per-token scales; + 4 a page for the block table) + queries B*T*H*576*2 + outputs
             B*T*H*(512 + 1)*4 (fp32 o_lat and lse) + lengths. Floor at the read bandwidth.
             batch 1, 12 heads, bf16: 32K context = 37.7 MB = 8.2 us at 4.6 TB/s.
    combine  partials B*K*T*H*(512 + 1)*4 + Wuv H*512*128*2 + gate and out B*T*H*128*2 each (read floor).
    write    kv in B*T*576*2 + kv_norm 512*2 + rows written B*T*576*e (+ 4 a row per-token) + lengths
             (copy floor: as many bytes written as read).
    query    Wuq H*(Dn+Dr)*Q*2 + Wuk H*Dn*C*2 + q_norm Q*2 + cq B*Q*2 + q_lat / q_rope B*H*(C+Dr)*2 (read floor):
             6.3 MB at TP8 (12 heads, Q 1536), 1.4 us at 4.6 TB/s.

Tolerances (relative norm against fp64; every input is exactly representable, fp8: the reference
attends over the dequantized cache e4m3 * scale, so quantization is no error of the kernel):
    o_lat  5e-3: scores and softmax sums are fp32 (bf16 x bf16 products are exact in fp32), but the
           softmax weights P are rounded to bf16 (2^-9 relative each) for the tensor-core P.C product;
           ~1e-3 measured. lse 1e-5: fp32 sums over <= 128K terms, nothing rounded to bf16 (~1e-7).
    combine out 1e-2: o rounded to bf16 for the tensor-core product with the bf16 Wuv, the result rounded
           to bf16 (2^-9 each, <= 4e-3 together); ~2.5e-3 measured.
    query  q_lat / q_rope 5e-3: exact inputs, fp32 sums; the fused kernels round only the outputs to bf16 (2^-9
           relative each, ~1.2e-3 as a norm); the unfused reference backend also rounds rms(cq) and q_nope.
    cache write: the reference is the fp64 entry rounded once to the cache format (nearest-even, as the
           kernel does), so only a flip at a rounding boundary between fp32 and fp64 statistics can
           differ: bf16 1e-3, fp8 codes 1e-2 (one e4m3 step is 2^-3 relative); per-token scales 1e-6
           (fp32 amax / 448).
"""
from __future__ import annotations

import torch

from k3lab.ref import mla as ref
from k3lab.registry import Case, Op, Peer, register
from k3lab.registry import generator as _gen

C, DR, DV = 512, 64, 128
W = C + DR
SCALE = (128 + 64) ** -0.5
TENSOR_SCALE = 1.0 / 16  # the fp8 per-tensor scale the inputs use (not 1, so the scale path is exercised)
TOL = dict(o_lat=5e-3, lse=1e-5, out=1e-2, kv_cache_bf16=1e-3, kv_cache_fp8=1e-2, token_scale=1e-6, q=5e-3)
WHY = ("o_lat 5e-3: fp32 scores and sums, the softmax weights rounded to bf16 for the P.C product; lse 1e-5: fp32 "
       "sums; combine 1e-2: o and the output rounded to bf16; cache write: one rounding like the fp64 reference, "
       "bf16 1e-3, fp8 codes 1e-2 (boundary flips only), scales 1e-6; query 5e-3: fp32 sums, outputs rounded to bf16")


def _kv_bytes(case: Case) -> int:
    return 1 if case.get("kv_dtype", "bf16") == "fp8" else 2


def lengths_of(case: Case) -> list[int]:
    """The cached lengths of a case, deterministic (so the byte formula is exact): `context` for every
    sequence, or (ragged) spread evenly from `context` down to 1."""
    B, n = case["batch"], case["context"]
    if not case.get("ragged", False) or B == 1:
        return [n] * B
    return [n - (b * (n - 1)) // (B - 1) for b in range(B)]


def _token(case: Case) -> bool:
    return case.get("kv_dtype", "bf16") == "fp8" and case.get("fp8_scale", "tensor") == "token"


def decode_bytes(case: Case) -> int:
    """Bytes the decode attention must move (module docstring)."""
    B, T, H = case["batch"], case["T"], case["heads"]
    rows = sum(n + T for n in lengths_of(case))
    ps = case.get("page_size", 0)
    cache = rows * (W * _kv_bytes(case) + (4 if _token(case) else 0))
    table = sum(-(-(n + T) // ps) for n in lengths_of(case)) * 4 if ps else 0
    return cache + table + B * T * H * W * 2 + B * T * H * (C + 1) * 4 + B * 4


def decode_flops(case: Case) -> int:
    T, H = case["T"], case["heads"]
    return sum(2 * T * H * (n + T) * (W + C) for n in lengths_of(case))


def _K(case: Case) -> int:
    return case["partitions"] * case.get("dcp", 1)


def combine_bytes(case: Case) -> int:
    B, T, H = case["batch"], case["T"], case["heads"]
    return B * _K(case) * T * H * (C + 1) * 4 + H * C * DV * 2 + 2 * B * T * H * DV * 2


def combine_flops(case: Case) -> int:
    B, T, H = case["batch"], case["T"], case["heads"]
    return 2 * B * T * H * C * DV + 2 * B * _K(case) * T * H * C


def _qdims(case: Case) -> tuple[int, int, int, int, int]:
    return case["heads"], case.get("q_rank", 1536), case.get("nope", 128), case.get("rope", DR), case.get("latent", C)


def query_bytes(case: Case) -> int:
    H, Q, Dn, Dr, Cl = _qdims(case)
    B = case["batch"]
    return (H * (Dn + Dr) * Q + H * Dn * Cl + Q + B * Q + B * H * (Cl + Dr)) * 2


def query_flops(case: Case) -> int:
    H, Q, Dn, Dr, Cl = _qdims(case)
    return 2 * case["batch"] * (H * (Dn + Dr) * Q + H * Dn * Cl)


def write_bytes(case: Case) -> int:
    B, T = case["batch"], case["T"]
    rows = B * T * (W * _kv_bytes(case) + (4 if _token(case) else 0))
    return B * T * W * 2 + C * 2 + rows + B * 4 + (B * T * 4 if case.get("page_size", 0) else 0)


def write_flops(case: Case) -> int:
    return 4 * case["batch"] * case["T"] * W


# ---- inputs ---------------------------------------------------------------------------------------



def _nan(dtype: torch.dtype, shape, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device=device).to(dtype)


def _cache(case: Case, B: int, capacity: int, seed: int, device: str, filled: list[int] | None):
    """A cache of the case's kind (contiguous or paged; bf16 or fp8) with positions < filled[b] holding
    random entries (c with unit RMS, k_rope standard normal) and every other row (and per-token scale) NaN.
    Drawn on `device` (a GPU bench builds 100s of MB of caches)."""
    fp8 = case.get("kv_dtype", "bf16") == "fp8"
    mode = case.get("fp8_scale", "tensor")
    c = ref.MLACache.empty(B, capacity, W, device=device, kv_dtype="fp8" if fp8 else None, fp8_scale=mode,
                           tensor_scale=TENSOR_SCALE)
    if filled is not None:
        g = _gen(seed + 1, device)
        for a in range(0, capacity, 4096):  # in chunks: no fp32 copy of the whole cache
            n = min(4096, capacity - a)
            c.write(torch.full((B,), a, dtype=torch.long, device=device),
                    torch.randn(B, n, W, generator=g, device=device))
        for b, n in enumerate(filled):
            c.data[b, n:] = _nan(c.data.dtype, (capacity - n, W), device)
            if c.scale_mode == "token":
                c.scale[b, n:] = float("nan")
    else:
        c.data.copy_(_nan(c.data.dtype, c.data.shape, device))
        if c.scale_mode == "token":
            c.scale.fill_(float("nan"))
    ps = case.get("page_size", 0)
    if ps:
        c = ref.PagedMLACache.from_contiguous(c, ps, spare_pages=2, seed=seed + 2, fill=float("nan"))
        if c.scale_mode == "token":  # pages' slots past the capacity and spare pages
            idx = c.block_table.long()
            keep = torch.zeros(c.pool.shape[:2], dtype=torch.bool, device=device)
            keep[idx] = torch.arange(idx.shape[1] * ps, device=device).view(1, -1, ps) < capacity
            c.scale[~keep] = float("nan")
        d = dict(kv_cache=c.pool, block_table=c.block_table)
    else:
        d = dict(kv_cache=c.data)
    if fp8:
        d["kv_scale"] = c.scale
    return d


def _lengths_t(case: Case, device: str) -> torch.Tensor:
    return torch.tensor(lengths_of(case), dtype=torch.int32, device=device)


def make_decode(case: Case, seed: int, device: str) -> dict:
    B, T, H = case["batch"], case["T"], case["heads"]
    g = _gen(seed, device)
    lens = lengths_of(case)
    d = dict(q_lat=torch.randn(B, T, H, C, generator=g, device=device).to(torch.bfloat16),
             q_rope=torch.randn(B, T, H, DR, generator=g, device=device).to(torch.bfloat16),
             lengths=_lengths_t(case, device))
    d.update(_cache(case, B, max(lens) + T, seed, device, [n + T for n in lens]))
    if d["kv_cache"].dtype == torch.float8_e4m3fn:  # read-only fp8 travels as its bytes (the checker's
        d["kv_cache"] = d["kv_cache"].view(torch.uint8)  # unchanged-input test has no fp8 path)
    d["o_lat"] = torch.empty(B, T, H, C, dtype=torch.float32, device=device)
    d["lse"] = torch.empty(B, T, H, dtype=torch.float32, device=device)
    return d


def make_combine(case: Case, seed: int, device: str) -> dict:
    B, T, H, K = case["batch"], case["T"], case["heads"], _K(case)
    g = _gen(seed)
    o = torch.randn(B, K, T, H, C, generator=g) * 0.3
    lse = torch.randn(B, K, T, H, generator=g) * 2 + 5
    if K > 1:  # empty partials (a short history's pieces, a shard past the history) in every other sequence
        o[::2, K - 1] = 0.0
        lse[::2, K - 1] = float("-inf")
    return dict(o_parts=o.to(device), lse_parts=lse.to(device),
                w_uv=(torch.randn(H, C, DV, generator=g) * C ** -0.5).to(device, torch.bfloat16),
                gate=torch.randn(B, T, H * DV, generator=g).to(device, torch.bfloat16),
                out=torch.empty(B, T, H * DV, dtype=torch.bfloat16, device=device))


def make_write(case: Case, seed: int, device: str) -> dict:
    B, T = case["batch"], case["T"]
    g = _gen(seed)
    lens = lengths_of(case)
    d = dict(kv=(torch.randn(B, T, W, generator=g) * 2).to(device, torch.bfloat16),
             kv_norm=(1 + 0.1 * torch.randn(C, generator=g)).to(device, torch.bfloat16),
             lengths=_lengths_t(case, device))
    d.update(_cache(case, B, max(lens) + T, seed, device, None))
    # the per-token scales are written; a per-tensor scale is read-only ("kv_scale")
    d["token_scale"] = d.pop("kv_scale") if _token(case) else torch.empty(0, dtype=torch.float32, device=device)
    return d


def make_query(case: Case, seed: int, device: str) -> dict:
    H, Q, Dn, Dr, Cl = _qdims(case)
    B = case["batch"]
    g = _gen(seed)
    bf = torch.bfloat16
    return dict(cq=(torch.randn(B, Q, generator=g) * 2).to(device, bf),
                q_norm=(1 + 0.1 * torch.randn(Q, generator=g)).to(device, bf),
                w_uq=(torch.randn(H * (Dn + Dr), Q, generator=g) / Q ** 0.5).to(device, bf),
                w_uk=(torch.randn(H, Dn, Cl, generator=g) / Dn ** 0.5).to(device, bf),
                q_lat=torch.empty(B, H, Cl, dtype=bf, device=device),
                q_rope=torch.empty(B, H, Dr, dtype=bf, device=device))


def ref_query(d: dict, case: Case) -> dict:
    f64 = torch.float64
    lat, rope = ref.mla_query(d["cq"].to(f64), d["q_norm"].to(f64), d["w_uq"].to(f64), d["w_uk"].to(f64), 1e-6)
    return dict(q_lat=lat, q_rope=rope)


def kv_name(dtype) -> str:
    """A cache dtype as the cases name it ("bf16", "fp8"; anything else its torch name)."""
    return {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}.get(dtype, str(dtype).replace("torch.", ""))


def decode_shape(B: int, T: int, H: int, C_: int, Dr: int, cache, dcp: int = 1, pad_heads: int = 0) -> dict:
    """A decode call's facts as `decode_supports` (and the dispatcher's shape-aware `auto`) read them."""
    return dict(B=B, T=T, H=H, C=C_, Dr=Dr, dcp=dcp, kv_dtype=kv_name(getattr(cache, "dtype", None)),
                pad_heads=pad_heads)


def decode_supports(backend: str, shape: dict) -> str | None:
    """The CuTe decode's limits (k3lab_kernels.cute.mla_decode.supports: T = 1, at most 16 heads, C = 512, Dr = 64, a
    bf16 cache, no DCP) for a case's axes or a call's `decode_shape`; None for the other backends."""
    if backend != "cute":
        return None
    from k3lab_kernels.cute.mla_decode import supports

    return supports(shape)


def combine_facts(case: Case) -> dict:
    """The combine's facts for data/mla_defaults.json's rules: k, the partials it merges (pieces x DCP shards)."""
    return {"k": _K(case)}


COMBINE_TRITON_OPTIONS = ("block_v", "num_warps", "premerge")  # the Triton combine's options the cute one has not


def combine_supports(backend: str, shape: dict) -> str | None:
    """What the cute combine cannot take (the component's checks, so that `auto` passes it over instead of failing
    the call): K3's C = 512 and Dv = 128, fp32 partials, bf16 W_uv and gate, none of the Triton kernel's options
    (block_v, num_warps, premerge) and block_r one of its own. Facts the shape does not state are K3's and the
    defaults."""
    if backend != "cute":
        return None
    from k3lab_kernels.cute.mla_combine import BLOCK_R_ALLOWED

    if (shape.get("C", C), shape.get("Dv", DV)) != (C, DV):
        return f"C {shape.get('C')} / Dv {shape.get('Dv')}: the cute combine takes K3's {C} / {DV}"
    for name, want in (("parts_dtype", "float32"), ("w_dtype", "bfloat16"), ("gate_dtype", "bfloat16")):
        if shape.get(name, want) != want:
            return f"{name} {shape[name]}: the cute combine takes {want}"
    given = [k for k in COMBINE_TRITON_OPTIONS if shape.get(k) is not None]
    if given:
        return f"{given} given: Triton options"
    if shape.get("block_r") is not None and shape["block_r"] not in BLOCK_R_ALLOWED:
        return f"block_r {shape['block_r']} not in the cute combine's {BLOCK_R_ALLOWED}"
    return None


def query_supports(backend: str, shape: dict) -> str | None:
    """The one-launch kernels' limits (k3lab_kernels.triton.mla_query.check_args): batch <= 4, Dn and Dr multiples
    of 8, C a power of two 32..512; cute: Dn one of 16..128 (a cluster of Dn / 16 CTAs), Dr a multiple of 16."""
    if backend not in ("triton", "cute"):
        return None
    from k3lab_kernels.triton.mla_query import C_ALLOWED, MAX_BATCH, ROWS

    if backend == "cute":
        from k3lab_kernels.cute.mla_query import DN_ALLOWED

        Dn, Dr = shape.get("Dn", shape.get("nope", 128)), shape.get("Dr", shape.get("rope", DR))
        if Dn not in DN_ALLOWED:
            return f"Dn {Dn} not in {DN_ALLOWED} (cute: one cluster of Dn / 16 CTAs a head)"
        if Dr % 16:
            return f"Dr {Dr} not a multiple of 16 (cute: 16-row CTAs)"

    B, Dn, Dr, Cl = shape.get("B", shape.get("batch", 1)), shape.get("Dn", shape.get("nope", 128)), \
        shape.get("Dr", shape.get("rope", DR)), shape.get("C", shape.get("latent", C))
    if B > MAX_BATCH:
        return f"batch {B} > {MAX_BATCH} (one launch a few tokens)"
    if Dn % ROWS or Dr % ROWS:
        return f"Dn {Dn} and Dr {Dr} must be multiples of {ROWS}"
    if Cl not in C_ALLOWED:
        return f"C {Cl} not in {C_ALLOWED}"
    return None


def _bmm_into(q_nope: torch.Tensor, w_uk: torch.Tensor, q_lat: torch.Tensor, tmp: torch.Tensor) -> None:
    """q_lat [B, H, C] = q_nope [B, H, Dn] @ Wuk per head by torch.bmm: straight into q_lat at batch 1 (its [H, 1, C]
    view is contiguous), else through tmp [H, B, C] and a copy."""
    if q_lat.shape[0] == 1 and q_lat.is_contiguous():
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_lat.transpose(0, 1))
    else:
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=tmp)
        q_lat.copy_(tmp.transpose(0, 1))


def query_peers(case: Case) -> list[Peer]:
    """What the one launch replaces, on the same inputs and fp64 check (GPU only): `unfused`, the decode step's
    composition before it (our rms_norm kernel, Wuq on our GEMV: the CuTe one where CuTe DSL runs, else Triton's,
    then the absorption as a cuBLAS batched matmul: three launches), and `cublas` (torch: the norm's ops, F.linear,
    torch.bmm)."""
    if not torch.cuda.is_available():
        return []

    def split(d: dict):
        H, Dn = d["w_uk"].shape[:2]
        B = d["cq"].shape[0]
        qf = torch.empty(B, d["w_uq"].shape[0], dtype=torch.bfloat16, device=d["cq"].device)
        lat_t = torch.empty(H, B, d["w_uk"].shape[2], dtype=torch.bfloat16, device=d["cq"].device)
        return H, Dn, qf, lat_t

    def unfused(d: dict):
        from k3lab.components import glue, trunk
        from k3lab.switches import backend_status

        H, Dn, qf, lat_t = split(d)
        cqn = torch.empty_like(d["cq"])
        be = "cute" if backend_status("cute")[0] else "triton"

        def run():
            glue.rms_norm(d["cq"], d["q_norm"], cqn, eps=1e-6, backend="triton")
            trunk.proj(cqn, d["w_uq"], qf, backend=be)
            q3 = qf.view(qf.shape[0], H, -1)
            _bmm_into(q3[..., :Dn], d["w_uk"], d["q_lat"], lat_t)
            d["q_rope"].copy_(q3[..., Dn:])  # (not in the step, which reads q3's rope part in place)
        return run

    def cublas(d: dict):
        import torch.nn.functional as F

        H, Dn, qf, lat_t = split(d)

        def run():
            x = d["cq"].float()
            xn = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * d["q_norm"].float()).to(torch.bfloat16)
            q3 = F.linear(xn, d["w_uq"]).view(xn.shape[0], H, -1)
            _bmm_into(q3[..., :Dn], d["w_uk"], d["q_lat"], lat_t)
            d["q_rope"].copy_(q3[..., Dn:])
        return run

    def checker_of(make, name):
        def check(c: Case, s: dict):
            from k3lab.harness import checker

            return checker.check(c_op(c), c, impl=lambda inp: make(inp)(), impl_name=name, inputs=s)
        return check

    return [Peer("unfused", unfused, checker_of(unfused, "unfused"),
                 note="rms_norm kernel, Wuq on our GEMV, cuBLAS bmm for Wuk (into q_lat at batch 1), and a copy of "
                      "q_rope (the step reads it in place): four launches, three in the step"),
            Peer("cublas", cublas, checker_of(cublas, "cublas"), note="torch: the norm's ops, F.linear, torch.bmm")]


def _cache_of(d: dict, scale_key: str = "kv_scale"):
    """The cache object over the input dict's tensors (views: a write goes into d["kv_cache"])."""
    scale = d.get(scale_key)
    if scale is not None and scale.numel() == 0:
        scale = d.get("kv_scale")
    data = d["kv_cache"]
    if data.dtype == torch.uint8:
        data = data.view(torch.float8_e4m3fn)
    if "block_table" in d:
        return ref.PagedMLACache(data, d["block_table"], scale)
    return ref.MLACache(data, scale)


# ---- fp64 references --------------------------------------------------------------------------------

def ref_decode(d: dict, case: Case) -> dict:
    f64 = torch.float64
    kv = _cache_of(d).read(f64)
    o, lse = ref.mla_attend(d["q_lat"].to(f64), d["q_rope"].to(f64), kv, d["lengths"].long(), scale=SCALE)
    return dict(o_lat=o, lse=lse)


def ref_combine(d: dict, case: Case) -> dict:
    f64 = torch.float64
    return dict(out=ref.mla_combine(d["o_parts"].to(f64), d["lse_parts"].to(f64), d["w_uv"].to(f64),
                                    d["gate"].to(f64)))


def ref_write(d: dict, case: Case) -> dict:
    """The cache after the write: NaN (untouched) everywhere but the written rows, which hold the fp64
    entry rounded once to the cache format (fp8: the raw e4m3 codes; per-token scales beside)."""
    cache = _cache_of(d, "token_scale")
    cache.pool.fill_(float("nan")) if isinstance(cache, ref.PagedMLACache) else cache.data.fill_(float("nan"))
    if cache.scale_mode == "token":
        cache.scale.fill_(float("nan"))
    f64 = torch.float64
    cache.write(d["lengths"].long(), ref.mla_cache_entry(d["kv"].to(f64), d["kv_norm"].to(f64)))
    out = dict(kv_cache=d["kv_cache"].to(f64))
    if cache.scale_mode == "token":
        out["token_scale"] = d["token_scale"].to(f64)
    return out


def tolerances(case: Case) -> dict[str, float]:
    fp8 = case.get("kv_dtype", "bf16") == "fp8"
    return dict(o_lat=TOL["o_lat"], lse=TOL["lse"], out=TOL["out"], token_scale=TOL["token_scale"],
                kv_cache=TOL["kv_cache_fp8"] if fp8 else TOL["kv_cache_bf16"], q_lat=TOL["q"], q_rope=TOL["q"])


# ---- calls through the component API ----------------------------------------------------------------

def _partitions(case: Case):
    p = case.get("partitions", "auto")
    return None if p == "auto" else p


def call_decode(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import mla

    return mla.attend(d["q_lat"], d["q_rope"], _cache_of(d), d["lengths"], scale=SCALE, backend=backend,
                      partitions=_partitions(case), pad_heads=case.get("pad_heads", 0), dcp=case.get("dcp", 1),
                      dcp_layout=case.get("dcp_layout", "interleave"), out=d["o_lat"], lse=d["lse"],
                      n_positions=max(lengths_of(case)) + case["T"], check_values=False, ran=ran, **opts)


def call_combine(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import mla

    return mla.combine(d["o_parts"], d["lse_parts"], d["w_uv"], d["gate"], d["out"], backend=backend, ran=ran,
                       **opts)


def call_query(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import mla

    return mla.query(d["cq"], d["q_norm"], d["w_uq"], d["w_uk"], d["q_lat"], d["q_rope"], eps=1e-6, backend=backend,
                     ran=ran, **opts)


def call_write(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import mla

    return mla.write_cache(d["kv"], d["kv_norm"], _cache_of(d, "token_scale"), d["lengths"], eps=1e-6,
                           backend=backend, check_values=False, ran=ran, **opts)


# ---- peers ------------------------------------------------------------------------------------------------

def flashinfer_peers(case: Case) -> list[Peer]:
    """FlashInfer's batch MLA paged decode (fa3, fa2: k3lab.bench.peers_mla) on the same inputs, where it
    applies: a GPU with FlashInfer's JIT, T = 1, bf16 cache, no DCP. Its plan (and, for a contiguous cache,
    the in-place view as one page per sequence) is made outside the timed region; one 128 MiB workspace
    is shared by the input sets. Checked against the same fp64 reference (its o_lat is bf16). Never raises:
    a peer that cannot be built is left out."""
    try:
        if (not torch.cuda.is_available() or case["T"] != 1 or case.get("kv_dtype", "bf16") != "bf16"
                or case.get("dcp", 1) != 1):
            return []
        from k3lab.bench import peers_mla as pm

        names = [be for be in pm.BACKENDS if pm.flashinfer_mla_available(be)[0]]
    except Exception:  # noqa: BLE001 - no peer rather than no bench
        return []
    pad = case.get("pad_heads", 0) or None
    out = []
    for be in names:
        ws: dict = {}

        def build(d: dict, be=be, ws=ws):
            if "w" not in ws:
                ws["w"] = torch.empty(128 << 20, dtype=torch.uint8, device=d["q_lat"].device)
            q, qr, n = d["q_lat"][:, 0], d["q_rope"][:, 0], d["lengths"] + 1  # FlashInfer counts the new one
            kw = dict(backend=be, pad_heads=pad, workspace=ws["w"])
            if "block_table" in d:
                return pm.FlashInferMLADecode(q, qr, d["kv_cache"], None, d["block_table"], n, SCALE, **kw)
            return pm.FlashInferMLADecode.from_contiguous_cache(q, qr, d["kv_cache"], n, SCALE, page_size=None, **kw)

        def check(c: Case, s, build=build, be=be):
            from k3lab.harness import checker

            def impl(inp: dict) -> None:
                fi = build(inp)
                fi()
                o, lse = fi.result()
                inp["o_lat"][:, 0].copy_(o)
                inp["lse"][:, 0].copy_(lse)
            return checker.check(c_op(c), c, impl=impl, impl_name=f"flashinfer_{be}", inputs=s)

        out.append(Peer(f"flashinfer_{be}", build, check,
                        note=f"FlashInfer 0.7.2 batch MLA decode {be} (JIT), one launch with its own split merge"))
    return out


def c_op(case: Case) -> Op:
    from k3lab import registry

    return registry.get(case.op)


# ---- the entries --------------------------------------------------------------------------------------

def _valid_cache(c: Case) -> bool:
    return (c.get("kv_dtype", "bf16") in ("bf16", "fp8") and c.get("fp8_scale", "tensor") in ("tensor", "token")
            and (c.get("kv_dtype", "bf16") == "fp8" or c.get("fp8_scale", "tensor") == "tensor")
            and c.get("page_size", 0) in (0, 1, 16, 64) and c["T"] >= 1 and c["batch"] >= 1)


def _valid_decode(c: Case) -> bool:
    pad, p = c["pad_heads"], c["partitions"]
    return (_valid_cache(c) and c["context"] >= 1 and (pad == 0 or pad >= c["heads"])
            and (p == "auto" or (isinstance(p, int) and 1 <= p <= 512))
            and (c["dcp"] > 1 or c["dcp_layout"] == "interleave"))


_CACHE_AXES = dict(page_size=(64,), kv_dtype=("bf16",), fp8_scale=("tensor",))
_NONE = (None,)

register(Op(
    name="mla_decode", component="mla", policy_key="decode", axis_kinds={"partitions": ("int",)},
    doc="absorbed MLA attention over the latent cache: split-KV partials of all heads per piece, merged by lse",
    axes=dict(heads=(12,), batch=(1, 4), context=(256,), T=(1,), **_CACHE_AXES, ragged=(False,),
              partitions=("auto",), pad_heads=(0,), dcp=(1,), dcp_layout=("interleave",)),
    option_axes={"block_n": {"triton": (None, 16, 32, 64, 128)}, "block_m": {"triton": (None, 16, 32, 64)},
                 "num_warps": {"triton": (None, 2, 4, 8)}, "num_stages": {"triton": (None, 1, 2, 3, 4)},
                 "pdl": {"triton": (None, False, True), "cute": (None, False, True)},
                 "preload_pages": {"triton": (None, 0, 16, 64)},
                 "host_chunk": {"triton": (None, False, True)}, "ksplit": {"triton": (None, 1, 4)},
                 "lazy": {"triton": (None, False, True)}, "fuse_merge": {"triton": (None, False, True)},
                 "cluster": {"cute": (None, 1, 2, 4, 8)},
                 "stages": {"cute": (None, 2, 3, 4)}, "pipe": {"cute": (None, False, True)}},
    option_defaults={"block_n": _NONE, "block_m": _NONE, "num_warps": _NONE, "num_stages": _NONE, "pdl": _NONE,
                     "preload_pages": _NONE, "host_chunk": _NONE, "ksplit": _NONE, "lazy": _NONE, "fuse_merge": _NONE,
                     "cluster": _NONE, "stages": _NONE, "pipe": _NONE},
    variants={"cute_pdl": ("cute", {"pdl": True})},
    make_inputs=make_decode, reference=ref_decode, written=("o_lat", "lse"), updated=(),
    tolerances=tolerances, tolerance_why=WHY, call=call_decode,
    nbytes=decode_bytes, flops=decode_flops, floor_bw="read",
    backends={"reference": "k3lab.ref.mla:mla_attend", "torch_compile": "k3lab.ref.mla:mla_attend",
              "triton": "k3lab_kernels.triton.mla_decode:mla_decode",
              "cute": "k3lab_kernels.cute.mla_decode:mla_decode",
              "aiter": "k3lab_kernels.aiter.mla_decode:mla_decode"},
    valid=_valid_decode, peers=flashinfer_peers, supports=decode_supports, test_file="tests/test_mla_triton.py",
))

register(Op(
    name="mla_combine", component="mla", policy_key="combine",
    doc="merge of the partials (pieces x DCP shards) + value up-projection (512 -> 128 per head) + sigmoid gate",
    axes=dict(heads=(12,), batch=(1, 4), T=(1,), partitions=(8,), dcp=(1,)),
    option_axes={"block_v": {"triton": (None, 16, 32, 64, 128)},
                 "block_r": {"triton": (None, 1, 16, 32, 64), "cute": (None, 1, 2, 4, 8)},
                 "num_warps": {"triton": (None, 4, 8)},
                 "pdl": {"triton": (None, False, True), "cute": (None, False, True)},
                 "premerge": {"triton": (None, False, True)}},
    option_defaults={"block_v": _NONE, "block_r": _NONE, "num_warps": _NONE, "pdl": _NONE, "premerge": _NONE},
    make_inputs=make_combine, reference=ref_combine, written=("out",), updated=(),
    tolerances=tolerances, tolerance_why=WHY, call=call_combine,
    nbytes=combine_bytes, flops=combine_flops, floor_bw="read",
    backends={"reference": "k3lab.ref.mla:mla_combine", "torch_compile": "k3lab.ref.mla:mla_combine",
              "triton": "k3lab_kernels.triton.mla_combine:mla_combine",
              "cute": "k3lab_kernels.cute.mla_combine:mla_combine"},
    valid=lambda c: isinstance(c["partitions"], int) and c["partitions"] >= 1 and c["dcp"] >= 1,
    supports=combine_supports, rule_facts=combine_facts, test_file="tests/test_mla_triton.py",
))

register(Op(
    name="mla_cache_write", component="mla", policy_key="cache_write",
    doc="kv down-projection output -> kv_norm RMSNorm -> written into the cache in place (bf16, or fp8 + scale)",
    axes=dict(batch=(1, 4), context=(256,), T=(1,), **_CACHE_AXES, ragged=(False,)),
    option_axes={"pdl": {"cute": (None, False, True)}}, option_defaults={"pdl": _NONE},
    variants={"cute_pdl": ("cute", {"pdl": True})},
    make_inputs=make_write, reference=ref_write, written=("kv_cache", "token_scale"), updated=(),
    tolerances=tolerances, tolerance_why=WHY, call=call_write,
    nbytes=write_bytes, flops=write_flops, floor_bw="copy",
    backends={"reference": "k3lab.ref.mla:mla_cache_entry", "torch_compile": "k3lab.ref.mla:mla_cache_entry",
              "triton": "k3lab_kernels.triton.mla_cache_write:mla_cache_write",
              "cute": "k3lab_kernels.cute.mla_cache_write:mla_cache_write"},
    valid=lambda c: _valid_cache(c) and c["context"] >= 0, test_file="tests/test_mla_triton.py",
))

register(Op(
    name="mla_query", component="mla", policy_key="query",
    doc="the absorbed query step: rms(cq; q_norm) through Wuq, the nope part absorbed through Wuk (one launch)",
    axes=dict(heads=(12,), batch=(1, 2), q_rank=(1536,), nope=(128,), rope=(DR,), latent=(C,)),
    option_axes={"pdl": {"triton": (None, False, True), "cute": (None, False, True)}}, option_defaults={"pdl": _NONE},
    variants={"cute_pdl": ("cute", {"pdl": True})},
    make_inputs=make_query, reference=ref_query, written=("q_lat", "q_rope"), updated=(),
    tolerances=tolerances, tolerance_why=WHY, call=call_query,
    nbytes=query_bytes, flops=query_flops, floor_bw="read",
    backends={"reference": "k3lab.ref.mla:mla_query", "torch_compile": "k3lab.ref.mla:mla_query",
              "triton": "k3lab_kernels.triton.mla_query:mla_query",
              "cute": "k3lab_kernels.cute.mla_query:mla_query"},
    supports=query_supports, peers=query_peers, test_file="tests/test_mla_query.py",
))
