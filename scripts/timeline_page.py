"""One page with the decode step's timeline (k3lab.dashboards.timeline_figure: the saved trace's GPU work as bars, one
row a CUDA stream) for one layer, using the repository's one shared plotly.js: the small report of a profiled run whose
full report is not kept (e.g. the `shared_expert_stream` run of issue 14, two streams).

    python scripts/timeline_page.py TRACE.json.gz OUT.html [LAYER]      (LAYER: 1 by default; -1 every layer)
"""
import sys
from pathlib import Path

from k3lab import dashboards, report


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__)
        return 2
    trace, out = Path(argv[0]), Path(argv[1])
    layer = int(argv[2]) if len(argv) == 3 else 1
    fig = dashboards.timeline_figure(trace, None if layer < 0 else layer)
    if fig is None:
        print(f"no trace at {trace}")
        return 1
    title = f"timeline of {trace.name}" + ("" if layer < 0 else f", layer {layer}")
    body = (f"<h1>{title}</h1>\n<p>trace: {trace.name} (open it in Perfetto for every event)</p>\n"
            + report.figure_div(fig))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.page(title, body, out))
    print("page ->", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
