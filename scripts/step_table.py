"""Markdown tables of decode-step bundles (k3lab.step), for docs/NOTES_step.md: the step against its targets, and
one KDA and one MLA layer component by component, for each bundle given.

    python scripts/step_table.py profiles/h200/decode_step-tp8-b1-c8192-d0.json.gz \
        profiles/h200/decode_step-tp8-b64-c8192-d0.json.gz ...
"""
from __future__ import annotations

import sys

from k3lab.harness.bundle import load


def step_rows(paths: list[str]) -> list[str]:
    out = ["| bundle | batch | fused step us | floor us | x floor | launches/layer | reference us | torch.compile us "
           "| x compile | 93-layer tok/s (per GPU) | floor tok/s |", "|---" * 11 + "|"]
    for p in paths:
        b = load(p)
        rows = {(r.name, r.backend): r for r in b.rows}
        f, ref, tc = rows[("step", "fused")], rows.get(("step", "reference")), rows.get(("step", "torch_compile"))
        e = rows.get(("estimate:93_layers", "fused"))
        lpl = f.extra.get("launches_per_layer")
        est = e.extra if e else {}
        out.append(f"| {p.split('profiles/h200/')[-1]} | {b.config['view']['batch']} | {f.median_us:.1f} | "
                   f"{f.floor_us:.1f} | {f.median_us / f.floor_us:.2f} | {f'{lpl:.1f}' if lpl else 'not profiled'} | "
                   f"{f'{ref.median_us:.0f}' if ref else 'not run'} | {f'{tc.median_us:.0f}' if tc else 'not run'} | "
                   f"{f'{tc.median_us / f.median_us:.0f}' if tc else '-'} | {est.get('tokens_per_s', 0):.1f} "
                   f"({est.get('tokens_per_s_per_gpu', 0):.1f}) | {est.get('floor_tokens_per_s', 0):.1f} |")
    return out


def layer_rows(path: str, layers=("L01.kda", "L03.mla")) -> list[str]:
    b = load(path)
    out = [f"{path.split('profiles/h200/')[-1]} (batch {b.config['view']['batch']}): component us / floor us "
           "(launches)", ""]
    for lay in layers:
        rs = [r for r in b.rows if r.backend == "fused" and r.name.startswith(lay + ".")]
        tot = next((r for r in b.rows if r.backend == "fused" and r.name == lay), None)
        cells = [f"{r.name.split('.')[-1]} {r.median_us:.1f} / {r.floor_us:.1f} ({r.launches})" for r in rs]
        head = f"**{lay}** {tot.median_us:.1f} / {tot.floor_us:.1f} us ({tot.launches} launches): " if tot else ""
        out.append(f"- {head}" + ", ".join(cells))
    return out


if __name__ == "__main__":
    ps = sys.argv[1:]
    print("\n".join(step_rows(ps)))
    for p in ps:
        print()
        print("\n".join(layer_rows(p)))
