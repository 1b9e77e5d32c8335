"""Floors: how fast a component could possibly run on this GPU, and how far a measurement is from it.

A decode component at small batch is bound by bytes (weights, state, cache) or, when its bytes are
tiny, by the cost of a launch. Its floor is

    floor_us = max(bytes / copy_bw, launch_floor_us * min_launches, flops / peak_flops)

with copy_bw the measured device-to-device copy bandwidth (bytes read + written / time, K3_SPEC
section 6: 4.275 TB/s on an H200), launch_floor_us the per-launch time of a near-empty kernel replayed
from a CUDA graph, and peak_flops optional (None = maths is never the floor, true at decode).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

H200_COPY_TBPS = 4.275  # K3_SPEC section 6, the ceiling to quote against


@dataclass
class Floor:
    bytes: int
    flops: int
    copy_tbps: float
    launch_us: float
    min_launches: int = 1
    peak_tflops: float | None = None

    @property
    def bytes_us(self) -> float:
        return self.bytes / (self.copy_tbps * 1e12) * 1e6 if self.copy_tbps > 0 else 0.0

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
        """What sets the floor: 'bytes', 'launch' or 'flops'."""
        f = {"bytes": self.bytes_us, "launch": self.launch_floor_us, "flops": self.flops_us}
        return max(f, key=f.get)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(bytes_us=self.bytes_us, launch_floor_us=self.launch_floor_us, flops_us=self.flops_us,
                 floor_us=self.floor_us, bound=self.bound)
        return d


def floor(bytes_moved: int, flops: int = 0, *, copy_tbps: float, launch_us: float, min_launches: int = 1,
          peak_tflops: float | None = None) -> Floor:
    if bytes_moved < 0 or flops < 0:
        raise ValueError("bytes and flops must be >= 0")
    return Floor(int(bytes_moved), int(flops), float(copy_tbps), float(launch_us), int(min_launches), peak_tflops)


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
        "distance": distance(median_us, fl),
        "achieved_tbps": tb,
        "pct_of_copy": 100.0 * tb / fl.copy_tbps if fl.copy_tbps > 0 else None,
        "tflops": fl.flops / (median_us * 1e-6) / 1e12 if median_us > 0 else 0.0,
    }
