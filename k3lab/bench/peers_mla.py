"""FlashInfer's batch MLA paged decode as a peer of k3lab's MLA decode (timed beside ours, same inputs).

What runs
---------
`flashinfer.mla._batch_mla.BatchMLAPagedAttentionWrapper` (FlashInfer 0.7.2), backend "fa3" (the Hopper
kernel, `mla_hopper.cuh`: WGMMA, 64-row query tiles, 64-position KV tiles, one persistent cooperative
launch that also merges its split-KV partials) or "fa2" (`mla.cuh`, SM80+). It computes the absorbed
attention per sequence b and query head j:

    score_t  = (q_lat[j] . c_t + q_rope[j] . k_rope_t) * scale        over t < lengths[b]
    o_lat[j] = softmax_t(score) . c                                    [512]
    lse[j]   = log sum_t exp(score_t)

Both backends are JIT-built by nvcc on first use (~20 s) from the C++ sources carried in `.gpu/fijit`
(`bash .gpu/fijit/unpack.sh` after `eval "$(bash .gpu/fi/unpack.sh)"`: they land in
`$FI_SITE/flashinfer/data`, where FlashInfer's `jit.env` looks). The Python tree is imported through
`k3lab.bench.peers.flashinfer_module` (a package stub: `import flashinfer` pulls in modules not carried).

The API, as read in FlashInfer 0.7.2's source
---------------------------------------------
- `BatchMLAPagedAttentionWrapper(float_workspace_buffer, use_cuda_graph, qo_indptr, kv_indptr, kv_indices,
  kv_len_arr, backend)`. The float workspace holds the split-KV partial outputs: the planner takes
  2 * (SMs / cluster) * (64 * cluster) rows of 512 two-byte values plus their lse, ~17 MiB on 132 SMs;
  FlashInfer suggests 128 MiB, the default here (pass `workspace=` to share one between instances: the
  launches run one after another on a stream). The wrapper adds its own 8 MiB int workspace and an 8 MiB
  pinned host copy. With `use_cuda_graph=True` the four int32 metadata buffers must be reserved on the
  device ([B+1], [B+1], >= live pages, [B]); `plan` copies the metadata into them so the pointers a
  captured graph holds stay valid (fa2/fa3 may even re-plan into them).
- `plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr), num_heads,
  head_dim_ckv=512, head_dim_kpe=64, page_size, causal, sm_scale, q_data_type, kv_data_type,
  query_layout, kv_cache_layout, lse_mode)`: CSR metadata, int32, on the CPU or the wrapper's device;
  kv_indptr[b+1] - kv_indptr[b] must equal ceil(kv_len_arr[b] / page_size) (checked by FlashInfer);
  kv_indices lists the live pages of each sequence in order. For T = 1, qo_indptr = arange(B + 1) and
  causal=False (one query sees every valid position). Positional and flat-metadata forms are deprecated
  (they warn); the keyword `metadata=` form is used here. The lse mode is part of the plan: "none",
  "base2" or "basee", and `run` must ask for the same.
- `run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), out=, lse=, return_lse=, return_lse_base_on_e=)`:
  split inputs (planned as "split") are taken as they are, with their strides (the kernels read
  stride(0), stride(1) and need a unit last stride), so the pool's two column slices go in without a copy.
  q_nope [B, H, 512], q_pe [B, H, 64], ckv [n_pages, page_size, 512], kpe [n_pages, page_size, 64], out
  [B, H, 512] in q's dtype, lse [B, H] float32.
- Heads: any positive count. The scheduler packs (query, head) rows into 64-row tiles (two CTAs of a
  cluster, 128 rows, once B*H/B > 64), so 12 heads run as 12 live rows of one tile: no padding is needed
  (`pad_heads` is kept to time the padded shape anyway; padded queries are zero and dropped).
- Page size: any positive int (the kernels divide positions by it with a fastdiv; rows past a sequence's
  length are zero-filled by predicated loads, not read). Work items are capped at 16384 (FlashInfer
  refuses bigger plans). Head dims: fa3 needs ckv in (128, 256, 512) and kpe a multiple of 64; ours are
  512 / 64.
- Dtypes: q bf16 or fp16; kv the same dtype as q (fp8 e4m3 kv with bf16 q also exists on SM90, with a
  per-tensor ckv scale or per-position, per-128-column ckv scales, and a per-tensor kpe scale; not wired
  here); out = q's dtype. The metadata is int32.
- lse: natively BASE 2, lse2 = log2 sum_t exp(score_t) (the kernels run the softmax in exp2 with
  sm_scale * log2(e) and write log2(d) + m); with `return_lse_base_on_e=True` (plan lse_mode "basee") the
  kernel multiplies by ln 2 in its epilogue. Empty sequences give -inf. This adapter plans "base2" by
  default (FlashInfer's usual form, timed as it usually runs) and converts in `result()`:
  lse = lse2 * ln 2 (`lse_to_natural`).
- CUDA graphs: `use_cuda_graph=True` plus the reserved buffers above; after `plan`, `run` launches one
  kernel with fixed pointers and no host sync, so it can be captured. The captured batch, lengths and
  page table are frozen at plan time: a graph replays the planned schedule.

Conversions (all in `__init__`, outside any timed region)
---------------------------------------------------------
- The latent cache [c (512) | k_rope (64)]: a page pool [n_pages, page_size, 576] is split into two
  strided views (no copy); separate ckv / kpe pools are taken as they are. A contiguous [B, S_max, 576]
  cache is paged by `from_contiguous` (ceil(len/page_size) pages per sequence handed out in a seeded
  shuffled order, so the block table is not trivially contiguous; a copy), or used in place as B pages of
  S_max rows (`FlashInferMLADecode.from_contiguous_cache(..., page_size=None)`, no copy).
- The block table [B, max_pages] int32 + lengths -> CSR (`csr_metadata`): kv_indices is the concatenation
  of block_table[b, :ceil(lengths[b] / page_size)].
- lengths are the number of valid positions INCLUDING the new one (k3lab.ref.mla's `lengths` counts the
  positions before this step: pass lengths + 1 after writing the new entry).
- Queries are read in place (an in-place update of q_lat / q_rope is seen by the next call or graph
  replay) unless `pad_heads` asks for more heads; then they are copied into zero-padded buffers once.
- `result()` returns (o_lat [B, H, 512] in q's dtype, lse [B, H] float32 natural log or None), padded
  heads dropped, copies.

Not verified here (written without a GPU; `tests/test_peers_mla.py::test_flashinfer_mla_matches_fp32`
checks it on the H200)
----------------------------------------------------------------------------------------------------
- That the wrapper imports through the stub and JIT-builds from the carried tree on the GPU machine
  (the device README reports both backends built and ran at 12 and 16 heads, page 64, bf16, in graphs;
  this adapter's own calls have not run).
- Its numerics against the fp32 reference, the lse base (read from the kernel source, not measured),
  and capture/replay of `__call__` in a CUDA graph.
- Page sizes other than 64, the in-place contiguous path (one page of S_max rows), fp16, zero lengths,
  head counts above 64 (two-CTA clusters), and batches near the 16384 work-item cap.
"""
from __future__ import annotations

