"""Sweep the Triton KDA decode / verify launch configurations on a GPU (run on the next GPU session).

    python kernels/triton/tune_kda.py                  # the full sweep below; JSON to $OUT/tune_kda.json if OUT is set
    python kernels/triton/tune_kda.py --quick          # fewer configs (tile_v 8/16/32/128, num_stages 1)
    python kernels/triton/tune_kda.py --regs-only      # no GPU needed: compile for sm_90a, print ptxas registers/spills

Cases (12 heads, D = 128, fp32 state): decode B in {1, 64}; verify T in {4, 8} x B in {1, 8} (uniform lengths).
Configs: tile_v x num_warps x num_stages. Every config is first checked once against the fp64 reference
(k3lab.bench.kda.check_component semantics: bf16 out 1e-2, fp32 state / state_hist 1e-4, conv state exact),
then timed with k3lab.harness.timing.bench_gpu: CUDA-graph replay, inputs rotated over enough sets that the
state is not served from L2 (k3lab.bench.kda.make_set / rotation_count, as `k3lab bench kda` does).
Columns: median / p10 us, achieved TB/s on k3lab.bench.kda.kda_bytes, n_regs / n_spills from Triton's compiled
kernel handle. The best correct config per case is printed last: copy it into default_num_warps (decode) /
the component defaults by hand after looking at the table.
num_stages is expected to be inert (neither kernel has a loop left to pipeline); it is swept to confirm that.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HEADS, D = 12, 128
DECODE_B = (1, 64)
VERIFY_TB = ((4, 1), (4, 8), (8, 1), (8, 8))
TILES = (4, 8, 16, 32, 64, 128)
WARPS = (1, 2, 4, 8)
STAGES = (1, 2, 3)


def _configs(quick: bool):
    tiles = (8, 16, 32, 128) if quick else TILES
    stages = (1,) if quick else STAGES
    for tv in tiles:
        for nw in WARPS:
            if nw * 32 > D * tv:  # more threads than state elements: pointless
                continue
            for ns in stages:
                yield tv, nw, ns


def _launcher(case, s, tv, nw, ns):
    """Zero-arg callable running one config on input set `s`; returns the compiled-kernel handle."""
    from k3lab_kernels.triton.kda_decode import _launch_decode
    from k3lab_kernels.triton.kda_verify import _launch_verify

    a = [s["inp"][k] for k in ("qkv", "f", "b", "gate")]
    if case.T == 1:
        return lambda: _launch_decode(*a, s["p"], s["state"], s["conv_state"], s["out"], tv, nw, ns)
    return lambda: _launch_verify(*a, s["p"], s["state"], s["conv_state"], s["out"], s["state_hist"],
                                  s["conv_hist"], None, tv, nw, ns)


def _check(case, s, tv, nw, ns) -> dict:
    """One run on a poisoned copy of `s` against the fp64 reference."""
    from k3lab.bench import kda as kb

    truth = kb.fp64_truth(case, s)
    t = kb.clone_set(s)
    t["out"].fill_(float("nan"))
    if case.T > 1:
        t["state_hist"].fill_(float("nan"))
    handle = _launcher(case, t, tv, nw, ns)()
    torch.cuda.synchronize()
    if case.T == 1:
        errs = kb._errs(case, t["out"], truth[0], t["state"], truth[1], torch.equal(t["conv_state"], truth[2]))
    else:
        errs = kb._errs(case, t["out"], truth[0], t["state_hist"], truth[1], torch.equal(t["conv_hist"], truth[2]))
    errs["n_regs"] = getattr(handle, "n_regs", None)
    errs["n_spills"] = getattr(handle, "n_spills", None)
    return errs


def sweep(quick: bool = False, reps: int = 50, log=print) -> list[dict]:
    from k3lab.bench import kda as kb
    from k3lab.harness import timing

    cases = [kb.KDACase(HEADS, B, 1, D=D) for B in DECODE_B]
    cases += [kb.KDACase(HEADS, B, T, D=D) for T, B in VERIFY_TB]
    rows = []
    for case in cases:
        nbytes = kb.kda_bytes(case)
        n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes()))
        sets = [kb.make_set(case, seed=1000 + i, device="cuda") for i in range(n_sets)]
        op = "decode" if case.T == 1 else "verify"
        log(f"\n== {op} B={case.batch} T={case.T} H={HEADS} D={D}: {nbytes / 1e6:.2f} MB/call, {n_sets} input sets")
        log(f"{'tile_v':>6} {'warps':>5} {'stages':>6} {'median_us':>9} {'p10_us':>7} {'TB/s':>6} "
            f"{'regs':>4} {'spill':>5}  check")
        for tv, nw, ns in _configs(quick):
            row = dict(op=op, batch=case.batch, T=case.T, heads=HEADS, D=D, tile_v=tv, num_warps=nw,
                       num_stages=ns, bytes=nbytes)
            try:
                row.update(_check(case, sets[0], tv, nw, ns))
                fns = [_launcher(case, s, tv, nw, ns) for s in sets]
                tm = timing.bench_gpu(lambda fn: fn(), input_sets=[(fn,) for fn in fns], reps=reps,
                                      bytes_per_call=nbytes)
                row.update(median_us=tm.median_us, p10_us=tm.p10_us, p90_us=tm.p90_us, note=tm.note,
                           tbps=nbytes / (tm.median_us * 1e-6) / 1e12)
                ok = "ok" if row["ok"] else f"FAIL out {row['out_err']:.1e} state {row['state_err']:.1e}"
                log(f"{tv:>6} {nw:>5} {ns:>6} {tm.median_us:>9.2f} {tm.p10_us:>7.2f} {row['tbps']:>6.2f} "
                    f"{str(row['n_regs']):>4} {str(row['n_spills']):>5}  {ok}")
            except Exception as e:  # noqa: BLE001 - the row records what failed
                row.update(error=f"{type(e).__name__}: {e}"[:400], ok=False)
                log(f"{tv:>6} {nw:>5} {ns:>6} ERROR {row['error'][:120]}")
            rows.append(row)
        del sets
        torch.cuda.empty_cache()
    log("\n== best correct config per case (median us)")
    for key in sorted({(r["op"], r["batch"], r["T"]) for r in rows}):
        good = [r for r in rows if (r["op"], r["batch"], r["T"]) == key and r.get("ok") and "median_us" in r]
        if good:
            b = min(good, key=lambda r: r["median_us"])
            log(f"{key[0]:>6} B={key[1]:<3} T={key[2]}: tile_v {b['tile_v']}, {b['num_warps']} warps, "
                f"{b['num_stages']} stages: {b['median_us']:.2f} us ({b['tbps']:.2f} TB/s)")
    return rows


# ---- offline register report (no GPU: compile for sm_90a and read the cubin's resource usage) ----

def regs_only(quick: bool = False, log=print) -> list[dict]:
    """ptxas registers / stack (spill) bytes per config, compiled for sm_90a without a device. The
    signature mirrors what the JIT specializes at run time (pointers 16-byte aligned, H=12 unspecialized)."""
    import inspect
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3lab_kernels.triton.kda_decode import _kda_decode_kernel
    from k3lab_kernels.triton.kda_verify import _kda_verify_kernel

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    types = dict(qkv="*bf16", f_ptr="*bf16", b_ptr="*bf16", gate_ptr="*bf16", conv_w="*bf16", A_log="*fp32",
                 dt_bias="*fp32", o_norm_w="*bf16", state="*fp32", conv_state="*bf16", out="*bf16",
                 scr_o="*fp32", counter="*i32", H="i32", eps="fp32", lb="fp32", scale="fp32",
                 state_hist="*fp32", conv_hist="*bf16", lengths="*i32")

    def compile_one(fn, consts, nw, ns):
        names = list(inspect.signature(fn.fn).parameters)
        sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns})
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "k.cubin")
            with open(p, "wb") as fh:
                fh.write(k.asm["cubin"])
            txt = subprocess.run([cuobjdump, "--dump-resource-usage", p], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", txt)
        return (int(m[1]), int(m[2])) if m else (None, None)

    rows = []
    log(f"{'op':>6} {'T':>2} {'tile_v':>6} {'warps':>5} {'regs':>4} {'stack_B':>7}")
    for T in (1, 4, 8):
        for tv, nw, ns in _configs(quick):
            if ns != 1:
                continue
            if T == 1:
                regs, stack = compile_one(_kda_decode_kernel, dict(D=D, TV=tv, NT=D // tv, W=4), nw, ns)
            else:
                regs, stack = compile_one(_kda_verify_kernel, dict(T=T, TP=triton.next_power_of_2(T), D=D, TV=tv,
                                                                   NT=D // tv, W=4, RAGGED=False), nw, ns)
            op = "decode" if T == 1 else "verify"
            rows.append(dict(op=op, T=T, tile_v=tv, num_warps=nw, regs=regs, stack_bytes=stack))
            log(f"{op:>6} {T:>2} {tv:>6} {nw:>5} {regs:>4} {stack:>7}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--regs-only", action="store_true")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.regs_only:
        os.environ.pop("TRITON_INTERPRET", None)
        rows, kind = regs_only(a.quick), "regs-only"
    else:
        if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
            print("tune_kda needs a CUDA GPU without TRITON_INTERPRET (use --regs-only on a CPU)", file=sys.stderr)
            return 2
        rows, kind = sweep(a.quick, a.reps), "gpu"
    out_dir = os.environ.get("OUT")
    if out_dir:
        meta = dict(kind=kind, seconds=round(time.time() - t0, 1), torch=torch.__version__,
                    device=torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
        with open(os.path.join(out_dir, f"tune_kda{'_regs' if a.regs_only else ''}.json"), "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
