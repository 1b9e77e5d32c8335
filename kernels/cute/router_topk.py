"""MoE router selection as one CuTe DSL kernel, after the router projection (whose fp32 logits it reads):

    s      = sigmoid(logits[b])                          [E] fp32 (E = 896 experts)
    sel    = top-k of (s + e_bias)                       the bias only chooses (k = 16)
    w      = s[sel] / sum(s[sel]) * scaling              the weights come from the unbiased scores
    idx[b] = sel (int64, descending biased score), weights[b] = w (fp32)

Bit-identical to the Triton kernel (kernels/triton/router_topk.py) on the same logits: the same fp32 operations
in the same order as its PTX for sm_90 (z * -log2e (Triton 3.6: (0 - z) * log2e, the same bits),
ex2.approx.f32, + 1, div.full.f32 for the sigmoid; the biased score s + bias + 0.0; the sum of the k weights as
its butterfly over lanes 8, 4, 2, 1 (k = 16); div.full.f32 and * scaling) and the same tie rule: experts are
taken in descending order of their fp32 biased score, equal biased scores lower expert id first, through one
int64 key per expert (the score's bits made order-preserving as a signed int in the high word, 1023 - id in the
low word: distinct keys, one order).

Layout: logits [B, E] fp32 (unit stride along E, any row stride), e_bias [E] fp32 contiguous; idx [B, k] int64
and weights [B, k] fp32 contiguous. E <= 1024, 1 <= k <= min(E, 32). Grid (B,): one CTA per row, W = ceil(E /
128) warps (7 at E = 896), thread t holds experts t + 32 W i (i < 4: each load instruction is coalesced
across the warp; neighbouring experts sit in different threads, which keeps near-equal pairs apart).

The selection, with two CTA barriers and no sort:
  1. every thread: its 4 logits, sigmoid, biased score, keys; the scores s into shared memory, the thread's
     largest key into a table by thread; barrier.
  2. every warp, redundantly (no barrier): lane l takes the largest of the W thread maxima of threads l + 32 j
     (a group of 4 W experts), ranks the 32 group maxima by counting (16 shared loads each), and the group
     maximum of rank k - 1 is the threshold T: k distinct keys are >= T, so every key of the top k is >= T.
     Each warp keeps its keys >= T (ballots) and appends them to one candidate list (one shared atomic a
     warp); barrier.
  3. warp 0: n candidates (~21 on random, near and tied scores at E = 896, k = 16; rarely above 32). n <= 32:
     each lane ranks one candidate against the 32 slots of the list (the list is NEG beyond n) and the k of
     rank < k land in rank order; n <= 64: two such chunks; else (only adversarial inputs: the top experts
     in few groups) k rounds of a warp maximum below the last one. Then the k scores, their butterfly sum,
     the weights, and k coalesced stores of idx and weights.
Expected dependent chain after the logits arrive (reasoned, not measured): sigmoid and keys (~100 cycles),
barrier, group maxima and their ranks (~200; the W warps' ~33 shared-memory wavefronts each share one pipe,
~230 cycles of it), ballots, atomic and stores (~150), barrier, the ranking (~150), the sum and stores (~200):
~0.5 us at 1.98 GHz, on top of the launch and the logits' load.

pdl=True (programmatic dependent launch): each CTA loads e_bias, waits for the previous kernel on the stream
(griddepcontrol.wait; it wrote the logits), lets the next one launch, then reads the logits.

Floor (bytes, `k3lab.ops.trunk.router_bytes`): logits B*E*4 + e_bias E*4 + idx B*k*8 + weights B*k*4 at the
read bandwidth: 3.6 KB at batch 1, 0.24 MB at batch 64: launch-bound at every decode batch.

    router_topk(logits, e_bias, idx, weights, *, top_k, scaling=1.0, pdl=None) -> (idx, weights)
"""
from typing import Any

import torch

from .kda_decode import gmem_ptr as _ptr  # the one host pointer helper

MAX_EXPERTS = 1024   # the key's low word holds 1023 - id
MAX_TOPK = 32        # the threshold is a rank among 32 group maxima
_NEG = -(1 << 63) + 1  # a key below every expert's (the Triton kernel's)
_TOP = (1 << 63) - 1   # a key above every expert's
_NLOG2E = -1.4426950408889634  # exp(-z) = ex2(z * -log2e), the constant rounded to fp32 as Triton's 0fBFB8AA3B