import math
import os
import shutil

import torch

from k3lab.bench.peers import flashinfer_module

C_DIM = 512  # latent width (head_dim_ckv)
R_DIM = 64  # rope width (head_dim_kpe)
ENTRY = C_DIM + R_DIM  # 576 values a position
BACKENDS = ("fa3", "fa2")
LSE_MODES = ("base2", "basee", "none")
DTYPES = (torch.bfloat16, torch.float16)
_JIT_SOURCES = {"fa3": "batch_mla_sm90_run.cu", "fa2": "batch_mla_run.cu"}
LN2 = math.log(2.0)


# ---- availability ------------------------------------------------------------------------------------

def _nvcc() -> str | None:
    """nvcc as FlashInfer's JIT finds it: $CUDA_HOME / $CUDA_PATH, then PATH, then /usr/local/cuda."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


def flashinfer_mla_available(backend: str = "fa3") -> tuple[bool, str]:
    """(ok, why): a GPU of the right generation (fa3: SM90, fa2: SM80+), the wrapper importable, the JIT
    sources unpacked (.gpu/fijit) and nvcc present to build them."""
    if backend not in BACKENDS:
        return False, f"backend must be one of {BACKENDS}, got {backend!r}"
    if not torch.cuda.is_available():
        return False, "FlashInfer's MLA decode needs a GPU"
    major, minor = torch.cuda.get_device_capability()
    if backend == "fa3" and major != 9:
        return False, f"fa3 MLA needs an SM90 (Hopper) GPU, this one is SM{major}{minor}"
    if major < 8:
        return False, f"fa2 MLA needs SM80 or newer, this GPU is SM{major}{minor}"
    try:
        flashinfer_module("mla._batch_mla")
        env = flashinfer_module("jit.env")
    except Exception as e:  # noqa: BLE001 - ImportError, or a dependency failing at import
        return False, f"FlashInfer's batch MLA wrapper does not import: {type(e).__name__}: {str(e)[:200]}"
    src = env.FLASHINFER_CSRC_DIR / _JIT_SOURCES[backend]
    if not src.exists() or not (env.FLASHINFER_INCLUDE_DIR / "flashinfer" / "attention" / "mla.cuh").exists():
        return False, (f"FlashInfer's JIT sources are missing ({src}): run `bash .gpu/fijit/unpack.sh` after "
                       "unpacking .gpu/fi")
    if _nvcc() is None:
        return False, "nvcc not found (FlashInfer JIT-builds the MLA decode on first use)"
    return True, f"flashinfer 0.7.2 BatchMLAPagedAttentionWrapper ({backend}, JIT)"


# ---- pure-torch layout helpers (CPU-testable) --------------------------------------------------------

def _lengths_list(lengths, batch: int) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be [B], got shape {tuple(lengths.shape)}")
        if lengths.is_floating_point() or lengths.is_complex():
            raise ValueError(f"lengths must be integers, got {lengths.dtype}")
        vals = [int(v) for v in lengths.tolist()]
    else:
        vals = [int(v) for v in lengths]
    if len(vals) != batch:
        raise ValueError(f"lengths has {len(vals)} entries for a batch of {batch}")
    if any(v < 0 for v in vals):
        raise ValueError(f"lengths must be >= 0, got {vals}")
    return vals


def _pages(n: int, page_size: int) -> int:
    return -(-n // page_size)


def from_contiguous(cache: torch.Tensor, lengths=None, page_size: int = 64, *, seed: int = 0,
                    spare_pages: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Page a contiguous latent cache [B, S_max, W] -> (pool [n_pages, page_size, W], block_table
    [B, max_pages] int32), both on the cache's device.

    Sequence b gets ceil(lengths[b] / page_size) pages (all ceil(S_max / page_size) when lengths is None),
    handed out from a seeded random permutation of the pool, so a kernel that ignores the table reads the
    wrong rows. Page j of sequence b holds positions j*page_size .. of cache[b] (rows past S_max are
    zero; rows past lengths[b] in its last page copy the cache's rows there, whatever they hold).
    block_table is [B, max(pages)] (at least one column); entries past a sequence's pages hold page 0
    (a valid id, never read). `spare_pages` extra pages (zeros) are never referenced."""
    if cache.dim() != 3:
        raise ValueError(f"cache must be [B, S_max, width], got shape {tuple(cache.shape)}")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if spare_pages < 0:
        raise ValueError(f"spare_pages must be >= 0, got {spare_pages}")
    B, S, W = cache.shape
    lens = [S] * B if lengths is None else _lengths_list(lengths, B)
    if any(n > S for n in lens):
        raise ValueError(f"lengths {lens} exceed the cache capacity S_max = {S}")
    per_seq = [_pages(n, page_size) for n in lens]
    used = sum(per_seq)
    n_pages = used + spare_pages
    perm = torch.randperm(max(n_pages, 1), generator=torch.Generator().manual_seed(seed))[:used].tolist()
    P = max(max(per_seq, default=0), 1)
    padded = torch.zeros(B, P * page_size, W, dtype=cache.dtype, device=cache.device)
    padded[:, : min(S, P * page_size)] = cache[:, : P * page_size]
    padded = padded.view(B, P, page_size, W)
    pool = torch.zeros(max(n_pages, 1), page_size, W, dtype=cache.dtype, device=cache.device)
    table = torch.zeros(B, P, dtype=torch.int32)
    k = 0
    for b, npg in enumerate(per_seq):
        ids = torch.tensor(perm[k:k + npg], dtype=torch.int64)
        k += npg
        table[b, :npg] = ids.to(torch.int32)
        pool[ids.to(cache.device)] = padded[b, :npg]
    return pool, table.to(cache.device)


