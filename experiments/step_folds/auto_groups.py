"""The batch-1 step with every backend `auto` (notebook 06's default), tp8, 8K, MXFP4 experts: which backend each
component group resolves to and why (k3lab.step.resolve_switches; the fifty-third session's group-facts fix), then the
whole step timed with `proj_cute` off and on (graph replay, rounds alternating).
Device (.gpu/cute): [PROJ_BE=cute] [ROUNDS=2] python3 experiments/step_folds/auto_groups.py $OUT
($OUT/auto_groups.json,
a table last)"""
import json
import os
import sys

import torch

from k3lab import dashboards
from k3lab import step as S
from k3lab.harness import env as envmod

out = sys.argv[1] if len(sys.argv) > 1 else "."
P = dict(preset="tp8", batch=int(os.environ.get("BATCH", "1")), context=8192, expert_dtype="mxfp4", backend="auto")
if os.environ.get("PROJ_BE"):  # the projection group named instead (PROJ_BE=cute: what auto resolved to before the fix)
    P["backend_proj"] = os.environ["PROJ_BE"]
view, sw = dashboards.view_from_params(P), dashboards.switches_from_params(P)
st = S.DecodeStep(view, sw, device="cuda")
res = dict(env=envmod.fingerprint(), params=P, backends=dict(st.backends), why={k: str(v) for k, v in st.why.items()},
           times={})
for k in ("proj", "moe", "kda", "mla", "attnres", "router"):
    print(f"{k:8s} {st.backends.get(k)!s:10s} {str(st.why.get(k))[:150]}")
for r in range(int(os.environ.get("ROUNDS", "2"))):
    for on in (False, True):
        st.set_switches(sw.replace(proj_cute=on))
        t = S.time_step(st, reps=20, warmup=3)
        res["times"].setdefault(f"proj_cute={on}", []).append(t.median_us)
        print(f"round {r} proj_cute={on}: {t.median_us:.1f} us", flush=True)
json.dump(res, open(os.path.join(out, f"auto_groups{os.environ.get('PROJ_BE', '')}.json"), "w"), indent=1)
torch.cuda.synchronize()
