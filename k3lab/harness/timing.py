"""The one timer: CUDA-graph replay with inputs rotated past L2 or kept hot (GPU), labelled smoke timing
(CPU); and the three probes every GPU run records first: copy bandwidth, read-only bandwidth, launch floor.

Every figure carries its `kind`:
    "gpu-graph"  calls captured in one CUDA graph (several calls per graph, one input set each), the
                 graph replayed and timed with CUDA events; per-call time = replay time / calls.
    "gpu-eager"  CUDA events around eager calls (used when a callable cannot be captured).
    "cpu-smoke"  wall clock on the CPU: proves the path runs, says nothing about GPU speed. Never
                 compare or plot it against GPU figures.

Input rotation: a kernel timed over and over on the same buffers finds them in L2 and looks faster
than it is at decode, where every weight comes from HBM once per step. `rotation_count` sizes the
number of distinct input sets from the bytes one call touches versus the L2 size, so that by the time
a set is used again the others have pushed it out of L2. `rotate=False` keeps one set hot in L2 instead;
every Timing records which (`mode`: "rotated" or "hot").

Probes (`probes()` measures once per process and device):
    copy_tbps  device-to-device copy, (read + written) / time: the ceiling of ops that read and write the
               same bytes (KDA state)
    read_tbps  a streaming read (k3lab_kernels.triton.bw_probe, a Triton reduction over 2 GiB): the ceiling
               of ops that mostly read (weights, caches)
    launch_us  per-launch time of a near-empty kernel replayed from a CUDA graph: the floor of tiny ops
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

KINDS = ("gpu-graph", "gpu-eager", "cpu-smoke")
MODES = ("rotated", "hot")


@dataclass
class Timing:
    kind: str
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    samples_us: list[float]
    calls_per_sample: int = 1
    input_sets: int = 1
    bytes_per_call: int | None = None
    note: str = ""
    mode: str = "rotated"  # "rotated": inputs rotated past L2; "hot": one input set replayed (L2-warm)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"timing kind must be one of {KINDS}, got {self.kind!r}")
        if self.mode not in MODES:
            raise ValueError(f"timing mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def from_samples(cls, kind: str, samples_us: Sequence[float], **kw: Any) -> Timing:
        s = [float(x) for x in samples_us]
        if not s:
            raise ValueError("no timing samples")
        return cls(kind=kind, median_us=statistics.median(s), p10_us=percentile(s, 10),
                   p90_us=percentile(s, 90), min_us=min(s), samples_us=[round(x, 4) for x in s], **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (f"{self.kind} ({self.mode}): median {self.median_us:.2f} us (p10 {self.p10_us:.2f}, "
                f"p90 {self.p90_us:.2f}; {len(self.samples_us)} samples x {self.calls_per_sample} calls, "
                f"{self.input_sets} input sets)")


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in 0..100."""
    s = sorted(xs)
    if len(s) == 1:
        return float(s[0])
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


# ---- inputs -----------------------------------------------------------------------------------

def tensor_bytes(obj: Any) -> int:
    """Bytes of every distinct tensor reachable in a (nested) tuple/list/dict."""
    seen: set[int] = set()
    total = 0

    def walk(o: Any) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            key = o.data_ptr()
            if key not in seen:
                seen.add(key)
                total += o.numel() * o.element_size()
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x)

    walk(obj)
    return total


def l2_bytes(device: Any = None) -> int:
    """L2 size of the current CUDA device (50 MiB assumed when torch does not report it)."""
    if not torch.cuda.is_available():
        return 0
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def rotation_count(bytes_per_call: int, l2: int, *, max_sets: int = 64, flush_factor: float = 3.0) -> int:
    """Input sets needed so the sets not in use add up to `flush_factor` x L2 (cold-ish data).
    A call that by itself moves several times the L2 needs no rotation."""
    if l2 <= 0 or bytes_per_call <= 0:
        return 1
    if bytes_per_call >= 8 * l2:
        return 1
    n = math.ceil(flush_factor * l2 / bytes_per_call) + 1
    return max(2, min(max_sets, n))