def to_contiguous(pool: torch.Tensor, block_table: torch.Tensor, lengths, capacity: int | None = None
                  ) -> torch.Tensor:
    """Gather a paged cache back: [B, capacity, W] (default capacity max_pages * page_size) with the
    valid positions t < lengths[b] from the pool and zeros elsewhere."""
    if pool.dim() != 3 or block_table.dim() != 2:
        raise ValueError(f"pool must be [n_pages, page_size, W] and block_table [B, max_pages], got "
                         f"{tuple(pool.shape)} and {tuple(block_table.shape)}")
    B, P = block_table.shape
    ps, W = pool.shape[1], pool.shape[2]
    S = P * ps if capacity is None else capacity
    lens = _lengths_list(lengths, B)
    out = torch.zeros(B, S, W, dtype=pool.dtype, device=pool.device)
    table = block_table.to("cpu", torch.int64)
    for b, n in enumerate(lens):
        if n > min(S, P * ps):
            raise ValueError(f"length {n} of sequence {b} exceeds the capacity {min(S, P * ps)}")
        for j in range(_pages(n, ps)):
            lo, hi = j * ps, min((j + 1) * ps, n)
            out[b, lo:hi] = pool[int(table[b, j]), : hi - lo]
    return out


def csr_metadata(block_table: torch.Tensor, lengths, page_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our block table + lengths -> FlashInfer's CSR plan metadata for T = 1 decode, all int32 on the CPU:
    qo_indptr = arange(B + 1); kv_indptr = [0, cumsum(ceil(lengths / page_size))]; kv_indices = the live
    pages of each sequence in order; kv_len_arr = lengths."""
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [B, max_pages], got shape {tuple(block_table.shape)}")
    B, P = block_table.shape
    lens = _lengths_list(lengths, B)
    table = block_table.to("cpu", torch.int32)
    npg = [_pages(n, page_size) for n in lens]
    for b, k in enumerate(npg):
        if k > P:
            raise ValueError(f"sequence {b} has length {lens[b]} = {k} pages of {page_size}, but the block table "
                             f"holds {P} pages a sequence (capacity {P * page_size})")
    qo_indptr = torch.arange(B + 1, dtype=torch.int32)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(npg, dtype=torch.int64), 0).to(torch.int32)
    parts = [table[b, :k] for b, k in enumerate(npg)]
    kv_indices = torch.cat(parts).contiguous() if parts else torch.zeros(0, dtype=torch.int32)
    kv_len_arr = torch.tensor(lens, dtype=torch.int32)
    return qo_indptr, kv_indptr, kv_indices, kv_len_arr


def lse_to_natural(lse: torch.Tensor | None, mode: str) -> torch.Tensor | None:
    """FlashInfer's lse in plan mode `mode` -> natural log: "base2" is log2 sum exp(score) (its default),
    times ln 2; "basee" is natural already; "none" has none. -inf stays -inf."""
    if mode not in LSE_MODES:
        raise ValueError(f"lse mode must be one of {LSE_MODES}, got {mode!r}")
    if mode == "none" or lse is None:
        return None
    if mode == "base2":
        return lse.float() * LN2
    return lse.float()


def pad_queries(q_lat: torch.Tensor, q_rope: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, D] queries -> [B, heads, D] copies, the added heads zero."""
    B, H, _ = q_lat.shape
    if heads < H:
        raise ValueError(f"pad_heads ({heads}) must be >= the query heads ({H})")
    qn = torch.zeros(B, heads, q_lat.shape[2], dtype=q_lat.dtype, device=q_lat.device)
    qp = torch.zeros(B, heads, q_rope.shape[2], dtype=q_rope.dtype, device=q_rope.device)
    qn[:, :H] = q_lat
    qp[:, :H] = q_rope
    return qn, qp


def to_ours(out: torch.Tensor, lse: torch.Tensor | None, heads: int, lse_mode: str
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlashInfer's out [B, Hp, 512] and lse [B, Hp] -> (o_lat [B, heads, 512], lse [B, heads] natural log),
    padded heads dropped, copies."""
    o = out[:, :heads].clone()
    l = lse_to_natural(lse, lse_mode)
    return o, (None if l is None else l[:, :heads].clone())


def _split_pool(ckv_pages: torch.Tensor, kpe_pages: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if kpe_pages is None:
        if ckv_pages.dim() != 3 or ckv_pages.shape[2] != ENTRY:
            raise ValueError(f"the page pool must be [n_pages, page_size, {ENTRY}] ([c (512) | k_rope (64)]), "
                             f"got {tuple(ckv_pages.shape)}")
        return ckv_pages[..., :C_DIM], ckv_pages[..., C_DIM:]
    if ckv_pages.dim() != 3 or kpe_pages.dim() != 3:
        raise ValueError(f"ckv_pages and kpe_pages must be [n_pages, page_size, 512] and [n_pages, page_size, 64], "
                         f"got {tuple(ckv_pages.shape)} and {tuple(kpe_pages.shape)}")
    if ckv_pages.shape[2] != C_DIM or kpe_pages.shape[2] != R_DIM:
        raise ValueError(f"ckv_pages must end in {C_DIM} and kpe_pages in {R_DIM} values, got "
                         f"{tuple(ckv_pages.shape)} and {tuple(kpe_pages.shape)}")
    if ckv_pages.shape[:2] != kpe_pages.shape[:2]:
        raise ValueError(f"ckv_pages {tuple(ckv_pages.shape)} and kpe_pages {tuple(kpe_pages.shape)} must share "
                         "[n_pages, page_size]")
    return ckv_pages, kpe_pages


def _check_layout(name: str, t: torch.Tensor) -> None:
    """The kernels read rows with 128-bit loads at stride(0), stride(1) and a unit last stride."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs a unit last stride, got strides {t.stride()}")
    es = t.element_size()
    if t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]):
        raise ValueError(f"{name} must be 16-byte aligned in its address and row strides "
                         f"(strides {t.stride()}, {es}-byte elements)")


