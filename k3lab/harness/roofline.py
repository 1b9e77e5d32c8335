"""Floors: how fast a component could possibly run on this GPU, and how far a measurement is from it.

A decode component at small batch is bound by bytes (weights, state, cache) or, when its bytes are
tiny, by the cost of a launch. Its floor is

    floor_us = max(bytes / bw, launch_us * min_launches, flops / peak_flops)

with bw the bandwidth that fits the op, measured in the same run (k3lab.harness.timing.probes):
    "read"  streaming-read bandwidth, for ops that mostly read (weights, caches): ~4.6 TB/s on an H200
    "copy"  device-to-device copy bandwidth, (read + written) / time, for ops that read and write the
            same bytes (KDA state): ~4.2 TB/s on an H200
launch_us the per-launch time of a near-empty kernel replayed from a CUDA graph, and peak_flops optional
(None = maths is never the floor, true at decode). Every row records which bandwidth its floor used.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

BW_KINDS = ("read", "copy")


@dataclass
class Floor:
    bytes: int
    flops: int
    bw_tbps: float
    launch_us: float
    bw_kind: str = "copy"
    min_launches: int = 1
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        if self.bw_kind not in BW_KINDS:
            raise ValueError(f"floor: bw_kind must be one of {BW_KINDS}, got {self.bw_kind!r}")

    @property
    def bytes_us(self) -> float:
        return self.bytes / (self.bw_tbps * 1e12) * 1e6 if self.bw_tbps > 0 else 0.0

    @property
    def launch_floor_us(self) -> float:
        return self.launch_us * self.min_launches

    @property
    def flops_us(self) -> float:
        if not self.peak_tflops:
            return 0.0
        return self.flops / (self.peak_tflops * 1e12) * 1e6

    @property
    def floor_us(self) -> float:
        return max(self.bytes_us, self.launch_floor_us, self.flops_us)

    @property
    def bound(self) -> str:
        """What sets the floor: 'read' / 'copy' (bytes over that bandwidth), 'launch' or 'flops'."""
        f = {self.bw_kind: self.bytes_us, "launch": self.launch_floor_us, "flops": self.flops_us}
        return max(f, key=f.get)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(bytes_us=self.bytes_us, launch_floor_us=self.launch_floor_us, flops_us=self.flops_us,
                 floor_us=self.floor_us, bound=self.bound)
        return d


def floor(bytes_moved: int, flops: int = 0, *, bw_tbps: float, launch_us: float, bw_kind: str = "copy",
          min_launches: int = 1, peak_tflops: float | None = None) -> Floor:
    if bytes_moved < 0 or flops < 0:
        raise ValueError("bytes and flops must be >= 0")
    return Floor(int(bytes_moved), int(flops), float(bw_tbps), float(launch_us), bw_kind, int(min_launches),
                 peak_tflops)


def floor_from_probes(bytes_moved: int, flops: int, probes: dict[str, Any], bw_kind: str) -> Floor:
    """The floor of an op of `bw_kind` ("read" | "copy") from `k3lab.harness.timing.probes()`."""
    if bw_kind not in BW_KINDS:
        raise ValueError(f"floor: bw_kind must be one of {BW_KINDS}, got {bw_kind!r}")
    return floor(bytes_moved, flops, bw_tbps=probes[f"{bw_kind}_tbps"], launch_us=probes["launch_us"],
                 bw_kind=bw_kind)


def achieved_tbps(bytes_moved: int, median_us: float) -> float:
    """Bytes per second the component moved, in TB/s."""
    return bytes_moved / (median_us * 1e-6) / 1e12 if median_us > 0 else 0.0


def distance(median_us: float, fl: Floor) -> float:
    """median / floor: 1.0 is at the floor, 2.0 is twice as slow as it could be."""
    return median_us / fl.floor_us if fl.floor_us > 0 else float("inf")


def assess(median_us: float, fl: Floor) -> dict[str, Any]:
    """Everything a results row wants from one measurement against its floor."""
    tb = achieved_tbps(fl.bytes, median_us)
    return {
        "floor_us": fl.floor_us,
        "bound": fl.bound,
        "floor_bw": fl.bw_kind,
        "bw_tbps": fl.bw_tbps,
        "distance": distance(median_us, fl),
        "achieved_tbps": tb,
        "pct_of_bw": 100.0 * tb / fl.bw_tbps if fl.bw_tbps > 0 else None,
        "tflops": fl.flops / (median_us * 1e-6) / 1e12 if median_us > 0 else 0.0,
    }
