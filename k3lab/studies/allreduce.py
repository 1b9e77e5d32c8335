"""The decode step's all-reduce, measured: the partial sum a TP rank holds after the attention output projection and
after the MoE output (B x 7168 bf16, two a layer) summed over the N GPUs of one host. Without such a bundle the
step's 93-layer estimate ASSUMES the cost (k3lab.step.ALLREDUCE_ASSUMED_US, the 2 x H200 figure of docs/MODEL.md);
with one (`allreduce_bundle`) it takes the measured time and says so.

Backends (each a row per batch):
  nccl         torch.distributed.all_reduce on an NCCL process group, eager (CUDA events around each call)
  nccl_graph   the same call captured in CUDA graphs and replayed (how the captured step runs it)
  one_shot     torch symmetric memory's one-shot all-reduce (every rank reads each peer's buffer over NVLink and sums;
               no multicast), captured likewise
  gloo         torch.distributed.all_reduce on gloo: the CPU run (logic only; its timings are cpu-smoke)
Each backend is first checked against the fp64 sum of every rank's seeded input (every rank regenerates all of them):
relative-norm tolerance N x 2^-8 (the bf16 inputs are exact; each of the N - 1 additions rounds to bf16, unit
roundoff 2^-8). Then timed on each rank by the one timer (k3lab.harness.timing.bench, one buffer replayed: the
payload is a few KB to 1 MB, mode "hot") in place on zeros (the values do not change the time; repeated sums of
random values would overflow). A row holds the slowest rank's samples (the step waits for it) and the worst rank's
error. Floor: the launch floor (the payload is latency-bound; NVLink bandwidth is not probed).

    python -m k3lab.studies.allreduce OUT [--world N] [--batches 1,8,64] [--hidden 7168] [--reps 50]
                                          [--backends nccl,nccl_graph,one_shot] [--name NAME]
writes OUT/<gpu>/NAME.json (default allreduce_x<N>). NVLink multicast stays off in every process
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, set before any process group).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

HIDDEN = 7168
GPU_BACKENDS = ("nccl", "nccl_graph", "one_shot")
CPU_BACKENDS = ("gloo",)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GRAPHED = ("nccl_graph", "one_shot")  # the forms a captured decode step runs


class AllReduceError(ValueError):
    """An argument of the study that cannot run, named."""


def row_name(batch: int, hidden: int, world: int) -> str:
    return f"allreduce[batch={batch},hidden={hidden},world={world}]"


def _inputs(rank: int, batch: int, hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * batch + rank)
    return torch.randn(batch, hidden, generator=g).to(torch.bfloat16)


def _expected(world: int, batch: int, hidden: int) -> torch.Tensor:
    return sum(_inputs(r, batch, hidden).double() for r in range(world))


def _op(backend: str, batch: int, hidden: int, dev: torch.device):
    """(buffer, call) of one backend: call() sums the buffer over the ranks (in place, or into its own output)."""
    import torch.distributed as dist

    if backend == "one_shot":
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by the torch releases before it went implicit
            symm_mem.enable_symm_mem_for_group(name)
        buf = symm_mem.empty(batch, hidden, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(buf, name)
        out = torch.empty_like(buf)
        op = torch.ops.symm_mem.one_shot_all_reduce_out
        return buf, lambda: op(buf, "sum", name, out), out
    buf = torch.zeros(batch, hidden, dtype=torch.bfloat16, device=dev)
    return buf, lambda: dist.all_reduce(buf), buf


def _worker(rank: int, world: int, cfg: dict, tmp: str) -> None:
    os.environ.update(NO_MULTICAST)
    import torch.distributed as dist

    from k3lab.harness import numerics, timing

    cuda = cfg["device"] == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=cfg["timeout_s"]))
    out: dict[str, Any] = {"rows": [], "skipped": {}}
    if rank == 0:
        out["launch_floor_us"] = timing.launch_floor_us(device=dev)
    tol = world * 2.0 ** -8
    try:
        for b in cfg["batches"]:
            want = _expected(world, b, cfg["hidden"])
            for be in cfg["backends"]:
                if be in out["skipped"]:
                    continue
                try:
                    buf, call, res = _op(be, b, cfg["hidden"], dev)
                except Exception as e:  # noqa: BLE001  the same on every rank (a missing op, no NVLink peers)
                    out["skipped"][be] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    continue
                buf.copy_(_inputs(rank, b, cfg["hidden"]).to(dev))
                call()
                err = numerics.error_stats(res.double().cpu(), want, tol)
                buf.zero_()
                t = timing.bench(call, device=dev, input_sets=[()], rotate=False, reps=cfg["reps"],
                                 warmup=5, graph=be in GRAPHED, min_calls_per_graph=20)
                out["rows"].append(dict(batch=b, backend=be, kind=t.kind, samples=t.samples_us,
                                        calls=t.calls_per_sample, note=t.note, error=err.to_dict()))
                dist.barrier()
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def worst_error(errors: list[dict]) -> dict:
    """The rank's error record that decides a row: a failed check before a passing one, then the largest relative
    norm (NaN, stored as None, and inf count as the largest)."""
    def rel(e: dict) -> float:
        v = e.get("rel_norm")
        return math.inf if v is None or v == "inf" else float(v)
    return max(errors, key=lambda e: (not e.get("ok", False), rel(e)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out_dir: str | Path, *, world: int | None = None, batches=(1, 8, 64), hidden: int = HIDDEN, reps: int = 50,
        backends=None, name: str | None = None, timeout_s: int = 300) -> Path:
    """Spawn `world` processes (one a GPU; on a machine without one, gloo on the CPU), check and time each backend
    at each batch, and save the bundle under out_dir/<gpu>/; returns its path."""
    import torch.multiprocessing as mp

    from k3lab.harness import roofline, timing
    from k3lab.harness.bundle import Bundle, Row

    cuda = torch.cuda.is_available()
    world = world if world is not None else (torch.cuda.device_count() if cuda else 2)
    backends = tuple(backends or (GPU_BACKENDS if cuda else CPU_BACKENDS))
    allowed = GPU_BACKENDS if cuda else CPU_BACKENDS
    if bad := [b for b in backends if b not in allowed]:
        raise AllReduceError(f"allreduce: backends {bad} do not run {'on GPUs' if cuda else 'without a GPU'}; "
                             f"allowed here: {allowed}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise AllReduceError(f"allreduce: world must be an int >= 2 (GPUs summed over), got {world!r}")
    if cuda and world > torch.cuda.device_count():
        raise AllReduceError(f"allreduce: world {world} but this host has {torch.cuda.device_count()} GPUs")
    batches = tuple(batches)
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise AllReduceError(f"allreduce: batches must be ints >= 1, got {batches!r}")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise AllReduceError(f"allreduce: hidden must be an int >= 1, got {hidden!r}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise AllReduceError(f"allreduce: reps must be an int >= 1, got {reps!r}")
    cfg = dict(device="cuda" if cuda else "cpu", port=_free_port(), batches=list(batches), hidden=hidden, reps=reps,
               backends=list(backends), timeout_s=timeout_s)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, cfg, tmp), nprocs=world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    lf = ranks[0]["launch_floor_us"]
    bd = Bundle.new(name or f"allreduce_x{world}", launch_floor_us=lf)
    bd.config = {"study": "allreduce", "world": world, "batches": list(batches), "hidden": hidden, "reps": reps,
                 "backends": list(backends), "env_forced": dict(NO_MULTICAST), "rows_expected": True}
    bd.backends_skipped.update(ranks[0]["skipped"])
    for i, r0 in enumerate(ranks[0]["rows"]):
        per_rank = [rk["rows"][i] for rk in ranks]
        slow = max(per_rank, key=lambda r: sorted(r["samples"])[len(r["samples"]) // 2])
        worst = worst_error([r["error"] for r in per_rank])
        t = timing.Timing.from_samples(slow["kind"], slow["samples"], calls_per_sample=slow["calls"],
                                       note=slow["note"], mode="hot")
        payload = r0["batch"] * hidden * 2
        fl = roofline.floor(0, bw_tbps=1.0, launch_us=lf)
        row = Row.from_timing(row_name(r0["batch"], hidden, world), r0["backend"], t, floor=fl,
                              op="allreduce", batch=r0["batch"], hidden=hidden, world=world, payload_bytes=payload,
                              slowest_rank=per_rank.index(slow))
        row.error = worst
        row.bytes, row.achieved_tbps, row.pct_of_bw, row.floor_bw = payload, None, None, None  # a latency floor only
        bd.add(row)
        bd.backends_ran.setdefault(r0["backend"], r0["backend"])
    if not cuda:
        bd.notes.append("CPU run: gloo on host processes; logic only, not GPU figures")
    forced = ", ".join(f"{k}={v}" for k, v in NO_MULTICAST.items())
    bd.notes.append(f"{world} ranks of one host; multicast off ({forced})")
    return bd.save(out_dir)


def measured(bundle: str | Path, batch: int, world: int | None = None) -> tuple[float, str]:
    """(us, label) of one all-reduce at `batch` from an allreduce bundle: the fastest passing row of the forms a
    captured step runs (nccl_graph, one_shot; the eager ones where the bundle has none) at that batch, else at the
    smallest larger batch measured; an error naming what is missing otherwise."""
    from k3lab.harness.bundle import read_json

    d = read_json(bundle)
    if (d.get("config") or {}).get("study") != "allreduce":
        raise AllReduceError(f"allreduce_bundle {bundle}: not a bundle of k3lab.studies.allreduce")
    rows = [r for r in d["rows"] if (r.get("error") or {}).get("ok", False)]
    if world is not None:
        rows = [r for r in rows if r["extra"].get("world") == world] or rows
    graphed = [r for r in rows if r["backend"] in GRAPHED] or rows
    sizes = sorted({r["extra"]["batch"] for r in graphed if r["extra"]["batch"] >= batch})
    if not sizes:
        have = sorted({r["extra"]["batch"] for r in graphed})
        raise AllReduceError(f"allreduce_bundle {bundle}: no passing row at batch >= {batch} (batches {have})")
    best = min((r for r in graphed if r["extra"]["batch"] == sizes[0]), key=lambda r: r["median_us"])
    gpu = (d.get("env") or {}).get("gpu") or "cpu"
    return float(best["median_us"]), (f"measured: {best['backend']}, batch {sizes[0]}, {gpu} x "
                                      f"{best['extra']['world']} ({Path(bundle).name})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.studies.allreduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; 2 without one)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--backends", default="", help=f"GPU: {','.join(GPU_BACKENDS)}; CPU: gloo")
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",") if x]
    except ValueError:
        print(f"error: --batches {a.batches!r}: expected comma-separated ints", file=sys.stderr)
        return 2
    try:
        path = run(a.out, world=a.world, batches=batches, hidden=a.hidden, reps=a.reps,
                   backends=[b for b in a.backends.split(",") if b] or None, name=a.name)
    except AllReduceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from k3lab.harness.bundle import load

    for r in load(path).rows:
        print(f"{r.name:44s} {r.backend:11s} {r.kind:10s} {r.median_us:9.2f} us  err ok "
              f"{(r.error or {}).get('ok')}")
    print(f"bundle -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
