"""Check the persistent study kernel against the fp64 reference with the shared checker, then time it beside
the production grid decode (k3lab_kernels.cute.kda_decode) with the shared timer (graph replay, inputs
rotated past L2). Needs nvidia-cutlass-dsl and a GPU of compute capability 9.0.

    python experiments/kda_decode_persistent/run.py [--no-time]
"""
import os
import sys

import torch

from k3lab import registry
from k3lab.harness import checker, timing
from k3lab_kernels.cute.kda_decode import kda_decode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_decode_persistent import CONFIGS, kda_decode_persistent  # noqa: E402

OP = registry.get("kda_decode")


def _impl(cfg):
    def impl(d):
        a = (d["qkv"], d["f"], d["b"], d["gate"], d["params"], d["state"], d["conv_state"], d["out"])
        if cfg is None:
            return kda_decode(*a)
        return kda_decode_persistent(*a, ctas=cfg[0], stages=cfg[1])
    impl.__name__ = "grid" if cfg is None else f"persistent{cfg}"
    return impl


def time_us(B, H, cfg):
    case = OP.case(heads=H, batch=B)
    n = max(2, timing.rotation_count(OP.nbytes(case), timing.l2_bytes()))
    sets = [OP.make_inputs(case, 1000 + i, "cuda") for i in range(n)]
    impl = _impl(cfg)
    return timing.bench_gpu(lambda d: impl(d), input_sets=[(s,) for s in sets], reps=15,
                            bytes_per_call=OP.nbytes(case)).median_us


def main(argv):
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to run")
        return 0
    ok = True
    for B, H in ((1, 12), (5, 6), (64, 12), (3, 96)):
        for cfg in CONFIGS:
            r = checker.check(OP, OP.case(heads=H, batch=B), impl=_impl(cfg), seed=B * 3 + H)
            ok &= r.ok
            print(r)
    if "--no-time" not in argv:
        for B in (16, 64, 256):
            row = [f"grid {time_us(B, 12, None):8.2f}"] + [f"{cfg} {time_us(B, 12, cfg):8.2f}" for cfg in CONFIGS]
            print(f"time B={B:>3} H=12 (us a call): " + "  ".join(row))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