def check_inputs(q_lat, q_rope, ckv, kpe, block_table, lengths, scale, *, backend="fa3", pad_heads=None,
                 lse_mode="base2") -> dict:
    """Every shape/dtype rule of the adapter, with a message naming what is wrong (ValueError). ckv / kpe
    are the split pools. Returns the facts the plan needs (B, H, Hp, page_size, n_pages, lengths)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (FlashInfer's batch MLA backends this adapter "
                         f"wires), got {backend!r}")
    if lse_mode not in LSE_MODES:
        raise ValueError(f"lse_mode must be one of {LSE_MODES}, got {lse_mode!r}")
    if q_lat.dim() == 4:
        if q_lat.shape[1] != 1:
            raise ValueError(f"only T = 1 decode is supported, got q_lat {tuple(q_lat.shape)} (T = {q_lat.shape[1]})")
        raise ValueError(f"q_lat must be [B, H, {C_DIM}] (squeeze T = 1), got {tuple(q_lat.shape)}")
    if q_lat.dim() != 3 or q_lat.shape[2] != C_DIM:
        raise ValueError(f"q_lat must be [B, H, {C_DIM}] (the absorbed query), got {tuple(q_lat.shape)}")
    B, H, _ = q_lat.shape
    if tuple(q_rope.shape) != (B, H, R_DIM):
        raise ValueError(f"q_rope must be [B, H, {R_DIM}] = {(B, H, R_DIM)}, got {tuple(q_rope.shape)}")
    if q_lat.dtype not in DTYPES:
        raise ValueError(f"FlashInfer's fa2/fa3 MLA takes bf16 or fp16 queries, got {q_lat.dtype}")
    for name, t in (("q_rope", q_rope), ("ckv pages", ckv), ("kpe pages", kpe)):
        if t.dtype != q_lat.dtype:
            raise ValueError(f"{name} is {t.dtype} but q_lat is {q_lat.dtype}: FlashInfer's fa2/fa3 MLA needs the "
                             "cache in the query dtype (fp8 caches are not wired in this adapter)")
    if B < 1 or H < 1:
        raise ValueError(f"empty batch or heads: q_lat {tuple(q_lat.shape)}")
    if pad_heads is not None and (not isinstance(pad_heads, int) or pad_heads < H):
        raise ValueError(f"pad_heads must be None or an int >= the query heads ({H}), got {pad_heads!r}")
    n_pages, page_size = ckv.shape[0], ckv.shape[1]
    if page_size < 1 or n_pages < 1:
        raise ValueError(f"empty page pool {tuple(ckv.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be [B = {B}, max_pages], got {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must hold integer page ids (int32), got {block_table.dtype}")
    lens = _lengths_list(lengths, B)
    _, _, kv_indices, _ = csr_metadata(block_table, lens, page_size)  # raises if a length exceeds the table
    if kv_indices.numel() and (int(kv_indices.min()) < 0 or int(kv_indices.max()) >= n_pages):
        raise ValueError(f"block_table refers to pages outside the pool of {n_pages} pages "
                         f"(live ids span {int(kv_indices.min())}..{int(kv_indices.max())})")
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    devs = {t.device for t in (q_lat, q_rope, ckv, kpe)}
    if len(devs) != 1:
        raise ValueError(f"q_lat, q_rope and the cache must be on one device, got {sorted(map(str, devs))}")
    return dict(B=B, H=H, Hp=H if pad_heads is None else pad_heads, page_size=page_size, n_pages=n_pages,
                lengths=lens, scale=s)


# ---- the peer ----------------------------------------------------------------------------------------

class FlashInferMLADecode:
    """FlashInfer's batch MLA paged decode on our inputs (module docstring).

    q_lat [B, H, 512], q_rope [B, H, 64] (bf16 or fp16); the cache as a page pool [n_pages, page_size, 576]
    (`ckv_pages`, with `kpe_pages=None`) or as separate pools ckv [n_pages, page_size, 512] and kpe
    [n_pages, page_size, 64]; block_table [B, max_pages] int32; lengths [B] (valid positions including the
    new one); scale (192^-0.5 for K3). `__init__` checks, converts, plans and synchronizes; `__call__()` is
    the run alone (capturable in a CUDA graph); `result()` gives (o_lat [B, H, 512], lse [B, H] natural log
    or None). `lse_mode`: "base2" (FlashInfer's native lse, converted in `result`), "basee" (the kernel
    converts) or "none" (no lse written). `workspace`: a uint8 CUDA tensor to share between instances."""

    def __init__(self, q_lat, q_rope, ckv_pages, kpe_pages, block_table, lengths, scale, *, backend="fa3",
                 pad_heads=None, lse_mode="base2", use_cuda_graph=True, workspace=None,
                 workspace_bytes=128 << 20):
        ckv, kpe = _split_pool(ckv_pages, kpe_pages)
        f = check_inputs(q_lat, q_rope, ckv, kpe, block_table, lengths, scale, backend=backend,
                         pad_heads=pad_heads, lse_mode=lse_mode)
        dev = q_lat.device
        if dev.type != "cuda":
            raise ValueError(f"FlashInfer's MLA decode runs on CUDA tensors, got {dev}")
        for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("ckv pages", ckv), ("kpe pages", kpe)):
            _check_layout(name, t)
        ok, why = flashinfer_mla_available(backend)
        if not ok:
            raise RuntimeError(why)
        bm = flashinfer_module("mla._batch_mla")

        self.backend, self.lse_mode = backend, lse_mode
        self.B, self.H, self.Hp = f["B"], f["H"], f["Hp"]
        self.page_size, self.scale, self.lengths = f["page_size"], f["scale"], f["lengths"]
        self.dtype = q_lat.dtype
        self.ckv, self.kpe = ckv, kpe
        if self.Hp == self.H:
            self.q_nope, self.q_pe = q_lat, q_rope  # read in place
        else:
            self.q_nope, self.q_pe = pad_queries(q_lat, q_rope, self.Hp)
        self.out = torch.empty(self.B, self.Hp, C_DIM, dtype=self.dtype, device=dev)
        self.lse = (None if lse_mode == "none"
                    else torch.empty(self.B, self.Hp, dtype=torch.float32, device=dev))

        qo, kvp, kvi, kvl = csr_metadata(block_table, self.lengths, self.page_size)
        if workspace is None:
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=dev)
        self.workspace = workspace
        reserved = {}
        if use_cuda_graph:
            reserved = dict(qo_indptr=torch.empty_like(qo, device=dev), kv_indptr=torch.empty_like(kvp, device=dev),
                            kv_indices=torch.empty(max(kvi.numel(), 1), dtype=torch.int32, device=dev),
                            kv_len_arr=torch.empty_like(kvl, device=dev))
        self._reserved = reserved
        self.wrapper = bm.BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=use_cuda_graph, backend=backend,
                                                        **reserved)
        self.wrapper.plan(metadata=bm.MLAPlanMetadata.csr(qo, kvp, kvi, kvl), num_heads=self.Hp,
                          head_dim_ckv=C_DIM, head_dim_kpe=R_DIM, page_size=self.page_size, causal=False,
                          sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
                          query_layout="split", kv_cache_layout="split", lse_mode=lse_mode)
        self.use_cuda_graph = use_cuda_graph
        torch.cuda.synchronize(dev)  # the plan's host-to-device copies land before any capture or timing

    @classmethod
    def from_contiguous_cache(cls, q_lat, q_rope, cache, lengths, scale, *, page_size: int | None = 64, seed=0,
                              **kw) -> FlashInferMLADecode:
        """A contiguous cache [B, S_max, 576]: paged by `from_contiguous` (a shuffled copy) at `page_size`,
        or with page_size=None used in place as B pages of S_max rows (block_table[b] = [b])."""
        if cache.dim() != 3 or cache.shape[2] != ENTRY:
            raise ValueError(f"cache must be [B, S_max, {ENTRY}], got {tuple(cache.shape)}")
        if page_size is None:
            table = torch.arange(cache.shape[0], dtype=torch.int32, device=cache.device)[:, None]
            return cls(q_lat, q_rope, cache, None, table, lengths, scale, **kw)
        pool, table = from_contiguous(cache, lengths, page_size, seed=seed)
        return cls(q_lat, q_rope, pool, None, table, lengths, scale, **kw)

    def __call__(self) -> torch.Tensor:
        """The run alone: one launch into the preallocated out / lse."""
        self.wrapper.run(query=(self.q_nope, self.q_pe), kv_cache=(self.ckv, self.kpe), out=self.out, lse=self.lse,
                         return_lse=self.lse is not None, return_lse_base_on_e=self.lse_mode == "basee")
        return self.out

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(o_lat [B, H, 512] in q's dtype, lse [B, H] float32 natural log, or None with lse_mode "none")."""
        return to_ours(self.out, self.lse, self.H, self.lse_mode)

    ours = result
