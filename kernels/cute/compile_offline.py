"""Compile the CuTe DSL KDA kernel classes for sm_90a without a GPU and print each one's registers,
stack and local memory (spills), read off the cubin with cuobjdump.

    PYTHONPATH=<CuTe DSL site>:<CuTe DSL site>/nvidia_cutlass_dsl/dsl_packages \\
        python kernels/cute/compile_offline.py
            [--only prefill|decode|verify|attnres|router|mla_cache_write|mla_combine|proj|proj_mma|l2_prefetch|moe|
             moe_grouped|moe_dense|mla_query|mla_decode]
            [--quick] [--keep DIR] [--loops]

The Python needs nvidia-cutlass-dsl, cuda-bindings, numpy and torch (a CPU build is enough): e.g. a
Python 3.12 venv with `pip install typing_extensions numpy cuda-bindings torch` and the CuTe DSL
unpacked from .gpu/cute/cute.tar.xz (`tar -xJf .gpu/cute/cute.tar.xz -C <site>`). The kernel classes
are compiled directly on fake device pointers (no torch wrapper, no device): what this proves is that
every kernel builds for the chip and how many registers it takes, not that it is right.

--only prefill: every switch value of kda_prefill.py (chunk x inverse, chunk x tile_v x state dtype
for the sequential pass, and the grouped summary / scan / out kernels); decode: every tile on a resident
grid and a larger one, and pdl; verify: every tile with its default row warps at three batch sizes (the
shape's choices differ), every row_warps, T 2 and 8, ragged, pdl, checkpoints 2-8 (a failure prints and the script
goes on); attnres: attnres_norm.py at D = 7168, 9 blocks "add", every (cluster, vec, alpha) the kernel takes
there, plus 0 blocks "none", 5 blocks "fresh" and the tiny preset's D = 64 (with alpha "twopass" too), each with its
dynamic shared memory and the CTAs an SM by shared memory and by registers; router: router_topk.py at E = 896 with k 16
(the model's), 1, 7 and 32, E = 200 (padding threads) and 1024, each with and without pdl; mla_cache_write:
mla_cache_write.py for every cache format (bf16, fp8 per-tensor, fp8 per-token) x contiguous / paged 1, 16,
64 x pdl, plus int64 lengths, fp32 kv and the "tree" sum order. --quick: the largest
and smallest configuration of each prefill kernel only. --keep DIR: each configuration's cubin as
DIR/<name>.cubin (to diff SASS across commits). --loops: under each configuration, its loops of 40 or more
instructions (`loop_mix`: instructions an iteration a warp and the most frequent opcodes). Exit status 1 if any
compile failed or any kernel uses local memory.
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

# the DSL reads these when it is first imported
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTE_DSL_KEEP"] = "cubin"
_DUMP = tempfile.mkdtemp(prefix="k3lab_cute_")
os.environ["CUTE_DSL_DUMP_DIR"] = _DUMP

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        p = os.path.join(base, "bin", "cuobjdump")
        if base and os.path.exists(p):
            return p
    try:
        import triton
        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return p if os.path.exists(p) else None
    except ImportError:
        return None


def _usage(cubin: str, tool: str | None) -> str:
    if tool is None:
        return "(no cuobjdump found)"
    out = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "REG:" in line:
            keep = [w for w in line.split() if w.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL")]
            return " ".join(keep)
    return "(no resource line)"


def loop_mix(sass: str, min_instructions: int = 40) -> list[dict]:
    """The loops of a kernel's SASS (cuobjdump -sass text): each backward branch and the code from its target to it,
    as dict(start, end (byte offsets), instructions, mix: opcode -> count, most first), for loops of at least
    `min_instructions`, innermost (shortest) first. What a loop costs a warp an iteration, without a GPU: the
    decode's share of an MXFP4 step, moves a double buffer leaves, loads an iteration (docs/NOTES_moe.md)."""
    import re
    ins = []  # (offset, opcode, branch target or None)
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if m:
            t = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", m.group(3) + m.group(4))
            ins.append((int(m.group(1), 16), m.group(3), int(t.group(1), 16) if t else None))
    loops = []
    for off, op, tgt in ins:
        if op.startswith("BRA") and tgt is not None and tgt < off:
            body = [o for a, o, _ in ins if tgt <= a <= off]
            if len(body) >= min_instructions:
                mix: dict[str, int] = {}
                for o in body:
                    mix[o] = mix.get(o, 0) + 1
                loops.append(dict(start=tgt, end=off, instructions=len(body),
                                  mix=dict(sorted(mix.items(), key=lambda kv: -kv[1]))))
    return sorted(loops, key=lambda d: d["instructions"])


def _loops(cubin: str, tool: str | None, top: int = 8) -> str:
    """One line a loop of the cubin's SASS (loop_mix): instructions an iteration and its `top` opcodes."""
    if tool is None:
        return "    (no cuobjdump found)"
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
    return "\n".join(f"    loop {d['start']:#x}-{d['end']:#x}: {d['instructions']} instructions; "
                     + ", ".join(f"{k} {v}" for k, v in list(d["mix"].items())[:top])
                     for d in loop_mix(sass)) or "    (no loop of 40 or more instructions)"


