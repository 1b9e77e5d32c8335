"""The decode step at batch 64 (TP8, 8K, MXFP4, pdl: notebook 06's batch-64 settings) with the MLA group on Triton
(`auto`) and on CuTe DSL (`backend_mla = "cute"`: the CuTe decode, cache write and combine), in one process and on
one probe: alternates the two `ROUNDS` times (each a fresh build, timed by `k3lab.step.time_step`), compares one
step's output of each arm from the same seeded state, and saves one profiled eager step's per-component GPU time.
Written in the twenty-third session; first run in the twenty-fourth, where both arms ran cute (see ARMS).

    python experiments/mla_cute/step_ab.py $OUT [--check]  (PYTHONPATH=$PWD, cute site) -> $OUT/mla_cute_step_*.json
"""
import json
import sys

import torch

import k3lab  # noqa: F401 - maps kernels/ to k3lab_kernels in a checkout that is not installed
from k3lab import dashboards, step as S
from k3lab.harness import env as envmod, timing

ROUNDS = 2
P = dict(preset="tp8", batch=64, context=8192, expert_dtype="mxfp4", pdl=True)
ARMS = {"triton": {"backend_mla": "triton"}, "cute": {"backend_mla": "cute"}}  # named: auto picked cute in both
# arms of the first run (the step's auto took the first fused backend with a path; it follows mla_decode's rule now)


def check(out):
    """One step of each arm from the same seeded state, every layer's output and the MLA layers' buffers compared
    (the first run's outputs differed by 0.25 relative: the MoE routing flipping, or the cute glue?)."""
    view = dashboards.view_from_params(P)
    keep = {}
    for arm, extra in ARMS.items():
        st = S.DecodeStep(view, dashboards.switches_from_params(dict(P, **extra)), device="cuda")
        torch.manual_seed(0)
        x = torch.randn(st.x_in.shape, device="cuda").to(st.x_in.dtype)
        layers = {}
        for i, L in zip(st.ids, st.layers):  # every layer's output, and the MLA layers' q / o_lat / p
            layers[i] = L
        st.run(x)
        torch.cuda.synchronize()
        keep[arm] = {f"L{i:02d}.{k}": L.buf[k].float().clone() for i, L in layers.items()
                     for k in ("x_out", "q_lat", "q_rope", "o_lat", "p", "idx") if k in L.buf
                     and isinstance(L.buf[k], torch.Tensor)}
        del st, layers, L
        torch.cuda.empty_cache()
    res = {}
    for k, a in keep["triton"].items():
        b = keep["cute"][k]
        res[k] = (float((a - b).norm() / a.norm().clamp_min(1e-30)), float((a - b).abs().max()))
        print(f"{k:14s} rel {res[k][0]:.3e} max {res[k][1]:.3e}", flush=True)
    with open(f"{out}/mla_cute_step_check.json", "w") as f:
        json.dump(dict(params=P, arms=ARMS, rel_max=res), f)


def main(out):
    pr = timing.probes()
    view = dashboards.view_from_params(P)
    res = dict(probes=pr, env=envmod.fingerprint(), params=P, arms=ARMS, times={a: [] for a in ARMS}, profile={},
               outputs={})
    first = {}
    for rnd in range(ROUNDS):
        for arm, extra in ARMS.items():
            st = S.DecodeStep(view, dashboards.switches_from_params(dict(P, **extra)), device="cuda")
            if rnd == 0:  # one step from the seeded state: the arms' outputs compared
                torch.manual_seed(0)
                first[arm] = st.run(torch.randn(st.x_in.shape, device="cuda").to(st.x_in.dtype)).float().clone()
                st = S.DecodeStep(view, dashboards.switches_from_params(dict(P, **extra)), device="cuda")
            t = S.time_step(st, reps=20, warmup=3)
            res["times"][arm].append(dict(median_us=t.median_us, samples_us=t.samples_us))
            if rnd == 0:
                att = S.profile_step(st)
                res["profile"][arm] = {k: {kk: vv for kk, vv in v.items() if not isinstance(vv, list)}
                                       for k, v in att.items()}
            print(f"round {rnd} {arm}: {t.median_us:.1f} us", flush=True)
            del st
            torch.cuda.empty_cache()
            if len(first) == len(ARMS) and not res["outputs"]:
                a, b = first["triton"], first["cute"]
                res["outputs"] = dict(rel_norm=float((a - b).norm() / a.norm()), max_abs=float((a - b).abs().max()))
                print(f"outputs: {res['outputs']}", flush=True)
            with open(f"{out}/mla_cute_step_ab.json", "w") as f:  # after every build: a cut run keeps what it has
                json.dump(res, f, default=str)
    for arm in ARMS:
        print(f"{arm}: " + " ".join(f"{x['median_us']:.1f}" for x in res["times"][arm]))


if __name__ == "__main__":
    if "--check" in sys.argv:
        check(sys.argv[1])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
