"""Does the simt kernel's access pattern cost DRAM bandwidth by itself? (docs/NOTES_moe.md, seventeenth session)

Reads the bytes of batch 1's role A (16 experts x 384 rows of w1 and of w3, 1792 bytes a row: 22 MB) with no
arithmetic but an xor of the words, in two patterns, graph replay over input sets rotated past L2:
  rows   the kernel's: an item = 16 rows of w1 and of w3, a step loads 64 words (256 bytes) of each row, the rows
         1792 bytes apart (7 steps an item): a DRAM page sees one 256-byte piece a step;
  tiled  the same bytes a step, but each step's 4 KB of a matrix contiguous (the layout a tile-major kernel layout
         would give: [expert, row tile, step, row, words]).
Prints TB/s for each beside the harness's read probe.
Device: PYTHONPATH=$PWD python3 experiments/moe_simt/access_probe.py
"""
import json
import os

import torch
import triton
import triton.language as tl

from k3lab.harness import timing

ROWS, WORDS, BN, NBW = 384 * 16, 448, 16, 64  # rows of one matrix (16 experts x 384), words a row, rows an item,
# words a step a row


@triton.jit
def _probe(w1, w3, out, WORDS: tl.constexpr, BN: tl.constexpr, NBW: tl.constexpr, TILED: tl.constexpr):
    item = tl.program_id(0)
    base = item.to(tl.int64) * (BN * WORDS)
    r = tl.arange(0, BN)[:, None]
    c = tl.arange(0, NBW)[None, :]
    acc = tl.zeros([BN, NBW], tl.int32)
    for s in range(0, WORDS // NBW):
        if TILED:
            off = base + s * (BN * NBW) + r * NBW + c
        else:
            off = base + r * WORDS + s * NBW + c
        acc = acc ^ tl.load(w1 + off) ^ tl.load(w3 + off)
    tl.store(out + item, tl.sum(acc, axis=None))


def main():
    dev = torch.device("cuda")
    out = torch.empty(ROWS // BN, dtype=torch.int32, device=dev)

    def make():
        return (torch.randint(-2**31, 2**31 - 1, (ROWS * WORDS,), dtype=torch.int32, device=dev),
                torch.randint(-2**31, 2**31 - 1, (ROWS * WORDS,), dtype=torch.int32, device=dev))

    nbytes = 2 * ROWS * WORDS * 4
    res = {"bytes": nbytes, "read_tbps": timing.measure_read_bandwidth()}
    for tiled in (False, True):
        for nw in (4, 8):
            def fn(a, b, tiled=tiled, nw=nw):
                _probe[(ROWS // BN,)](a, b, out, WORDS=WORDS, BN=BN, NBW=NBW, TILED=tiled, num_warps=nw)
            t = timing.bench_gpu(fn, make_inputs=make, reps=30, bytes_per_call=nbytes)
            key = f"{'tiled' if tiled else 'rows'}_w{nw}"
            res[key] = {"us": t.median_us, "tbps": nbytes / (t.median_us * 1e-6) / 1e12}
    print(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "access_probe.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