def _as_args(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _resolve_sets(make_inputs: Callable[[], Any] | None, input_sets: Sequence[Any] | None,
                  rotate: bool, max_sets: int, bytes_per_call: int | None,
                  mem_budget: int | None = None) -> tuple[list[tuple], int]:
    if input_sets is not None and make_inputs is not None:
        raise ValueError("pass either make_inputs or input_sets, not both")
    if input_sets is not None:
        sets = [_as_args(s) for s in input_sets]
        if not sets:
            raise ValueError("input_sets is empty")
        return sets, bytes_per_call or tensor_bytes(sets[0])
    if make_inputs is None:
        return [()], bytes_per_call or 0
    first = _as_args(make_inputs())
    nbytes = bytes_per_call or tensor_bytes(first)
    n = rotation_count(nbytes, l2_bytes(), max_sets=max_sets) if rotate else 1
    if mem_budget and nbytes:
        n = max(1, min(n, mem_budget // max(tensor_bytes(first), 1)))
    return [first] + [_as_args(make_inputs()) for _ in range(n - 1)], nbytes


# ---- GPU ----------------------------------------------------------------------------------------

def bench_gpu(fn: Callable[..., Any], *, make_inputs: Callable[[], Any] | None = None,
              input_sets: Sequence[Any] | None = None, warmup: int = 10, reps: int = 50,
              graph: bool = True, min_calls_per_graph: int = 20, max_sets: int = 64,
              bytes_per_call: int | None = None, mem_budget: int | None = 8 * 2**30,
              rotate: bool = True) -> Timing:
    """Time `fn(*args)` on the current CUDA device.

    Inputs: `input_sets` (a list of argument tuples, used in rotation) or `make_inputs()` (called as
    often as `rotation_count` says from the bytes one call touches versus L2; `bytes_per_call`
    overrides the count of the argument tensors, e.g. when weights sit in a closure). With neither,
    `fn()` takes no arguments.
    With `graph=True` the calls are captured into one CUDA graph, cycling through the input sets,
    at least `min_calls_per_graph` calls; each replay is one sample, timed with CUDA events, and
    divided by the calls in it. If capture fails the eager path runs and the note says why.
    rotate=False: the first input set only, replayed hot in L2 (mode "hot", recorded in the Timing).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_gpu needs CUDA; use bench_cpu (kind='cpu-smoke') on a CPU")
    if not isinstance(rotate, bool):
        raise ValueError(f"bench_gpu: rotate must be a bool, got {rotate!r}")
    sets, nbytes = _resolve_sets(make_inputs, input_sets, rotate, max_sets, bytes_per_call, mem_budget)
    if not rotate:
        sets = sets[:1]
    mode = "rotated" if rotate else "hot"
    # warm up eagerly (compiles, autotunes, allocator pools) on every set
    for i in range(max(len(sets), min(warmup, 3))):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    note = ""
    if graph:
        try:
            t = _bench_graph(fn, sets, nbytes, warmup, reps, min_calls_per_graph)
            t.mode = mode
            return t
        except Exception as e:  # noqa: BLE001 - any capture failure falls back, with the reason kept
            note = f"graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); eager timing"
            torch.cuda.synchronize()
    t = _bench_eager(fn, sets, nbytes, warmup, reps)
    t.note = note or t.note
    t.mode = mode
    return t


def _bench_graph(fn, sets, nbytes, warmup, reps, min_calls) -> Timing:
    calls = max(min_calls, len(sets))
    calls = math.ceil(calls / len(sets)) * len(sets)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # side-stream warm-up, as torch.cuda.graphs recommends
        for s in sets:
            fn(*s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    for _ in range(max(1, warmup)):
        g.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    samples = [starts[i].elapsed_time(ends[i]) * 1e3 / calls for i in range(reps)]
    del g
    return Timing.from_samples("gpu-graph", samples, calls_per_sample=calls, input_sets=len(sets),
                               bytes_per_call=nbytes or None)


def _bench_eager(fn, sets, nbytes, warmup, reps) -> Timing:
    for i in range(max(1, warmup)):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(*sets[i % len(sets)])
        ends[i].record()
    torch.cuda.synchronize()
    samples = [starts[i].elapsed_time(ends[i]) * 1e3 for i in range(reps)]
    return Timing.from_samples("gpu-eager", samples, input_sets=len(sets), bytes_per_call=nbytes or None,
                               note="eager: includes CPU launch overhead")


def measure_copy_bandwidth(nbytes: int = 2 * 2**30, reps: int = 10, warmup: int = 3, device: Any = None) -> float:
    """Device-to-device copy of `nbytes` (well past L2): (bytes read + bytes written) / time, the
    median of `reps` copies, in TB/s. The ceiling every kernel is quoted against; run it at the start
    of every GPU run. On a CPU it times a host memcpy (a smoke figure, labelled by the caller)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cpu":
        nbytes = min(nbytes, 64 * 2**20)
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    samples = []
    if device.type == "cuda":
        for _ in range(warmup):
            dst.copy_(src)
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e-3)
    else:
        for _ in range(warmup):
            dst.copy_(src)
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - t0)
    moved = 2 * n * src.element_size()
    del src, dst
    return moved / statistics.median(samples) / 1e12


def launch_floor_us(launches: int = 200, reps: int = 20, device: Any = None) -> float:
    """Per-launch time of a near-empty kernel (a 1-element add) replayed from a CUDA graph of
    `launches` launches: the floor for a component whose bytes are tiny. On a CPU: the per-call time
    of the same op in a Python loop (smoke figure)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    x = torch.zeros(1, device=device)
    if device.type == "cpu":
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(launches):
                x.add_(1.0)
            samples.append((time.perf_counter() - t0) * 1e6 / launches)
        return statistics.median(samples)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            x.add_(1.0)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(samples)


def measure_read_bandwidth(nbytes: int = 4 * 2**30, reps: int = 10, warmup: int = 3, device: Any = None,
                           detail: dict | None = None) -> float:
    """A streaming read of `nbytes` (far past L2; k3lab_kernels.triton.bw_probe.stream_sum, one partial sum
    per program, nothing else written): bytes read / time in TB/s, the median of `reps` reads, for the
    fastest of the probe's tile shapes (`detail`, when given, receives every shape's figure). The ceiling of
    ops that mostly read (weights, caches). On a CPU: torch's sum over a 64 MiB buffer (a smoke figure,
    labelled by the caller)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cpu":
        x = torch.ones(min(nbytes, 64 * 2**20) // 4, dtype=torch.float32)
        samples = []
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            x.sum()
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        return x.numel() * 4 / statistics.median(samples) / 1e12
    from k3lab_kernels.triton.bw_probe import CONFIGS, stream_sum

    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    best = 0.0
    for cfg in CONFIGS:
        part = stream_sum(x, config=cfg)  # compiles; allocates the partial sums once
        for _ in range(warmup):
            stream_sum(x, part, cfg)
        samples = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            stream_sum(x, part, cfg)
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e-3)
        got = float(part.double().sum())
        if abs(got - x.numel()) > 1e-6 * x.numel():
            raise RuntimeError(f"read probe {cfg}: the streaming sum read {got} ones, expected {x.numel()}")
        tbps = x.numel() * x.element_size() / statistics.median(samples) / 1e12
        if detail is not None:
            detail[str(cfg)] = tbps
        best = max(best, tbps)
        del part
    del x
    return best


