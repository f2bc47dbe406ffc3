"""How near a kernel ran to the chip's limits: achieved FLOP/s against the roofline for its arithmetic intensity.

The roof is the tightest of three floors under a kernel's time, all from the target's data file:
- compute: its FLOPs at the cube's f16 peak (every AIC, 2 FLOPs per multiply-add);
- global memory: the bytes its cores moved, at the L2 rate of every port the kernel's cores have
  (the cube cores' for cube kernels, every vector unit's for vector kernels, both for the CV-split
  FlashAttention whose vector cores load and store on their own; MTE2 reads and MTE3/FIXP
  writes run on separate pipes, so the larger of the two directions counts);
- HBM: the reads that missed L2, at the chip's HBM bandwidth (or every port's HBM rate, if lower).
  Writes land in L2 and are written back behind the kernel (the cost model charges them at the L2
  rate while the tensor fits L2), so they are not a floor under the kernel's time.

`fraction` is that floor over the time the kernel took: 1 means the kernel ran at its roof. For a
kernel with FLOPs it equals achieved FLOP/s over the roofline (min(peak, intensity x bandwidth)).
"""

from __future__ import annotations

from typing import Any

import attrs

from geir.kernels.base import KernelStats
from geir.kernels.flash_attention import FlashAttentionKernel
from geir.kernels.matmul import MatmulKernel
from geir.runtime.profile import cube_peak_flops
from geir.target_npu.target import Target


BOUNDS = ("compute", "global memory", "HBM")
# kernels whose data moves through the cube cores' ports (into L1); the others stream through the vector units' UBs
CUBE_KERNELS = frozenset(FlashAttentionKernel.OPS + MatmulKernel.OPS)


@attrs.frozen
class Roofline:
    """One kernel against its roofline: what it achieved, the roof it had, and which floor made the roof."""

    time_s: float
    flops: float
    gm_bytes: int               # read and written by the cores
    hbm_bytes: int              # read past L2
    peak_flops: float           # the cube's FLOP/s
    gm_bytes_per_s: float       # every core's global-memory port at the L2 rate
    hbm_bytes_per_s: float      # what HBM delivers to the chip
    floors_s: dict[str, float]  # the least time each resource allows
    bound: str                  # the floor that is highest: the roof

    @property
    def floor_s(self) -> float:
        return self.floors_s[self.bound]

    @property
    def fraction(self) -> float:
        """The roofline's time over the time taken (achieved / roofline)."""
        return self.floor_s / self.time_s if self.time_s > 0 else 0.0

    @property
    def achieved_tflops(self) -> float:
        return self.flops / self.time_s / 1e12 if self.time_s > 0 else 0.0

    @property
    def roof_tflops(self) -> float:
        """min(peak, intensity x bandwidth): the FLOP/s the roofline allows this kernel."""
        return self.flops / self.floor_s / 1e12 if self.floor_s > 0 else 0.0

    @property
    def intensity_gm(self) -> float | None:
        """FLOPs per byte the cores moved (None when nothing moved)."""
        return self.flops / self.gm_bytes if self.gm_bytes else None

    @property
    def intensity_hbm(self) -> float | None:
        """FLOPs per byte read from HBM (None when none was: everything was served from L2)."""
        return self.flops / self.hbm_bytes if self.hbm_bytes else None

    def evidence(self) -> dict[str, Any]:
        """The figures as plain JSON values."""
        return {
            "achieved_tflops": self.achieved_tflops,
            "roofline_tflops": self.roof_tflops,
            "cube_peak_tflops": self.peak_flops / 1e12,
            "roofline_fraction": self.fraction,
            "cube_peak_fraction": self.flops / self.time_s / self.peak_flops if self.time_s > 0 else 0.0,
            "bound": self.bound,
            "intensity_flop_per_gm_byte": self.intensity_gm,
            "intensity_flop_per_hbm_byte": self.intensity_hbm,
            "gm_tb_per_s": self.gm_bytes_per_s / 1e12,
            "hbm_tb_per_s": self.hbm_bytes_per_s / 1e12,
        }


def bandwidths(target: Target, kernel: str = "ge.matmul", both_sides: bool = False) -> tuple[float, float]:
    """(global-memory bytes/s of the kernel's ports at the L2 rate, HBM bytes/s they can draw) from the target.

    `both_sides`: a kernel that moves data through the cube cores' and the vector cores' own ports (the CV-split
    FlashAttention of a chip whose cube and vector units are separate cores) has the ports of both."""
    mem = target.memory
    vector_ports = target.cube_cores * target.vector_per_cube
    if both_sides:
        ports = target.cube_cores + vector_ports
    else:
        ports = target.cube_cores if kernel in CUBE_KERNELS else vector_ports
    gm = mem.l2_read_bytes_per_cycle * ports * target.clock_hz
    hbm = min(mem.hbm_bytes_per_s, mem.hbm_read_bytes_per_cycle * ports * target.clock_hz)
    return gm, hbm


def roofline(k: KernelStats, target: Target) -> Roofline:
    """Where one launched kernel stands against the target's roofline."""
    peak = cube_peak_flops(target)
    gm_bw, hbm_bw = bandwidths(target, k.name, bool(getattr(k.tiling, "cv_split", False)))
    floors = {
        "compute": k.flops / peak,
        "global memory": max(k.gm_read_bytes, k.gm_write_bytes) / gm_bw,
        "HBM": k.hbm_read_bytes / hbm_bw,
    }
    bound = max(BOUNDS, key=lambda b: floors[b])
    return Roofline(k.cycles / target.clock_hz, k.flops, k.gm_read_bytes + k.gm_write_bytes, k.hbm_read_bytes,
                    peak, gm_bw, hbm_bw, floors, bound)