__all__ = ["MAX_EXPERTS", "MAX_TOPK", "router_topk"]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def warps_for(E: int) -> int:
    """Warps a CTA of the stand-alone kernel: 128 experts a warp (4 a thread)."""
    return -(-E // 128)


def experts_per_thread(E: int, W: int) -> int:
    """Experts a thread holds when W warps select over E experts (4 in the stand-alone kernel; 7 in the 4-warp
    CTA of the projection's fused form at E = 896)."""
    return -(-E // (32 * W))


# ---------------------------------------------------------------------------------------------
# The selection's device code and the kernel (built lazily so importing this module never needs cutlass)
# ---------------------------------------------------------------------------------------------

_SELECTOR_CLS = None
_KERNEL_CLS = None


def selector_class():
    """`Selector(E, top_k, W, pdl)`: the selection of one row by a CTA of W warps (the module doc's three steps,
    thread t holding experts t + 32 W i, i < experts_per_thread(E, W)); `smem()` allocates its shared memory in
    the calling kernel, `row(...)` (a cute.jit device function) selects one row. Shared by this module's kernel
    (W = warps_for(E)) and the projection's fused selection (kernels/cute/proj_gemv.py, W = 4). The result does
    not depend on W: the keys are distinct and the top k in rank order is one list."""
    global _SELECTOR_CLS
    if _SELECTOR_CLS is not None:
        return _SELECTOR_CLS
    import cutlass
    from cutlass import Float32, Int32, Int64, cute

    def vec(ptr, off, n):
        """A 1-D view of n contiguous elements at element offset `off` of pointer `ptr`."""
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    def imax(a, b):
        return Int64(cutlass.select_(a > b, a, b))

    def tree_max(vals):
        """The largest of a list of Int64 keys, as a tree (a dependent chain of log2(len) maxima)."""
        while len(vals) > 1:
            vals = [imax(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
        return vals[0]

    def count_above(ptr, off, n, x, r2):
        """How many of the n (even) keys at ptr[off:] exceed x: 16-byte loads, four partial counts (a short
        dependent chain). off: a Python int, or an even dynamic offset."""
        acc = [Int32(0), Int32(0), Int32(0), Int32(0)]
        for i in range(n // 2):
            o = off + 2 * i if isinstance(off, int) else cute.assume(off + 2 * i, divby=2)
            cute.autovec_copy(vec(ptr, o, 2), r2)
            for h in range(2):
                q = 2 * (i % 2) + h
                acc[q] = acc[q] + Int32(cutlass.select_(r2[h] > x, Int32(1), Int32(0)))
        return (acc[0] + acc[1]) + (acc[2] + acc[3])

    def sigmoid(z):
        """1 / (1 + exp(-z)) as the Triton kernel's PTX computes it: mul.f32 by -log2e, ex2.approx.f32, add.f32 1,
        div.full.f32."""
        d = cute.math.exp2(z * _NLOG2E, approx=True) + 1.0
        return cute.math.div(Float32(1.0), d, full=True)

    class Selector:
        def __init__(self, E: int, top_k: int, W: int, pdl: bool = False, lean: bool = False):
            assert 1 <= top_k <= min(E, MAX_TOPK) and E <= MAX_EXPERTS and W >= 1, (E, top_k, W)
            self.E, self.K, self.W = E, top_k, W
            self.KP = _pow2(top_k)          # the butterfly's width (the Triton kernel's KP)
            self.NT = 32 * W                # threads; thread t holds experts t + NT i, i < R
            self.R = experts_per_thread(E, W)
            self.pdl = bool(pdl)            # wait for the kernel before between the bias and the logits
            # lean: the rankings count in a loop of four keys a step instead of all loads at once (the stand-alone
            # kernel's unrolled form holds up to 64 keys in registers: 136 a thread inside the projection, whose
            # streaming wants ~40)
            self.lean = bool(lean)
            # the weights' butterfly: lanes xor KP / 2, ..., 1 (the Triton kernel's tl.sum over KP lanes)
            self.sum_offs = tuple(self.KP >> j for j in range(1, self.KP.bit_length()))

        def smem(self, a=None):
            """(s_score, s_tmax, s_sup, s_cand, s_sel, s_cnt): s by expert slot, thread maxima, each warp's 32 group
            maxima, the candidates (keys >= T; NEG past them up to 64 slots), the top k by rank, counters
            (s_cnt[0]: candidates so far; s_cnt[1..3] free for the caller). `a`: the caller's SmemAllocator, so that
            the caller's own buffers follow these (a new allocator otherwise)."""
            NT, R, W = self.NT, self.R, self.W
            if a is None:
                a = cutlass.memory.SmemAllocator()
            return (a.allocate_tensor(Float32, cute.make_layout(R * NT), byte_alignment=16),
                    a.allocate_tensor(Int64, cute.make_layout(NT), byte_alignment=16),
                    a.allocate_tensor(Int64, cute.make_layout(32 * W), byte_alignment=16),
                    a.allocate_tensor(Int64, cute.make_layout(max(R * NT, 64)), byte_alignment=16),
                    a.allocate_tensor(Int64, cute.make_layout(32), byte_alignment=16),
                    a.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16))

        @cute.jit
        def count(self, ptr: cute.Pointer, off, n: cutlass.Constexpr, x: Int64, r2: cute.Tensor):
            """count_above, or (lean) the same count four keys a loop step."""
            res = Int32(0)
            if cutlass.const_expr(not self.lean):
                res = count_above(ptr, off, n, x, r2)
            else:
                a0 = Int32(0)
                a1 = Int32(0)
                for i in cutlass.range(n // 4, unroll=2):
                    o = cute.assume(off + 4 * i, divby=2)
                    cute.autovec_copy(vec(ptr, o, 2), r2)
                    a0 = a0 + Int32(cutlass.select_(r2[0] > x, Int32(1), Int32(0))) + Int32(
                        cutlass.select_(r2[1] > x, Int32(1), Int32(0)))
                    cute.autovec_copy(vec(ptr, cute.assume(o + 2, divby=2), 2), r2)
                    a1 = a1 + Int32(cutlass.select_(r2[0] > x, Int32(1), Int32(0))) + Int32(
                        cutlass.select_(r2[1] > x, Int32(1), Int32(0)))
                res = a0 + a1
            return res

        @cute.jit
        def row(self, p_row: cute.Pointer, p_bias: cute.Pointer, p_idx: cute.Pointer, p_w: cute.Pointer,
                scaling: Float32, s_score: cute.Tensor, s_tmax: cute.Tensor, s_sup: cute.Tensor,
                s_cand: cute.Tensor, s_sel: cute.Tensor, s_cnt: cute.Tensor, tid: Int32):
            """Every thread of the CTA calls it: the top k of the E logits at p_row into p_idx[0:k] (int64) and
            their weights into p_w[0:k]; two CTA barriers inside, none after (a caller selecting another row
            with the same shared memory syncs first)."""
            # (Python ints read through self inside dynamic ifs: captured ints would become Int32 values there)
            E, W, NT, R = self.E, self.W, self.NT, self.R
            lane = tid % 32
            warp = tid // 32

            # ---- 1. keys ----------------------------------------------------------------------------
            g_bias = cute.make_tensor(p_bias, cute.make_layout(E))
            r_eb = cute.make_rmem_tensor((R,), Float32)
            r_z = cute.make_rmem_tensor((R,), Float32)
            keys = cute.make_rmem_tensor((R,), Int64)

            def spread(g, r):  # expert tid + NT i of g into r[i] (0 past E), i < R
                for i in cutlass.range_constexpr(R):
                    r[i] = Float32(0.0)
                    if cutlass.const_expr(NT * (i + 1) <= E):
                        r[i] = g[tid + NT * i]
                    elif cutlass.const_expr(NT * i < E):
                        if tid + NT * i < E:
                            r[i] = g[tid + NT * i]

            spread(g_bias, r_eb)
            if cutlass.const_expr(self.pdl):
                # the projection before us wrote the logits: wait for it, then let the next kernel launch
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            spread(cute.make_tensor(p_row, cute.make_layout(E)), r_z)
            # the candidate list reads NEG past its end up to 64 slots (the ranking's static loops)
            for j in cutlass.range_constexpr((64 + NT - 1) // NT):
                if cutlass.const_expr(NT * (j + 1) <= 64):
                    s_cand[tid + NT * j] = Int64(_NEG)
                else:
                    if tid + NT * j < 64:
                        s_cand[tid + NT * j] = Int64(_NEG)
            if tid == 0:
                s_cnt[0] = Int32(0)
            for i in cutlass.range_constexpr(R):
                e = tid + NT * i
                s = sigmoid(r_z[i])
                s_score[e] = s
                v = s + r_eb[i] + 0.0  # + 0.0: -0 -> +0
                bits = v.bitcast(Int32)
                mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
                key = Int64(mono) * Int64(1 << 32) + Int64(1023 - e)
                if cutlass.const_expr(NT * (i + 1) > E):
                    key = Int64(cutlass.select_(e < E, key, Int64(_NEG)))
                keys[i] = key
            s_tmax[tid] = tree_max([keys[i] for i in range(R)])
            cute.arch.sync_threads()

            # ---- 2. the threshold (every warp the same) and the candidates --------------------------
            # (each load: 32 consecutive words, no bank conflict)
            gmax = tree_max([s_tmax[32 * j + lane] for j in range(W)])
            sup = warp * 32
            s_sup[sup + lane] = gmax
            cute.arch.sync_warp()
            r2 = cute.make_rmem_tensor((2,), Int64)
            rank = self.count(s_sup.iterator, sup, 32, gmax, r2)
            # the group maximum of rank k - 1 (group maxima are distinct keys unless NEG, an empty group's)
            ball = cute.arch.vote_ballot_sync(rank == self.K - 1)
            thr = Int64(_NEG + 1)
            if ball != 0:
                src = Int32(31) - Int32(cute.arch.clz(ball))
                thr = imax(s_sup[sup + src], Int64(_NEG + 1))
            below = (Int32(1) << lane) - Int32(1)
            pos = cute.make_rmem_tensor((R,), Int32)
            total = Int32(0)
            for i in cutlass.range_constexpr(R):
                bal = cute.arch.vote_ballot_sync(keys[i] >= thr)
                pos[i] = total + cute.arch.popc(bal & below)
                total = total + cute.arch.popc(bal)
            base = Int32(0)
            if lane == 0:
                base = cute.arch.atomic_add(s_cnt.iterator, total, scope="cta")
            base = cute.arch.shuffle_sync(base, 0)
            for i in cutlass.range_constexpr(R):
                if keys[i] >= thr:
                    s_cand[base + pos[i]] = keys[i]
            cute.arch.sync_threads()

            # ---- 3. warp 0: the top k in order, the weights -----------------------------------------
            if warp == 0:
                n = s_cnt[0]
                chunks = (n + 31) // 32
                if chunks <= 2:
                    # each lane ranks candidate c * 32 + lane against the whole list (NEG past n: a NEG slot
                    # ranks n >= k and is dropped); rank r < k lands in s_sel[r]
                    for m in cutlass.range_constexpr(2):
                        if chunks == m + 1:
                            for c in cutlass.range_constexpr(m + 1):
                                x = s_cand[c * 32 + lane]
                                r = self.count(s_cand.iterator, 0, 32 * (m + 1), x, r2)
                                if r < self.K:
                                    s_sel[r] = x
                else:
                    # k rounds of the warp's largest key below the last round's
                    last = Int64(_TOP)
                    mine = Int64(_NEG)
                    for rr in cutlass.range_constexpr(self.K):
                        best = Int64(_NEG)
                        for i in cutlass.range(lane, n, 32):
                            c_i = s_cand[i]
                            c_i = Int64(cutlass.select_(c_i < last, c_i, Int64(_NEG)))
                            best = imax(best, c_i)
                        for o in cutlass.range_constexpr(5):
                            best = imax(best, cute.arch.shuffle_sync_bfly(best, offset=16 >> o))
                        mine = Int64(cutlass.select_(lane == rr, best, mine))
                        last = best
                    if lane < self.K:
                        s_sel[lane] = mine
                cute.arch.sync_warp()
                sv = Float32(0.0)
                eid = Int32(0)
                if lane < self.K:
                    eid = Int32(1023) - Int32(s_sel[lane] & Int64(1023))
                    sv = s_score[eid]
                tot = sv
                for o in cutlass.range_constexpr(len(self.sum_offs)):
                    tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=self.sum_offs[o])
                wv = cute.math.div(sv, tot, full=True) * scaling
                if lane < self.K:
                    g_idx = cute.make_tensor(p_idx, cute.make_layout(self.K))
                    g_w = cute.make_tensor(p_w, cute.make_layout(self.K))
                    g_idx[lane] = Int64(eid)
                    g_w[lane] = wv

    _SELECTOR_CLS = Selector
    return Selector


def _kernel_class():
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32, cute

    Selector = selector_class()

    class RouterTopkKernel:
        """One CTA per row of logits; idx and weights written."""

        def __init__(self, E: int, top_k: int, pdl: bool = False):
            self.E, self.K = E, top_k
            self.sel = Selector(E, top_k, warps_for(E), pdl)
            self.pdl = bool(pdl)

        @cute.jit
        def __call__(self, p_logits: cute.Pointer, p_bias: cute.Pointer, p_idx: cute.Pointer,
                     p_w: cute.Pointer, B: Int32, s_row: Int32, scaling: Float32, stream: cuda.CUstream):
            self.kernel(p_logits, p_bias, p_idx, p_w, s_row, scaling).launch(
                grid=[B, 1, 1], block=[self.sel.NT, 1, 1], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_logits: cute.Pointer, p_bias: cute.Pointer, p_idx: cute.Pointer, p_w: cute.Pointer,
                   s_row: Int32, scaling: Float32):
            tid, _, _ = cute.arch.thread_idx()
            b, _, _ = cute.arch.block_idx()
            s_score, s_tmax, s_sup, s_cand, s_sel, s_cnt = self.sel.smem()
            self.sel.row(p_logits + b * s_row, p_bias, p_idx + b * self.K, p_w + b * self.K, scaling, s_score,
                         s_tmax, s_sup, s_cand, s_sel, s_cnt, tid)

    _KERNEL_CLS = RouterTopkKernel
    return RouterTopkKernel


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}


def _fail(name: str, msg: str):
    raise ValueError(f"router_topk cute: {name!r} {msg}")


def _validate(logits, e_bias, idx, weights, top_k, scaling, pdl):
    if not isinstance(logits, torch.Tensor) or logits.device.type != "cuda":
        _fail("logits", "must be a CUDA tensor")
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        _fail("logits", f"must be fp32 [B, E] with unit stride along E, got {logits.dtype} {tuple(logits.shape)} "
                        f"strides {logits.stride()}")
    B, E = logits.shape
    if B < 1:
        _fail("logits", "has an empty batch")
    if not 1 <= E <= MAX_EXPERTS:
        _fail("logits", f"must have 1..{MAX_EXPERTS} experts, got {E}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(E, MAX_TOPK):
        _fail("top_k", f"must be an int in 1..{min(E, MAX_TOPK)}, got {top_k!r}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        _fail("scaling", f"must be a number, got {scaling!r}")
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be a bool, got {pdl!r}")
    if logits.stride(0) * B * 4 >= 1 << 31:
        _fail("logits", "spans 2^31 bytes or more (32-bit row offsets)")
    for name, t, shape, dt in (("e_bias", e_bias, (E,), torch.float32), ("idx", idx, (B, top_k), torch.int64),
                               ("weights", weights, (B, top_k), torch.float32)):
        if not isinstance(t, torch.Tensor):
            _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
        if t.device != logits.device:
            _fail(name, f"is on {t.device}, logits on {logits.device}")
        if tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous():
            _fail(name, f"must be a contiguous {dt} tensor of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    return B, E


def router_topk(logits: torch.Tensor, e_bias: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, *,
                top_k: int, scaling: float = 1.0, pdl: bool | None = None):
    """logits [B, E] fp32, e_bias [E] fp32, idx [B, top_k] int64, weights [B, top_k] fp32 (written).
    pdl: launched with programmatic dependent launch (the bias read before waiting on the projection); None: the
    enclosing k3lab_kernels.triton.pdl.pdl_chain's setting (the decode step's `pdl` switch), as in Triton.
    Returns (idx, weights)."""
    if pdl is None:
        from k3lab_kernels.triton.pdl import chain_pdl

        pdl = chain_pdl(None)
    B, E = _validate(logits, e_bias, idx, weights, top_k, scaling, pdl)
    import cuda.bindings.driver as cuda
    import cutlass

    dev = logits.device
    args = [_ptr(logits, cutlass.Float32, 4), _ptr(e_bias, cutlass.Float32, 4), _ptr(idx, cutlass.Int64, 8),
            _ptr(weights, cutlass.Float32, 4), cutlass.Int32(B), cutlass.Int32(logits.stride(0)),
            cutlass.Float32(float(scaling))]
    key = (E, top_k, pdl, dev.index)
    with torch.cuda.device(dev):
        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fn = _COMPILED.get(key)
        if fn is None:
            from cutlass import cute
            fn = cute.compile(_kernel_class()(E, top_k, pdl), *args, stream)
            _COMPILED[key] = fn
        fn(*args, stream)
    return idx, weights