_PROBES: dict[str, dict[str, float]] = {}


def probes(device: Any = None, *, fresh: bool = False) -> dict[str, Any]:
    """{copy_tbps, read_tbps, launch_us, kind} of `device` (on a GPU also read_by_tile: the read probe's
    figure per tile shape), measured once per process (fresh=True measures again). kind is "gpu" or
    "cpu-smoke" (host figures: never a GPU floor)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    key = str(dev)
    if fresh or key not in _PROBES:
        detail: dict = {}
        _PROBES[key] = dict(copy_tbps=measure_copy_bandwidth(device=dev),
                            read_tbps=measure_read_bandwidth(device=dev, detail=detail),
                            launch_us=launch_floor_us(device=dev),
                            kind="gpu" if dev.type == "cuda" else "cpu-smoke")
        if detail:
            _PROBES[key]["read_by_tile"] = detail
    return dict(_PROBES[key])


# ---- CPU ----------------------------------------------------------------------------------------

def bench_cpu(fn: Callable[..., Any], *, make_inputs: Callable[[], Any] | None = None,
              input_sets: Sequence[Any] | None = None, warmup: int = 2, reps: int = 10,
              bytes_per_call: int | None = None) -> Timing:
    """Wall-clock per call on the CPU, labelled kind='cpu-smoke' (never a GPU figure)."""
    sets, nbytes = _resolve_sets(make_inputs, input_sets, False, 1, bytes_per_call)
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    samples = []
    for i in range(reps):
        t0 = time.perf_counter_ns()
        fn(*sets[i % len(sets)])
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return Timing.from_samples("cpu-smoke", samples, input_sets=len(sets), bytes_per_call=nbytes or None,
                               note="CPU wall clock: smoke only, not a GPU figure", mode="hot")


def bench(fn: Callable[..., Any], *, device: Any = None, **kw: Any) -> Timing:
    """bench_gpu on a CUDA device, bench_cpu otherwise (keyword arguments each does not take are
    dropped)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return bench_gpu(fn, **kw)
    cpu_kw = {k: v for k, v in kw.items() if k in ("make_inputs", "input_sets", "warmup", "reps", "bytes_per_call")}
    if kw.get("rotate") is False and cpu_kw.get("input_sets"):
        cpu_kw["input_sets"] = list(cpu_kw["input_sets"])[:1]
    return bench_cpu(fn, **cpu_kw)


