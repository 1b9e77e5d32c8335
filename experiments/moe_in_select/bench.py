"""The MoE input group with the router's selection fused into the CuTe DSL GEMV (issue 13 / 15: one launch fewer a
MoE layer), against the step's two launches, on the H200 (twentieth session).

Variants, each under pdl_chain(True) as in the decode step, weights rotated past L2 (k3lab.harness.timing), TP8
shapes (router 896 rows fp32, latent down 3584, shared w1 / w3 768 each; K = 7168):
    cute+router   the cute group (no selection), then the CuTe router_topk: the step's path before (two launches)
    cute-select   the cute group with `select` (kernels/cute/proj_gemv.py): one launch
    triton-select the triton group with its fused selection (the last program of the router tiles selects)
(The twentieth session's run, at 2299f33, also timed a `cute-select12` variant: a launch bound of 12 CTAs an SM,
40 registers and 16 bytes of stack; it lost at every batch and its knob left the kernel.)
Every variant is first checked: its logits and other outputs against fp64 (the registry's tolerances through the
shared checker, for the fused ones), idx / weights equal to the two-launch path's on the same inputs.

    python experiments/moe_in_select/bench.py $OUT      (export PYTHONPATH=$PWD and the cute site first)
-> $OUT/moe_in_select.json (probes, env, samples) and a table.
"""
import json
import sys

import torch

import k3lab  # noqa: F401 - maps kernels/ to k3lab_kernels in a checkout that is not installed
from k3lab import registry
from k3lab.components import trunk
from k3lab.harness import checker, env as envmod, timing
from k3lab.ops import trunk as trunk_ops
from k3lab_kernels.triton.pdl import pdl_chain

GROUP = registry.get("proj_group")


def inputs(B: int, seed: int) -> dict:
    c = GROUP.case(preset="tp8", group="moe_in", batch=B, wdtype="bf16", select=True)
    return GROUP.make_inputs(c, seed, "cuda")


def run(d: dict, variant: str) -> None:
    outs = [d[f"y{i}"] for i in range(4)]
    sel = trunk.Select(d["e_bias"], d["idx"], d["weights"])
    if variant == "cute+router":
        trunk.proj_group(d["x"], d["w"], outs, backend="cute")
        trunk.router_topk(outs[0], d["e_bias"], top_k=d["idx"].shape[1], idx=d["idx"], weights=d["weights"],
                          backend="cute")
    elif variant == "cute-select":
        trunk.proj_group(d["x"], d["w"], outs, select=sel, backend="cute")
    elif variant == "triton-select":
        trunk.proj_group(d["x"], d["w"], outs, select=sel, backend="triton")
    else:
        raise ValueError(variant)


def main(out: str, reps: int = 30) -> None:
    pr = timing.probes()
    rows = []
    variants = ("cute+router", "cute-select", "triton-select")
    for B in (1, 2, 4):
        ref = inputs(B, 7)
        with pdl_chain(True):
            run(ref, "cute+router")
        torch.cuda.synchronize()
        for v in variants:
            c = GROUP.case(preset="tp8", group="moe_in", batch=B, wdtype="bf16", select=True)
            ok, err = True, ""
            if v != "cute+router":
                be = "cute" if v == "cute-select" else "triton"
                with pdl_chain(True):
                    res = checker.check(GROUP, c, backend=be, seed=B)
                ok, err = bool(res.ok), str(res)[:300]
            d = inputs(B, 7)
            for k in ("idx", "weights"):
                d[k].fill_(-1)
            with pdl_chain(True):
                run(d, v)
            torch.cuda.synchronize()
            same = bool(torch.equal(d["idx"], ref["idx"]) and torch.equal(d["weights"], ref["weights"]))
            nbytes = trunk_ops.proj_bytes(c)

            def fn(x, w, e_bias, idx, weights, y0, y1, y2, y3, v=v):
                with pdl_chain(True):
                    run(dict(x=x, w=w, e_bias=e_bias, idx=idx, weights=weights, y0=y0, y1=y1, y2=y2, y3=y3), v)

            def make(B=B):
                e = inputs(B, int(torch.randint(0, 1 << 30, (1,))))
                return (e["x"], e["w"], e["e_bias"], e["idx"], e["weights"], e["y0"], e["y1"], e["y2"], e["y3"])

            t = timing.bench_gpu(fn, make_inputs=make, reps=reps, bytes_per_call=nbytes)
            floor = nbytes / (pr["read_tbps"] * 1e6)
            rows.append(dict(batch=B, variant=v, ok=ok, check=err, same_as_two_launches=same, median_us=t.median_us,
                             floor_us=floor, floor_bw="read", timing=t.to_dict()))
            print(f"B{B} {v:14s} {t.median_us:8.2f} us  floor {floor:6.2f}  ok {ok} same {same}", flush=True)
    with open(f"{out}/moe_in_select.json", "w") as f:
        json.dump(dict(probes=pr, env=envmod.fingerprint(), rows=rows,
                       driver="experiments/moe_in_select/bench.py"), f)
    print("\n%-2s %-14s %9s %7s %s %s" % ("B", "variant", "us", "floor", "ok", "same"))
    for r in rows:
        print("%-2d %-14s %9.2f %7.2f %s %s" % (r["batch"], r["variant"], r["median_us"], r["floor_us"], r["ok"],
                                                r["same_as_two_launches"]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
