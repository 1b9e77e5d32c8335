"""Two rows a warp in the CuTe DSL GEMV (kernels/cute/proj_gemv.py `rows`), twentieth session: whether a grid that
fits on the GPU in one wave beats one row a warp at batch 1.

One row a warp: a K = 7168 group of ~6k rows is ~1.5k CTAs of 4 warps, at 44-54 registers 9-10 CTAs an SM (1.2-1.3k
resident), so 12-20 % of the CTAs start late and stream their rows with most of the GPU idle. Two rows a warp halve
the grid (72 registers: 7 CTAs an SM, every CTA resident) and load x once for both rows.

Cases (TP8, batch 1, pdl on as in the step, weights rotated past L2): the KDA input group, the MoE input group with
the fused selection, the MLA input group, kda_o with its residual, moe_down. Each variant is checked first (outputs
against fp64 within 1e-2 of the largest value, the selection bit-equal to rows=1's).

    python experiments/proj_rows/bench.py $OUT     (PYTHONPATH=$PWD and the cute site)  ->  $OUT/proj_rows.json

Runs at commit f17621a (the kernel's `rows` knob was removed after the step A/B: README.md here).
"""
import json
import sys

import torch

import k3lab  # noqa: F401 - maps kernels/ to k3lab_kernels in a checkout that is not installed
from k3lab import registry
from k3lab.harness import env as envmod, timing
from k3lab.ops import trunk as trunk_ops
from k3lab_kernels.cute import proj_gemv as kg
from k3lab_kernels.triton.pdl import pdl_chain

GROUP, PROJ = registry.get("proj_group"), registry.get("proj")
CASES = (("group", "kda_in", False), ("group", "moe_in", True), ("group", "mla_in", False), ("proj", "kda_o", True),
         ("proj", "moe_down", False))


def make(kind, name, flag, seed):
    if kind == "group":
        c = GROUP.case(preset="tp8", group=name, batch=1, wdtype="bf16", select=flag)
        d = GROUP.make_inputs(c, seed, "cuda")
        n = len(trunk_ops._parts(c))
    else:
        c = PROJ.case(preset="tp8", proj=name, batch=1, wdtype="bf16", residual=flag, prologue="none")
        d = PROJ.make_inputs(c, seed, "cuda")
        n = 1
    return c, d, n


def call(kind, flag, d, n, rows):
    outs = [d[f"y{i}"] for i in range(n)]
    sel = (d["e_bias"], d["idx"], d["weights"], 1.0) if (kind == "group" and flag) else None
    res = d.get("residual") if (kind == "proj" and flag) else None
    with pdl_chain(True):
        kg.proj(d["x"], d["w"], outs, residual=res, select=sel, rows=rows)


def main(out, reps=30):
    pr = timing.probes()
    rows_out = []
    for kind, name, flag in CASES:
        base = None
        for rows in (1, 2):
            c, d, n = make(kind, name, flag, 3)
            call(kind, flag, d, n, rows)
            torch.cuda.synchronize()
            y = torch.cat([d[f"y{i}"].double() for i in range(n)], 1)
            want = d["x"].double() @ d["w"].double().T
            if kind == "proj" and flag:
                want = want + d["residual"].double()
            err = float((y - want).abs().max() / want.abs().max())
            ok = err < 1e-2
            same = True
            if kind == "group" and flag:
                if base is None:
                    base = (d["idx"].clone(), d["weights"].clone())
                same = bool(torch.equal(base[0], d["idx"]) and torch.equal(base[1], d["weights"]))
            nbytes = (GROUP if kind == "group" else PROJ).nbytes(c)

            def fn(*ts, kind=kind, flag=flag, n=n, rows=rows, keys=tuple(d)):
                call(kind, flag, dict(zip(keys, ts)), n, rows)

            def mk(kind=kind, name=name, flag=flag):
                return tuple(make(kind, name, flag, int(torch.randint(0, 1 << 30, (1,))))[1].values())

            t = timing.bench_gpu(fn, make_inputs=mk, reps=reps, bytes_per_call=nbytes)
            floor = nbytes / (pr["read_tbps"] * 1e6)
            rows_out.append(dict(case=f"{kind}:{name}" + ("+select" if kind == "group" and flag else "")
                                 + ("+residual" if kind == "proj" and flag else ""), rows=rows, ok=ok, max_rel_err=err,
                                 same_selection=same, median_us=t.median_us, floor_us=floor, floor_bw="read",
                                 timing=t.to_dict()))
            print(f"{name:10s} rows{rows} {t.median_us:8.2f} us floor {floor:6.2f} ok {ok} same {same}", flush=True)
    with open(f"{out}/proj_rows.json", "w") as f:
        json.dump(dict(probes=pr, env=envmod.fingerprint(), rows=rows_out, driver="experiments/proj_rows/bench.py"), f)
    print("\n%-22s %4s %9s %7s %6s %s" % ("case", "rows", "us", "floor", "%read", "ok"))
    for r in rows_out:
        pct = 100 * r["floor_us"] / r["median_us"]
        print("%-22s %4d %9.2f %7.2f %6.1f %s" % (r["case"], r["rows"], r["median_us"], r["floor_us"], pct,
                                                  r["ok"] and r["same_selection"]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
