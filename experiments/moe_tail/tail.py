"""Is the bf16 grouped experts kernel's batch-16 shortfall (issue 14: 93.3 % of read on the H200 against 95 %, batch 32
/ 64 at 96 / 95 %) the last wave of programs? Path "grouped" runs one program an SM (4 stages, 144 KB of shared
memory) per (64 intermediate rows, expert that some token chose): 6 programs an expert at TP8, ~224 experts at batch 16
uniform, so ~1,346 programs = 10.2 waves of 132. Here batch 16, top-16, with routings made to touch exactly D experts,
D swept across wave edges (22 experts = one wave of 132 programs): if the time steps at the edges, the last wave is
what costs, and finer work at the tail is the lever; if it is linear in D, it is not. Beside it the grouped path's
option `tail` (the items over the leaders' list, the last wave split into halves or quarters of their rows).
Each row: D, programs, waves, the triton grouped median (us, graph replay, CUDA graph over 20 calls; the weights
(D x 8.26 MB) are far past L2 whatever the set), % of the read probe, then the same with tail=True. Both checked
against the reference (fp32 sums of the same bf16 products) at one D (the registry's fp64 checks: the bench).
Measured (fifty-fifth session, an H100, `bash experiments/kda_ncu/call55.sh` part 1;
experiments/moe_tail/h100_tail.json.gz): the time is linear in D to within ~8 us at each wave edge (220 -> 222 experts
+13.5 us against ~5.5 from the slope), 96-97.6 % of read at every D, and `tail` 0-0.6 % slower everywhere: the last wave
is not what the batch-16 row lacks (docs/NOTES_moe.md, fifty-fifth section). The option was removed; its code is in git
history at ab6ca59, the tree this script runs against.
Device: python3 experiments/moe_tail/tail.py   (prints a table; JSON to $OUT/moe_tail.json)"""
import json
import os

import torch

from k3lab.components import moe
from k3lab.harness import timing
from k3lab.ops import moe as moe_op

torch.manual_seed(0)
dev = "cuda"
B, K, E = 16, 16, 896
case = dict(batch=B, dtype="bf16", routing="uniform", n_experts=E, top_k=K, latent=3584, inter=3072, tp=8)
d0 = moe_op.make_experts(case, 1, dev)
m, z = d0["moe"], d0["z"]
I, L = m.w1.data.shape[1], m.w1.data.shape[2]
sms = torch.cuda.get_device_properties(0).multi_processor_count
read = timing.probes()["read_tbps"]


def routing_with(D: int, seed: int) -> torch.Tensor:
    """[B, K] ids touching exactly D experts, each token's K ids distinct (D in K..B K)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(E, generator=g)[:D].tolist()
    idx = [[-1] * K for _ in range(B)]
    for p in range(B * K):  # the first D pairs take the pool in turn, the rest reuse it
        b, k = divmod(p, K)
        if p < D:
            idx[b][k] = pool[p]
        else:
            j = (p * 7) % D
            while pool[j] in idx[b]:
                j = (j + 1) % D
            idx[b][k] = pool[j]
    t = torch.tensor(idx, dtype=torch.int32)
    assert len(set(t.flatten().tolist())) == D and all(len(set(r)) == K for r in idx)
    return t.to(dev)


wk = torch.rand(B, K, device=dev)
y = torch.empty(B, L, dtype=torch.float32, device=dev)
rows = []
for D in (198, 204, 210, 216, 220, 222, 224, 226, 232, 238, 242, 244, 250, 256):
    idx = routing_with(D, D)
    r = dict(D=D)
    for key, tail in (("plain", None), ("tail", True)):
        progs = D * (I // 64)

        def fn(idx=idx, tail=tail):
            moe.experts(z, idx, wk, m, backend="triton", path="grouped", tail=tail, out=y, check_values=False)
        if D == 224:
            fn()
            ref = moe.experts(z, idx, wk, m, backend="reference")
            r[f"rel_err_{key}"] = float((y - ref).norm() / ref.norm())
        t = timing.bench_gpu(fn, bytes_per_call=1, rotate=False, reps=30)
        nbytes = D * 3 * I * L * 2 + B * L * 2 + B * L * 4
        pct = 100 * nbytes / (t.median_us * 1e-6) / 1e12 / read
        r[key] = dict(us=t.median_us, programs=progs, waves=progs / sms, pct=pct)
    rows.append(r)
    pl, ta = r["plain"], r["tail"]
    err = f"  rel_err {r['rel_err_plain']:.2e} / {r['rel_err_tail']:.2e}" if "rel_err_plain" in r else ""
    print(f"D {D:4d}  {pl['programs']:5d} progs {pl['waves']:6.2f} waves  plain {pl['us']:8.2f} us {pl['pct']:5.1f} % "
          f"  tail {ta['us']:8.2f} us {ta['pct']:5.1f} %{err}", flush=True)
out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "moe_tail.json"), "w") as f:
    json.dump(dict(sms=sms, read_tbps=read, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
