"""The decode step at batch 1 (TP8, 8K, MXFP4, pdl, proj_cute: notebook 06's headline settings) with the MLA query
step in one CuTe launch (k3lab_kernels.cute.mla_query: q_norm, Wuq and the Wuk absorption) and as the three launches
it replaced (rms_norm, Wuq on the CuTe GEMV, cuBLAS bmm), in one process and on one probe. Alternates the two
`ROUNDS` times (each a fresh build of the step, timed by `k3lab.step.time_step`), and saves one profiled eager step's
per-component GPU time for each (`k3lab.step.profile_step`).

    python experiments/mla_query/step_ab.py $OUT    (PYTHONPATH=$PWD and the cute site)  ->  $OUT/mla_query_step_ab.json
"""
import json
import sys

import torch

import k3lab  # noqa: F401 - maps kernels/ to k3lab_kernels in a checkout that is not installed
from k3lab import dashboards, step as S
from k3lab.harness import env as envmod, timing

ROUNDS = 2
P = dict(preset="tp8", batch=1, context=8192, expert_dtype="mxfp4", pdl=True, proj_cute=True)
ONE = S.MLA_QUERY_MAX_TOKENS


def main(out):
    pr = timing.probes()
    view, sw = dashboards.view_from_params(P), dashboards.switches_from_params(P)
    res = dict(probes=pr, env=envmod.fingerprint(), params=P, times={"one": [], "three": []}, profile={})
    for rnd in range(ROUNDS):
        for arm in ("one", "three"):
            S.MLA_QUERY_MAX_TOKENS = ONE if arm == "one" else 0
            st = S.DecodeStep(view, sw, device="cuda")
            t = S.time_step(st, reps=20, warmup=3)
            res["times"][arm].append(dict(median_us=t.median_us, samples_us=t.samples_us))
            if rnd == 0:
                att = S.profile_step(st)
                res["profile"][arm] = {k: {kk: vv for kk, vv in v.items() if not isinstance(vv, list)}
                                       for k, v in att.items()}
            print(f"round {rnd} {arm}: {t.median_us:.1f} us", flush=True)
            del st
            torch.cuda.empty_cache()
            with open(f"{out}/mla_query_step_ab.json", "w") as f:  # after every build: a cut run keeps what it has
                json.dump(res, f, default=str)
    S.MLA_QUERY_MAX_TOKENS = ONE
    for arm in ("one", "three"):
        print(f"{arm}: " + " ".join(f"{x['median_us']:.1f}" for x in res["times"][arm]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
