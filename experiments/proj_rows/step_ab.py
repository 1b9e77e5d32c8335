"""The decode step at batch 1 (TP8, 8K, MXFP4, pdl, proj_cute: notebook 06's headline settings) with the CuTe GEMV
at one and at two rows a warp, in one process and on one probe (twentieth session: the two-row GEMV took 26 us off
the components but not off the layers). Alternates the two settings `ROUNDS` times (each a fresh build of the step,
timed by `k3lab.step.time_step`: one CUDA graph of three steps), and saves one profiled eager step's per-component
GPU time and kernel list for each (`k3lab.step.profile_step`).

    python experiments/proj_rows/step_ab.py $OUT    (PYTHONPATH=$PWD and the cute site)  ->  $OUT/step_ab.json

Runs at commit f17621a (the kernel's `rows` knob was removed after this A/B: README.md here).
"""
import json
import sys

import torch

import k3lab  # noqa: F401 - maps kernels/ to k3lab_kernels in a checkout that is not installed
from k3lab import dashboards, step as S
from k3lab.harness import env as envmod, timing
from k3lab_kernels.cute import proj_gemv as kg

ROUNDS = 2
P = dict(preset="tp8", batch=1, context=8192, expert_dtype="mxfp4", pdl=True, proj_cute=True)
_DEFAULT_ROWS = kg.default_rows


def set_rows(r):
    kg.default_rows = _DEFAULT_ROWS if r == 2 else (lambda B, N, select=False: 1)
    kg._COMPILED.clear()


def main(out):
    pr = timing.probes()
    view, sw = dashboards.view_from_params(P), dashboards.switches_from_params(P)
    res = dict(probes=pr, env=envmod.fingerprint(), params=P, times={1: [], 2: []}, profile={})
    for rnd in range(ROUNDS):
        for r in (1, 2):
            set_rows(r)
            st = S.DecodeStep(view, sw, device="cuda")
            t = S.time_step(st, reps=20, warmup=3)
            res["times"][r].append(dict(median_us=t.median_us, samples_us=t.samples_us))
            if rnd == 0:
                att = S.profile_step(st)
                res["profile"][r] = {k: {kk: vv for kk, vv in v.items() if not isinstance(vv, list)}
                                     for k, v in att.items()}
            print(f"round {rnd} rows {r}: {t.median_us:.1f} us", flush=True)
            del st
            torch.cuda.empty_cache()
            with open(f"{out}/step_ab.json", "w") as f:  # after every build: a run cut short keeps what it has
                json.dump(res, f, default=str)
    set_rows(2)
    for r in (1, 2):
        print(f"rows {r}: " + " ".join(f"{x['median_us']:.1f}" for x in res["times"][r]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
