"""Instruction mix of the MXFP4 simt kernel's role-A step loop (w1 / w3 and their activations), compiled for sm_90a
without a GPU (SASS from the bundled ptxas and cuobjdump): the loop is the block between the first backward branch
into role A's body and its target (sass_loop_t36.txt: the sixteenth session's output at 4426287, beside the `tma`
variant that lost). Use the device's Triton (3.6, see compile_check.py):

    PYTHONPATH=/tmp/t36 python experiments/moe_simt/sass_loop.py [B]

Prints, per setting, the loop's instruction count and its mix; words a thread a step = 2 x BN x NB x 4 / threads."""
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from compile_check import M, PTXAS, build, triton  # noqa: E402  (the one compile pipeline of this folder)


def loop_mix(B: int) -> tuple[int, collections.Counter, int]:
    d = M.default_blocks(B, 16, 384, 3584, "mxfp4", "simt")
    nw, tb = d["num_warps"], d["block_t"]
    const = dict(L=3584, I=384, K=16, KP=16, BB=max(16, M._pow2(B)), BN=d["block_n"], NB=d["block_k"] // 32,
                 BL=d["block_l"], NB2=d["block_i"] // 32, TB=tb, B1=4.0, B2=25.0, INTERP=False, NW=nw,
                 ONE=B == 1 and not d["leaders"], LEAD=d["leaders"], PDL=False)
    opts = {"num_warps": nw, "num_stages": 1, **({"maxnreg": d["maxnreg"]} if d["maxnreg"] else {})}
    _, _, _, cubin = build(const, opts, ptxas_args=())
    with tempfile.TemporaryDirectory() as t:
        open(os.path.join(t, "k.cubin"), "wb").write(cubin)
        dump = os.path.join(os.path.dirname(PTXAS), "cuobjdump")
        sass = subprocess.run([dump, "-sass", os.path.join(t, "k.cubin")], capture_output=True, text=True,
                              check=True).stdout
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    back = [(a, int(m.group(1), 16)) for a, t in ins if (m := re.search(r"BRA\s+(?:P\d+,\s*)?0x([0-9a-f]+)", t))
            and int(m.group(1), 16) < a]
    # role A's step loop: the innermost backward loop (no backward branch inside) whose body holds the HFMA2 products
    # and the 16-byte weight loads; the first such loop in the code is role A's (role B's follows it)
    inner = [(tgt, a) for a, tgt in back if not any(tgt <= a2 < a for a2, _ in back if a2 != a)]
    tgt, a = min((lp for lp in inner if sum("HFMA2" in t for x, t in ins if lp[0] <= x <= lp[1]) >= 8),
                 key=lambda lp: lp[0])
    body = [re.sub(r"^@!?P\d+\s+", "", t).split()[0] for x, t in ins if tgt <= x <= a]
    words = 2 * const["BN"] * const["NB"] * 4 // (32 * nw)
    return len(body), collections.Counter(body), words


if __name__ == "__main__":
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    print(f"triton {triton.__version__}, batch {B}")
    n, mix, words = loop_mix(B)
    top = ", ".join(f"{k} {v}" for k, v in mix.most_common(10))
    print(f"{n} instructions a step, {words} words a thread a step ({n / words:.1f} a word): {top}")