# ---- kernels --------------------------------------------------------------------------------------

def kernel_list(fn: Callable[..., Any], *args: Any, calls: int = 3, input_sets: list[tuple] | None = None,
                durations: bool = False) -> list[dict[str, Any]]:
    """Kernels one call of `fn(*args)` launches, via torch.profiler: [{"name", "count"}] with count
    per call (launches of that kernel / calls), in first-seen order. On a CPU-only machine the list
    holds the top-level CPU ops instead, each with "device": "cpu". `input_sets`: argument tuples the
    profiled calls rotate over (call i takes input_sets[i % n]) instead of `args`. `durations`: each entry
    also holds "us", every launch's device time (on a CPU, the op's CPU time) in microseconds: eager calls,
    so a PDL launch counts from when it was let in, and no launch gaps (bench_gpu times a whole call)."""
    from torch.profiler import ProfilerActivity, profile

    if input_sets is not None and not input_sets:
        raise ValueError("kernel_list: input_sets must hold at least one argument tuple, got an empty list")
    sets = list(input_sets) if input_sets is not None else [args]
    cuda = torch.cuda.is_available()
    fn(*sets[0])  # warm (compile / autotune outside the profile)
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for i in range(calls):
            fn(*sets[i % len(sets)])
        if cuda:
            torch.cuda.synchronize()
    counts: dict[str, int] = {}
    times: dict[str, list[float]] = {}
    for evt in prof.events():
        if cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            name = evt.name  # copies and memsets count as launches too
            us = getattr(evt, "device_time_total", None)
            us = evt.cuda_time_total if us is None else us
        else:
            if evt.cpu_parent is not None or not evt.name.startswith("aten::"):
                continue
            name, us = evt.name, evt.cpu_time_total
        name = name if len(name) <= 200 else name[:197] + "..."
        counts[name] = counts.get(name, 0) + 1
        times.setdefault(name, []).append(float(us))
    dev = "cuda" if cuda else "cpu"
    return [dict({"name": k, "count": round(v / calls, 3), "device": dev}, **({"us": times[k]} if durations else {}))
            for k, v in counts.items()]


def launches_per_call(kernels: list[dict[str, Any]]) -> float | None:
    """Total GPU launches per call from a `kernel_list` (None for a CPU op list)."""
    if not kernels or kernels[0].get("device") != "cuda":
        return None
    return round(sum(k["count"] for k in kernels), 3)


def profile_once(fn: Callable[[], Any], *, range_name: str = "target", warmup: int = 3) -> None:
    """One call of `fn` inside an NVTX range for a profiler (`ncu --nvtx --nvtx-include RANGE/`), after `warmup`
    calls that compile and warm the allocator, each side synchronized (the experiments' ncu scripts)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(range_name)
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