def _cases(only: str | None, quick: bool):
    """(name, build, args) for every kernel to compile. Imports the DSL."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr

    def P(dt, align=16):
        return make_ptr(dt, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)

    bf, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    S = cuda.CUstream(0)
    B, H, L = 1, 12, 4096
    cases = []
    if only in (None, "prefill"):
        from kernels.cute import kda_prefill as kp
        PC = kp._classes()  # not C: a later loop rebinds C, and these lambdas run after it
        chunks, tiles = kp.PREFILL_CHUNKS, kp.PREFILL_TILES
        if quick:
            chunks, tiles = (16, 64), (16, 128)
        dims = [B, H, L, S]
        for ch in chunks:
            cases.append((f"prefill prep ch{ch}", lambda ch=ch: PC.Prep(ch, -5.0),
                          [P(bf, 2), P(bf, 2), P(bf, 2), P(bf, 2), P(f32, 4), P(f32, 4), P(bf, 2), P(f32), P(f32),
                           P(f32), P(f32), P(f32, 4)] + dims))
            for inv in kp.PREFILL_INVERSES:
                cases.append((f"prefill intra ch{ch} inverse={inv}", lambda ch=ch, inv=inv: PC.Intra(ch, inv == "bf16"),
                              [P(f32)] * 4 + [P(f32, 4)] + [P(f32)] * 3 + dims))
            for tv in tiles:
                for sname, sp in (("fp32", P(f32, 4)), ("bf16", P(bf, 2))):
                    cases.append((f"prefill chunks ch{ch} tile{tv} state={sname}",
                                  lambda ch=ch, tv=tv: PC.Chunks(ch, tv, False), [P(f32)] * 7 + [sp] + dims))
                cases.append((f"prefill chunks-out ch{ch} tile{tv}", lambda ch=ch, tv=tv: PC.Chunks(ch, tv, True),
                              [P(f32)] * 8 + dims))
                cases.append((f"prefill summary ch{ch} tile{tv}", lambda ch=ch, tv=tv: PC.Summary(ch, tv),
                              [P(f32)] * 6 + dims))
        for tv in tiles:
            for sname, sp in (("fp32", P(f32, 4)), ("bf16", P(bf, 2))):
                cases.append((f"prefill scan tile{tv} state={sname}", lambda tv=tv: PC.Scan(tv),
                              [P(f32)] * 3 + [sp, B, H, L // 64, S]))
        cases.append(("prefill norm+conv tail", lambda: PC.Norm(1e-6),
                      [P(f32), P(bf, 8), P(bf, 2), P(bf, 8), P(bf, 2), P(bf, 2)] + dims))
    # decode / verify: the pointer order of kda_decode._kernel_args
    step_args = [P(bf, 2), P(bf, 2), P(bf, 2), P(bf, 8), P(bf, 8), P(f32, 4), P(f32, 4), P(bf, 8), P(f32),
                 P(bf, 2), P(bf, 8), P(f32), P(bf, 2), P(i32, 4), S]
    if only in (None, "decode"):
        from kernels.cute import kda_decode as kd
        for B in (1, 64):  # a resident grid (fast) / a larger one
            for tv in kd.TILES:
                cases.append((f"decode B{B} tile{tv}",
                              lambda B=B, tv=tv: kd._kernel_class()(B, H, 1e-6, -5.0, tv), step_args))
        for B, tv in ((1, 16), (64, 128)):  # programmatic dependent launch
            cases.append((f"decode B{B} tile{tv} pdl",
                          lambda B=B, tv=tv: kd._kernel_class()(B, H, 1e-6, -5.0, tv, pdl=True), step_args))
    if only in (None, "verify"):
        from kernels.cute import kda_verify as kv
        # B = 1: one CTA per SM (preload, delay) and the batched prologue; B = 16: the batched prologue under
        # the register cap; B = 64: neither
        for B in (1, 16, 64):
            for tv, wr in sorted(kv.ROW_WARPS.items(), reverse=True):
                cases.append((f"verify B{B} T4 tile{tv} row_warps{wr}",
                              lambda tv=tv, wr=wr, B=B: kv._kernel_class()(B, H, 4, False, 1e-6, -5.0, tv, wr),
                              step_args))
        # every other row_warps (tile 32), T 2 and 8, ragged, pdl
        for B, T, tv, wr, rg, pdl in [(1, 4, 32, 1, False, False), (1, 4, 32, 2, False, False),
                                      (1, 4, 32, 8, False, False), (1, 2, 16, 4, False, False),
                                      (1, 8, 16, 4, True, False), (5, 8, 16, 4, True, False),
                                      (1, 8, 16, 4, True, True), (5, 8, 16, 4, True, True),
                                      (64, 4, 128, 4, False, True)]:
            name = f"verify B{B} T{T} tile{tv} row_warps{wr}" + (" ragged" if rg else "") + (" pdl" if pdl else "")
            cases.append((name, lambda B=B, T=T, tv=tv, wr=wr, rg=rg, pdl=pdl: kv._kernel_class()(
                B, H, T, rg, 1e-6, -5.0, tv, wr, pdl), step_args))
        # checkpoints (state_hist: every c-th position and the last) at T 8 and 4, at the tiles `auto` takes (16 at
        # B 1, 128 at B 8, 64 from B 16) and the shapes' default row warps (delay at B 1 and 8, the batched prologue
        # to B 16, neither at B 64), ragged and pdl. (Tile 128 at B 64, T 8 is not here: under the 128-register cap
        # it spills at every checkpoint, c = 1 included: about 100 B of stack.)
        for B, T, tv, ck, rg, pdl in [(1, 8, 16, 2, False, False), (1, 8, 16, 4, False, False),
                                      (1, 8, 16, 8, False, False), (1, 8, 16, 3, False, False),
                                      (8, 8, 128, 2, False, False), (8, 8, 128, 8, False, False),
                                      (8, 8, 64, 4, True, False), (16, 8, 64, 8, False, False),
                                      (64, 8, 64, 1, False, False), (64, 8, 64, 2, False, False),
                                      (64, 8, 64, 8, False, False), (64, 8, 64, 4, True, False),
                                      (1, 4, 16, 2, True, True), (5, 8, 16, 8, True, True),
                                      (5, 8, 32, 8, True, True)]:
            wr = kv.default_row_warps(tv, B, H, T)
            name = (f"verify B{B} T{T} tile{tv} row_warps{wr} checkpoint{ck}" + (" ragged" if rg else "")
                    + (" pdl" if pdl else ""))
            cases.append((name, lambda B=B, T=T, tv=tv, wr=wr, rg=rg, pdl=pdl, ck=ck: kv._kernel_class()(
                B, H, T, rg, 1e-6, -5.0, tv, wr, pdl, ck), step_args))
    if only in (None, "attnres"):
        from kernels.cute import attnres_norm as ka
        # the pointer order of attnres_norm.attnres_norm: 9 blocks, prefix, new, w_norm, w_proj, norm_w, out,
        # partial_out; then 9 block strides, the prefix / new / partial_out / out strides and the batch
        combos = [("B1", 1, 7168, 9, "add", None, None, None), ("B64", 64, 7168, 9, "add", None, None, None),
                  ("B1 pdl", 1, 7168, 9, "add", None, None, "pdl"),
                  ("B1 pdl early", 1, 7168, 9, "add", None, None, "pdl early"),
                  ("B1 pdl early none", 1, 7168, 9, "none", None, None, "pdl early")]
        for al in ka.ALPHAS:
            for c in ka.CLUSTERS:
                for v in ka.VECS:
                    try:
                        ka.plan(64, 7168, 9, c, v, alpha=al)
                    except ValueError:
                        continue
                    combos.append((f"cluster{c} vec{v}" + (f" {al}" if al != "threads" else ""), 1, 7168, 9, "add",
                                   c, v, al))
        combos += [("0 blocks none", 1, 7168, 0, "none", None, None, None),
                   ("5 blocks fresh", 1, 7168, 5, "fresh", None, None, None),
                   ("D64 9 blocks add", 1, 64, 9, "add", None, None, None),
                   ("D64 1 block none", 1, 64, 1, "none", None, None, None)]
        combos += [("0 blocks none c8v8 twopass", 1, 7168, 0, "none", 8, 8, "twopass"),  # large-batch shapes
                   ("1 block add c4v8 twopass", 1, 7168, 1, "add", 4, 8, "twopass"),
                   ("5 blocks fresh c2v8 twopass", 1, 7168, 5, "fresh", 2, 8, "twopass"),
                   ("9 blocks none c2v8 twopass", 1, 7168, 9, "none", 2, 8, "twopass"),
                   ("D64 9 blocks add twopass", 1, 64, 9, "add", None, None, "twopass")]
        for name, Bx, D, nb, upd, c, v, al in combos:
            pdl = al in ("pdl", "pdl early")  # the default options launched with PDL (the step's `pdl` switch)
            early = al == "pdl early"  # ... and the module's EARLY: the blocks and the prefix before the wait
            al = (None if pdl else al) or "twopass"  # None: the kernel's default
            cc, vv = ka.plan(Bx, D, nb, c, v, alpha=al)
            pa = [P(bf, 2 * vv)] * 16
            ints = [D] * 9 + [D] * 4 + [Bx]
            thr = ka.threads(D, nb, cc, vv, al)
            # dynamic shared memory: the partials [K][thr + 4], the cluster's slots [C][K], the totals [K], and
            # with twopass alpha's NS, the warps' sums and the second exchange's [C] (each rounded to 16 bytes); CTAs
            # an SM by it (228 KB, 1 KB reserved a CTA)
            K = ka.n_partials(nb, al)
            extra = (nb + 1, thr // 32, cc) if al == "twopass" else ()
            smem = sum(-(-4 * n // 16) * 16 for n in (K * (thr + 4), cc * K, K) + extra)
            cases.append((f"attnres {name} (cluster{cc} vec{vv} thr{thr} dsmem{smem} by-smem"
                          f"{min(32, 233472 // (smem + 1024), 2048 // thr)})",
                          lambda D=D, nb=nb, upd=upd, cc=cc, vv=vv, al=al, pdl=pdl, early=early: ka._kernel_class()(
                              D, nb, upd, cc, vv, 1e-6, al, pdl, early), pa + ints + [S]))
    if only in (None, "router"):
        from kernels.cute import router_topk as kr
        # router_topk's arguments: logits, e_bias, idx (int64), weights; batch, logits row stride, scaling
        rargs = [P(f32, 4), P(f32, 4), P(cutlass.Int64, 8), P(f32, 4), i32(64), i32(896), f32(1.0), S]
        for E, k in ((896, 16), (896, 1), (896, 7), (896, 32), (200, 5), (1024, 16)):
            for pdl in (False, True):
                cases.append((f"router E{E} k{k} warps{kr.warps_for(E)}" + (" pdl" if pdl else ""),
                               lambda E=E, k=k, pdl=pdl: kr._kernel_class()(E, k, pdl), rargs))
    if only in (None, "mla_cache_write"):
        from kernels.cute import mla_cache_write as kw
        # mla_cache_write's arguments: kv, kv_norm, cache (bf16, or fp8 rows as int32 words), scale, block table,
        # lengths; eps, B*T, T, kv strides, S_max, table row stride
        def wargs(mode, kv_dt=bf, len_dt=i32):
            cache = P(bf, 16) if mode == 0 else P(i32, 16)
            return [P(kv_dt, 4 * kv_dt.width // 8), P(bf, 8), cache, P(f32, 4), P(i32, 4), P(len_dt, len_dt.width // 8),
                    f32(1e-6), i32(64 * 4), i32(4), i32(4 * 576), i32(576), i32(4096), i32(64), S]
        for fmt, mode in kw.MODES.items():
            for page in (0, 1, 16, 64):
                for pdl in (False, True):
                    where = f"page{page}" if page else "contiguous"
                    cases.append((f"mla_cache_write {fmt} {where}" + (" pdl" if pdl else ""),
                                  lambda mode=mode, page=page, pdl=pdl: kw._kernel_class()(mode, page > 0, page, pdl),
                                  wargs(mode)))
        cases.append(("mla_cache_write token page64 int64 lengths", lambda: kw._kernel_class()(2, True, 64),
                      wargs(2, len_dt=cutlass.Int64)))
        cases.append(("mla_cache_write bf16 page64 fp32 kv", lambda: kw._kernel_class()(0, True, 64),
                      wargs(0, kv_dt=f32)))
        cases.append(("mla_cache_write bf16 page64 tree sum", lambda: kw._kernel_class()(0, True, 64, False, "tree"),
                      wargs(0)))
    if only in (None, "proj"):
        from kernels.cute import proj_gemv as kg
        # proj's arguments: x, W, residual, six output pointers, x's row stride, six output row strides; the fused
        # selection's e_bias, idx, weights, counter and scaling; the chained projection's w2, f and f's row stride;
        # rmsp's partials and eps; fp8 weights' row scales (W as int32 words of four e4m3 codes)
        def gargs(o_dts, fp8=False):
            return ([P(bf, 16), P(i32 if fp8 else bf, 16), P(bf, 2)] + [P(dt, dt.width // 8) for dt in o_dts]
                    + [i32(7168)] * 7 + [P(f32, 4), P(cutlass.Int64, 8), P(f32, 4), P(i32, 4), cutlass.Float32(1.0),
                                         P(bf, 16), P(bf, 2), i32(1536), P(f32, 4), cutlass.Float32(1e-6),
                                         P(f32, 4) if fp8 else P(bf, 4), S])
        moe_in = (896, 4480, 5248, 6016)  # TP8: router, latent down, shared w1, shared w3
        for B, N, K, ends, res, pdl, o_dts, k in (
                (1, 4608, 7168, (4608,), False, False, [bf] * 6, 0),
                (1, 576, 7168, (576,), True, True, [bf] * 6, 0),
                (8, 7168, 1536, (7168,), True, False, [bf] * 6, 0),
                (16, 4608, 7168, (1536, 3072, 4608), False, False, [f32] + [bf] * 5, 0),
                (3, 64, 520, (64,), True, False, [bf] * 6, 0),  # a partial last step
                (1, 6016, 7168, moe_in, False, True, [f32] + [bf] * 5, 16),
                (1, 6016, 7168, moe_in, False, False, [f32] + [bf] * 5, 16),
                (4, 6016, 7168, moe_in, False, True, [f32] + [bf] * 5, 16),
                (2, 232, 64, (202, 232), False, True, [f32] + [bf] * 5, 16)):
            name = (f"proj B{B} N{N} K{K} outs{len(ends)}" + (" residual" if res else "") + (" pdl" if pdl else "")
                    + (f" select{k}" if k else ""))
            cases.append((name, lambda B=B, N=N, K=K, e=ends, r=res, p=pdl, k=k: kg._kernel_class()(
                B, N, K, e, r, p, k), gargs(o_dts)))
        # fp8 weights: kda_q, kda_o with the residual (K 1536: three 512-column steps), moe_down, the MLA input group,
        # a partial last step (K 528)
        for B, N, K, ends, res, pdl, o_dts in (
                (1, 1536, 7168, (1536,), False, True, [bf] * 6),
                (4, 7168, 1536, (7168,), True, True, [bf] * 6),
                (1, 3584, 7168, (3584,), False, False, [bf] * 6),
                (2, 3648, 7168, (1536, 2112, 3648), False, True, [bf, f32] + [bf] * 4),
                (3, 64, 528, (64,), True, False, [bf] * 6)):
            name = f"proj fp8 B{B} N{N} K{K} outs{len(ends)}" + (" residual" if res else "") + (" pdl" if pdl else "")
            cases.append((name, lambda B=B, N=N, K=K, e=ends, r=res, p=pdl: kg._kernel_class()(
                B, N, K, e, r, p, 0, None, None, None, True), gargs(o_dts, fp8=True)))
        kda_in = (128, 4736, 6272, 6284)  # TP8, fa first: fa, q|k|v, g, beta; chained: f = W_fb fa (1536 x 128)
        for B, pdl in ((1, True), (1, False), (4, True)):
            cases.append((f"proj B{B} N6284 K7168 outs4 chain1536x128" + (" pdl" if pdl else ""),
                          lambda B=B, pdl=pdl: kg._kernel_class()(B, 6284, 7168, kda_in, False, pdl, 0, (1536, 128)),
                          gargs([bf] * 6)))
        # the MoE output's glue folded: moe_in's shared rows [w1 | w3] stored as situ (glu), moe_out's rms segment
        for B, pdl in ((1, True), (1, False), (4, True)):
            cases.append((f"proj B{B} N6016 K7168 outs3 select16 glu" + (" pdl" if pdl else ""),
                          lambda B=B, pdl=pdl: kg._kernel_class()(B, 6016, 7168, (896, 4480, 6016), False, pdl, 16,
                                                                  None, None, (4.0, 25.0)), gargs([f32] + [bf] * 5)))
            cases.append((f"proj B{B} N7168 K4352 residual rmsp3584x896" + (" pdl" if pdl else ""),
                          lambda B=B, pdl=pdl: kg._kernel_class()(B, 7168, 4352, (7168,), True, pdl, 0, None,
                                                                  (3584, 896)), gargs([bf] * 6)))
    if only in (None, "proj_mma"):
        from kernels.cute import proj_mma as kq
        # x and W as int32 words, the row scales (fp8; else x's, unread), the residual, six outputs,
        # x's row stride and six output row strides
        def qargs(o_dts, fp8):
            return ([P(i32, 16), P(i32, 16), P(f32, 4), P(bf, 2)]
                    + [P(dt, dt.width // 8) for dt in o_dts] + [i32(7168)] * 7 + [S])
        # (the plan's tile_m and cluster at 132 SMs: kda_q 32 / 8, moe_down 64 / 8, kda_o 64 / 4, mla_dkv 16 / 8)
        for B, N, K, ends, res, pdl, fp8, C, TM, o_dts in (
                (2, 1536, 7168, (1536,), False, True, False, 8, 32, [bf] * 6),      # TP8 kda_q
                (8, 1536, 7168, (1536,), False, True, False, 8, 32, [bf] * 6),
                (16, 1536, 7168, (1536,), False, True, False, 8, 32, [bf] * 6),
                (4, 1536, 7168, (1536,), False, True, True, 8, 32, [bf] * 6),
                (8, 1536, 7168, (1536,), False, True, True, 8, 32, [bf] * 6),
                (16, 1536, 7168, (1536,), False, False, True, 8, 32, [bf] * 6),
                (8, 3584, 7168, (3584,), False, True, True, 8, 64, [bf] * 6),       # TP8 moe_down
                (8, 7168, 1536, (7168,), True, True, False, 4, 64, [bf] * 6),       # TP8 kda_o with the residual
                (8, 7168, 1536, (7168,), True, True, True, 4, 64, [bf] * 6),
                (8, 576, 7168, (576,), False, True, True, 8, 16, [bf] * 6),         # TP8 mla_dkv
                (8, 3648, 7168, (1536, 2112, 3648), False, True, True, 8, 64, [bf, f32] + [bf] * 4)):  # MLA group
            name = (f"proj_mma {'fp8' if fp8 else 'bf16'} B{B} N{N} K{K} C{C} M{TM} outs{len(ends)}"
                    + (" residual" if res else "") + (" pdl" if pdl else ""))
            cases.append((name, lambda B=B, N=N, K=K, e=ends, r=res, p=pdl, f=fp8, c=C, tm=TM: kq._kernel_class()(
                B, N, K, e, r, p, f, c, kq.UNROLL, kq.CHAINS, tm, kq.X_SMEM), qargs(o_dts, fp8)))
            if len(ends) == 1 and K == 7168:  # x from global memory in the rounds (X_SMEM off)
                cases.append((name + " x_global", lambda B=B, N=N, K=K, e=ends, r=res, p=pdl, f=fp8, c=C, tm=TM:
                              kq._kernel_class()(B, N, K, e, r, p, f, c, kq.UNROLL, kq.CHAINS, tm, False),
                              qargs(o_dts, fp8)))
    if only in (None, "l2_prefetch"):
        from kernels.cute import l2_prefetch as kl
        # W's int32 words, the record's int32 words; TP8 kda_in's weight (6284 x 7168) at the plan's dot-path
        # split (1792 columns) and a 512-column span, bf16 and fp8, prefetching and recording
        for esize in (2, 1):
            for rec in (False, True):
                cases.append((f"l2_prefetch N6284 K7168 ksplit1792 span512 e{esize}" + (" record" if rec else ""),
                              lambda e=esize, r=rec: kl._kernel_class()(6284, 7168, 1792, 512, e, r),
                              [P(i32, 16), P(i32, 8), S]))
    if only in (None, "moe"):
        from kernels.cute import moe_experts as km
        # MoEUp: z, idx, wk, w1, w3, s1, s3, act; MoEDown: idx, w2, s2, act, y, gamma, yg, ssp; (K, I, L, E, idx step,
        # ...; the down kernel's latent rows a CTA)
        m_up, m_down = km._kernel_classes()  # own names: lambdas run later
        uargs = [P(i32, 16), P(i32, 4), P(f32, 4), P(i32, 16), P(i32, 16), P(i32, 4), P(i32, 4), P(i32, 16), S]
        dargs = [P(i32, 4), P(i32, 16), P(i32, 4), P(i32, 16), P(f32, 4), P(bf, 2), P(bf, 2), P(f32, 4), S]
        for K, I, L, E, step, pdl, R in ((16, 384, 3584, 896, 2, False, 4), (16, 384, 3584, 896, 1, True, 4),
                                         (16, 384, 3584, 896, 1, True, 6),  # the step's: UP_ROWS 6, pdl
                                         (16, 384, 3584, 896, 2, False, 8), (16, 192, 3584, 896, 2, False, 4),
                                         (3, 128, 128, 6, 2, False, 4)):
            tag = f"K{K} I{I} L{L}" + (" pdl" if pdl else "") + f" rows {R}"
            cases.append((f"moe up {tag}", lambda K=K, I=I, L=L, E=E, st=step, p=pdl, r=R:
                          m_up(K, I, L, E, st, 4.0, 25.0, p, r), uargs))
            cases.append((f"moe down {tag}", lambda K=K, I=I, L=L, E=E, st=step, r=R: m_down(K, I, L, E, st, r),
                          dargs))
        # the MoE output's routed norm folded: yg = bf16(y gamma) and a partial sum of y^2 a CTA
        cases.append(("moe down K16 I384 L3584 rows 4 glue", lambda: m_down(16, 384, 3584, 896, 2, 4, True), dargs))
        for R in (6, 8, 12, 16):  # the up kernel's two thread groups (UP_HALVES 2) at the step's shape, TP8 and TP16
            for I in (384, 192):
                cases.append((f"moe up K16 I{I} L3584 pdl rows {R} halves 2", lambda R=R, I=I:
                              m_up(16, I, 3584, 896, 1, 4.0, 25.0, True, R, 2), uargs))
    if only in (None, "moe_grouped"):
        from kernels.cute import moe_grouped as kmg
        # Up: z, idx, wk, w1, w3, s1, s3, act, y; Down: idx, w2, s2, act, y; (B, K, I, L, idx step, ...)
        g_up, g_down = kmg._kernel_classes()
        # up: z, idx, wk, w1, w3, s1, s3, act, y, the UP_LSPLIT parts' workspace and tickets (moe_grouped's up_args)
        uargs = [P(i32, 16), P(i32, 4), P(f32, 4), P(i32, 16), P(i32, 16), P(i32, 4), P(i32, 4), P(i32, 16),
                 P(f32, 16), P(f32, 16), P(i32, 4), S]
        dargs = [P(i32, 4), P(i32, 16), P(i32, 4), P(i32, 16), P(f32, 16), S]
        for Bt, K, I, L, step, pdl in ((64, 16, 384, 3584, 2, True), (8, 16, 384, 3584, 1, False),
                                       (2, 16, 384, 3584, 2, False), (64, 16, 192, 3584, 2, True),
                                       (3, 3, 64, 256, 2, False)):
            split, tiles = kmg.shape_config(Bt * K)   # the shape the wrapper picks for these pairs
            shares = [kmg.share_config(L, split, tiles, Bt * K)]
            if Bt == 8 or (Bt == 64 and I == 384):
                shares.append((1, 1))                     # sharing off
            for us, ds in shares:
                ls = kmg.lsplit_config(Bt * K, split, us)  # the wrapper's choice
                tag = (f"B{Bt} K{K} I{I} L{L} split{split} tiles{tiles} share{us}x{ds}" + (" lsplit" if ls else "")
                       + (" pdl" if pdl else ""))
                cases.append((f"moe_grouped up {tag}", lambda B_=Bt, K=K, I=I, L=L, st=step, p=pdl, sp=split, h=us,
                              ls=ls: g_up(B_, K, I, L, st, 4.0, 25.0, p, sp, h, kmg.SHARE_FROM, ls), uargs))
                cases.append((f"moe_grouped down {tag}", lambda B_=Bt, K=K, I=I, L=L, st=step, dt=tiles, h=ds:
                              g_down(B_, K, I, L, st, dt, h, kmg.SHARE_FROM, I % 128 == 0), dargs))
    if only in (None, "moe_dense"):
        from kernels.cute import moe_dense as kmd
        # DenseUp: z, idx, wk, w1, w3, s1, s3, act; DenseDown: idx, w2, s2, act, y; bf16 weights as BFloat16, fp8 as
        # int32 words; (K, I, L, E, idx step, ...)
        d_up, d_down = kmd._kernel_classes()
        for fp8 in (False, True):
            w = i32 if fp8 else bf
            uargs = [P(bf, 16), P(i32, 4), P(f32, 4), P(w, 16), P(w, 16), P(f32, 4), P(f32, 4), P(f32, 16), S]
            dargs = [P(i32, 4), P(w, 16), P(f32, 4), P(f32, 16), P(f32, 4), S]
            for K, I, L, E, step, pdl, ru, rd in ((16, 384, 3584, 896, 2, True, kmd.UP_ROWS, kmd.DOWN_ROWS),
                                                  (16, 192, 3584, 896, 1, False, kmd.UP_ROWS, kmd.DOWN_ROWS),
                                                  (16, 384, 3584, 896, 2, True, 8, 8),
                                                  (3, 128, 128, 6, 2, False, 1, 1)):
                tag = f"{'fp8' if fp8 else 'bf16'} K{K} I{I} L{L}" + (" pdl" if pdl else "") + f" rows {ru}x{rd}"
                cases.append((f"moe_dense up {tag}", lambda K=K, I=I, L=L, E=E, st=step, p=pdl, r=ru, f=fp8:
                              d_up(K, I, L, E, st, 4.0, 25.0, p, r, f), uargs))
                cases.append((f"moe_dense down {tag}", lambda K=K, I=I, L=L, E=E, st=step, r=rd, f=fp8:
                              d_down(K, I, L, E, st, r, f), dargs))
    if only in (None, "moe_dense"):  # grouped: Up z, idx, wk, w1, w3, s1, s3, act, y; Down idx, w2, s2, act, y
        from kernels.cute import moe_dense as kmd
        gup, gdown = kmd._grouped_classes()
        for fp8 in (False, True):
            uargs = [P(i32, 16), P(i32, 4), P(f32, 4), P(i32, 16), P(i32, 16), P(f32, 4), P(f32, 4), P(i32, 16),
                     P(f32, 16), S]
            dargs = [P(i32, 4), P(i32, 16), P(f32, 4), P(i32, 16), P(f32, 16), S]
            for Bt, K, I, L, step, pdl in ((64, 16, 384, 3584, 2, False), (8, 16, 384, 3584, 1, True),
                                           (16, 16, 192, 3584, 2, False), (3, 3, 64, 256, 2, False)):
                tag = f"{'fp8' if fp8 else 'bf16'} B{Bt} K{K} I{I} L{L}" + (" pdl" if pdl else "")
                cases.append((f"moe_dense grouped up {tag}", lambda B_=Bt, K=K, I=I, L=L, st=step, p=pdl, f=fp8:
                              gup(B_, K, I, L, st, 4.0, 25.0, p, f), uargs))
                cases.append((f"moe_dense grouped down {tag}", lambda B_=Bt, K=K, I=I, L=L, st=step, f=fp8:
                              gdown(B_, K, I, L, st, f, kmd.GROUP_DOWN_TILES), dargs))
    if only in (None, "mla_combine"):
        from kernels.cute import mla_combine as kc
        # mla_combine's arguments: o partials, lse, Wuv, gate, out; (H, K, T, rows, rows a CTA, pdl)
        cargs = [P(f32, 16), P(f32, 4), P(bf, 16), P(bf, 2), P(bf, 2), S]
        for H, K, T, NR, RB, pdl in ((12, 1, 1, 1, 1, False), (12, 1, 1, 1, 1, True), (12, 132, 1, 1, 1, False),
                                     (12, 4, 1, 64, 4, True), (12, 1, 4, 256, 4, False), (6, 8, 2, 16, 8, False)):
            cases.append((f"mla_combine H{H} K{K} T{T} rows{NR} rb{RB}" + (" pdl" if pdl else ""),
                          lambda H=H, K=K, T=T, NR=NR, RB=RB, pdl=pdl: kc._kernel_class()(H, K, T, NR, RB, pdl), cargs))
    if only in (None, "mla_query"):
        from kernels.cute import mla_query as kmq  # not kq: proj_mma's lambdas read kq when they run
        # mla_query's arguments: cq, q_norm, Wuq, Wuk, q_lat, q_rope; cq's row stride, q_lat's and q_rope's batch and
        # head strides, eps; (B, H, Q, Dn, Dr, C, pdl)
        qargs = [P(bf, 16), P(bf, 16), P(bf, 16), P(bf, 16), P(bf, 2), P(bf, 2), i32(1536), i32(512), i32(512),
                 i32(2304), i32(192), cutlass.Float32(1e-6), S]
        for B, H, Q, Dn, Dr, C, pdl in ((1, 12, 1536, 128, 64, 512, True), (1, 12, 1536, 128, 64, 512, False),
                                        (4, 12, 1536, 128, 64, 512, True), (1, 6, 1536, 128, 64, 512, True),
                                        (3, 3, 264, 32, 16, 64, False)):
            cases.append((f"mla_query B{B} H{H} Q{Q} C{C}" + (" pdl" if pdl else ""),
                          lambda B=B, H=H, Q=Q, Dn=Dn, Dr=Dr, C=C, pdl=pdl:
                          kmq._kernel_class()(B, H, Q, Dn, Dr, C, pdl), qargs))
    if only in (None, "mla_decode"):
        from kernels.cute import mla_decode as kdm
        # mla_decode's arguments: q_lat, q_rope, kv (int32 words), block table, lengths, o, lse; B, P, PL, the block
        # table's row stride, S_max, the queries' batch and head strides (words), the score scale; (H, cluster, stages,
        # page, lengths step, pdl)
        dargs = [P(i32, 8), P(i32, 8), P(i32, 16), P(i32, 4), P(i32, 4), P(f32, 16), P(f32, 4), i32(1), i32(16),
                 i32(64), i32(128), i32(0), i32(3072), i32(256), i32(384), i32(32), cutlass.Float32(0.1), S]
        for H, CL, STG, page, ls, pdl, pipe in ((12, 8, 4, 64, 1, False, False), (12, 8, 4, 64, 2, True, False),
                                                (12, 4, 2, 0, 1, False, False), (6, 1, 3, 16, 1, False, False),
                                                (16, 2, 4, 1, 2, True, False), (12, 2, 4, 64, 1, False, True),
                                                (12, 4, 4, 64, 1, True, True)):
            cases.append((f"mla_decode H{H} cluster{CL} stages{STG} page{page}" + (" pdl" if pdl else "")
                          + (" pipe" if pipe else ""),
                          lambda H=H, CL=CL, STG=STG, page=page, ls=ls, pdl=pdl, pipe=pipe:
                          kdm._kernel_class()(H, CL, STG, page, ls, pdl, pipe), dargs))
    return cases


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = None
    for i, a in enumerate(argv):
        if a == "--only" and i + 1 < len(argv):
            only = argv[i + 1]
        elif a.startswith("--only="):
            only = a.split("=", 1)[1]
    if only not in (None, "prefill", "decode", "verify", "attnres", "router", "mla_cache_write", "mla_combine", "proj",
                    "proj_mma", "l2_prefetch", "moe", "moe_grouped", "moe_dense", "mla_query", "mla_decode"):
        print(f"--only must be prefill, decode, verify, attnres, router, mla_cache_write, mla_combine, proj, proj_mma, "
              f"l2_prefetch, moe, moe_grouped, moe_dense, mla_query or mla_decode (got {only!r})")
        return 2
    quick = "--quick" in argv
    keep = None  # --keep DIR: copy each configuration's cubin to DIR/<name>.cubin (to diff SASS across commits)
    for i, a in enumerate(argv):
        if a == "--keep" and i + 1 < len(argv):
            keep = argv[i + 1]
        elif a.startswith("--keep="):
            keep = a.split("=", 1)[1]
    if keep:
        os.makedirs(keep, exist_ok=True)
    # min_blocks_per_mp > 1 asks the device for its shared memory per SM: answer for an H100/H200
    import cutlass.cutlass_dsl.cutlass as _cd
    _cd.cuda_helpers.get_device_attribute = lambda *a, **k: 233472
    from cutlass import cute

    tool = _cuobjdump()
    bad = 0
    t0 = time.time()
    print(f"arch {os.environ['CUTE_DSL_ARCH']}; cubins in {_DUMP}")
    for name, build, args in _cases(only, quick):
        for f in glob.glob(os.path.join(_DUMP, "*.cubin")):  # file names repeat across configurations
            os.remove(f)
        try:
            cute.compile(build(), *args)
        except Exception as e:  # noqa: BLE001  (report and go on)
            bad += 1
            print(f"{name:<44} FAILED: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}", flush=True)
            if os.environ.get("K3_SHOW_ERRORS"):
                print(str(e))
            continue
        new = glob.glob(os.path.join(_DUMP, "*.cubin"))
        if keep and len(new) == 1:
            shutil.copyfile(new[0], os.path.join(keep, name.replace(" ", "_").replace("=", "") + ".cubin"))
        use = _usage(new[0], tool) if len(new) == 1 else f"({len(new)} cubins written)"
        if "LOCAL:" in use and "LOCAL:0" not in use:
            bad += 1
            use += "   <- local memory (spills)"
        elif name.startswith("attnres") and "STACK:0" not in use:  # its spills show as a stack frame
            bad += 1
            use += "   <- stack (spills)"
        if name.startswith("attnres") and "REG:" in use:  # CTAs an SM by registers (a warp's in units of 256)
            reg = int(use.split("REG:")[1].split()[0])
            thr = int(name.split(" thr")[1].split()[0])
            use += f" by-reg{65536 // (-(-thr // 32) * (-(-reg * 32 // 256) * 256))}"
        print(f"{name:<44} {use}", flush=True)
        if "--loops" in argv and len(new) == 1:
            print(_loops(new[0], tool), flush=True)
    print(f"{'ALL COMPILED, NO LOCAL MEMORY' if not bad else f'{bad} PROBLEM(S)'}  [{time.time() - t0:.0f}s]")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
