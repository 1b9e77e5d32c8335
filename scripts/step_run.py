"""The step notebook's run (notebooks/06_decode_step.ipynb, its `dash.run_step` cell) without papermill, Jupyter or
plotly: for a device call that can carry the CuTe DSL but not the notebook packages beside it. Saves the bundle (and the
trace) under OUT/<gpu>/ exactly as the notebook would; the report comes later from the bundle (`k3lab report`).

    python scripts/step_run.py OUT -p preset tp8 -p batch 64 -p context 8192 -p pdl true -p proj_cute true \\
        -p toggles pdl,split_router

Parameters not given take the notebook's defaults (its parameters cell), so a run here is the notebook's run."""
import json
import sys

from k3lab import dashboards as dash


def notebook_defaults() -> dict:
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "06_decode_step.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    ns: dict = {}
    exec("".join(cell["source"]), {}, ns)  # the parameters cell holds assignments of literals only
    return ns


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    out, rest = argv[0], argv[1:]
    p = notebook_defaults()
    while rest:
        if rest[0] != "-p" or len(rest) < 3:
            print(f"expected -p NAME VALUE, got {rest[:3]}")
            return 2
        name, val = rest[1], rest[2]
        if name not in p:
            print(f"unknown parameter {name!r}; the notebook's: {sorted(p)}")
            return 2
        try:
            p[name] = json.loads(val)
        except json.JSONDecodeError:
            p[name] = val
        rest = rest[3:]
    r = dash.run_step(dash.params_from(p), out)
    print("bundle:", r["bundle_path"], "| numerics error:", r["numerics_error"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
