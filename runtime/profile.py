"""Profile figures of a run, named as msprof names them (its trace and picture: geir.runtime.trace).

Where the time went, on one modelled timeline (time 0: the request; GE's host work first, then the
Runtime submits the program's tasks and the device runs them):
- `simulated_time_us`: the device's span, from the Runtime's first submission to the end of the last task;
- `kernel_time_us`: the kernels' time on the cores; `transfer_time_us`: the host-device copies' time;
- `host_ge_us`: GE's host work for this run (compile, or re-plan for a new shape; 0 on a plan-cache hit),
  measured in host time where GEIR really does it;
- `end_to_end_us`: host_ge_us plus the device's span: when the run's last task ended.

Definitions (per kernel, then over the run weighted by kernel time):
- `<pipe>_ratio`: the pipe's busy cycles / (the kernel's cycles x the cores it used), msprof's aic_*_ratio.
- `overlap_ratio`: how much of the shorter of data movement (MTE2) and compute (max of cube and
  vector) was hidden under the other: (mte2 + compute - elapsed) / min(mte2, compute), per core,
  clipped to [0, 1]; 0 when they ran one after the other, 1 when one was wholly hidden.
- `memory_bound`: mte2 time / max(cube time, vector time), as msprof defines it.
- `tflops` and `cube_peak_fraction`: FLOPs over kernel time, against the chip's f16 cube peak.

A kernel runs on an engine (`engine` in its entry): `aicore`, a tiled kernel on the AI cores, or
`aicpu`, an op GE placed on the AI CPU. An AI CPU task keeps no AI Core pipe busy: the run's pipe
ratios, overlap_ratio and memory_bound are over the AI Core kernels; its time counts in
`kernel_time_us` and its FLOPs in `tflops`.
"""

from __future__ import annotations

import math

from typing import Any

from geir.kernels.base import KernelStats
from geir.runtime.interpreter import RunResult
from geir.target_npu.sim import PIPE_INDEX
from geir.target_npu.target import Target

PROFILE_KEYS = (
    "simulated_time_us", "kernel_time_us", "transfer_time_us", "host_ge_us", "end_to_end_us", "mte2_ratio",
    "mte1_ratio", "cube_ratio", "vec_ratio", "mte3_ratio", "fixp_ratio", "aiv_mte2_ratio", "overlap_ratio",
    "memory_bound", "gm_read_bytes", "gm_write_bytes", "hbm_read_bytes", "hbm_write_bytes", "tflops",
    "cube_peak_fraction", "kernels", "plan_cache", "faults", "launch_mode", "device_idle_us",
)
TOP_KERNELS = 10  # the --profile text's top-N view: the kernels that took longest
_RATIO_PIPES = {"mte2_ratio": "MTE2", "mte1_ratio": "MTE1", "cube_ratio": "CUBE", "vec_ratio": "VECTOR",
                "mte3_ratio": "MTE3",
                "fixp_ratio": "FIXP", "aiv_mte2_ratio": "AIV_MTE2"}


def cube_peak_flops(target: Target) -> float:
    """FLOP/s of every cube core at the f16 rate (2 FLOPs per multiply-add)."""
    m, k, n = target.cube_fractal("f16")
    return target.cube_cores * m * k * n * 2 * target.clock_hz


def _figures(busy: dict[str, float], core_cycles: float, elapsed_per_core: float, cores: int, flops: float,
             seconds: float, target: Target) -> dict[str, Any]:
    out: dict[str, Any] = {key: (busy[pipe] / core_cycles if core_cycles else 0.0) for key, pipe in _RATIO_PIPES.items()}
    mte2 = busy["MTE2"] / max(cores, 1)
    compute = max(busy["CUBE"], busy["VECTOR"]) / max(cores, 1)
    shorter = min(mte2, compute)
    out["overlap_ratio"] = min(max((mte2 + compute - elapsed_per_core) / shorter, 0.0), 1.0) if shorter > 0 else 0.0
    heavier = max(busy["CUBE"], busy["VECTOR"])
    out["memory_bound"] = busy["MTE2"] / heavier if heavier else 0.0
    out["tflops"] = flops / seconds / 1e12 if seconds > 0 else 0.0
    out["cube_peak_fraction"] = flops / seconds / cube_peak_flops(target) if seconds > 0 else 0.0
    return out


def kernel_profile(k: KernelStats, target: Target) -> dict[str, Any]:
    """One kernel's figures."""
    seconds = k.cycles / target.clock_hz
    entry: dict[str, Any] = {"name": k.name, "engine": k.engine, "tiling": k.tiling.to_attr() if k.tiling else {},
                             "time_us": seconds * 1e6, "cores": k.cores}
    entry.update(_figures(k.busy, k.cycles * k.cores, k.cycles, k.cores, k.flops, seconds, target))
    entry.update(gm_read_bytes=k.gm_read_bytes, gm_write_bytes=k.gm_write_bytes,
                 hbm_read_bytes=k.hbm_read_bytes, hbm_write_bytes=k.hbm_write_bytes)
    return entry


def time_split(result: RunResult, host_ge_us: float = 0.0) -> dict[str, float]:
    """Where a run's time went: the device's span, the kernels', the copies', GE's and end to end (us)."""
    end = max((t.end_us for t in result.tasks), default=0.0)
    return {"simulated_time_us": end,
            "kernel_time_us": sum(t.end_us - t.start_us for t in result.tasks if t.kind == "kernel"),
            "transfer_time_us": sum(t.end_us - t.start_us for t in result.tasks if t.kind != "kernel"),
            "host_ge_us": host_ge_us, "end_to_end_us": host_ge_us + end}


def union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, -math.inf
    for s, e in sorted(spans):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def device_idle_us(result: RunResult) -> float:
    """The device's idle time within its span (from the Runtime's start to its last task's end): no kernel and no
    copy running, the device waiting (for the host's submissions, mostly, where launches are submitted one by
    one)."""
    end = max((t.end_us for t in result.tasks), default=0.0)
    return max(end - union_us([(t.start_us, t.end_us) for t in result.tasks]), 0.0)


def profile(result: RunResult, plan_cache: dict[str, Any] | None = None,
            faults: list[dict[str, Any]] | None = None, host_ge_us: float = 0.0) -> dict[str, Any]:
    """The spec's profile of one run (the keys of --profile-json, in order); `host_ge_us` is GE's host
    work that this run waited for (its compile or re-plan)."""
    target = result.target
    kernels = result.kernels
    # the pipes' figures are the AI cores': an AI CPU task's cores are ARM cores with no such pipes
    aicore = [k for k in kernels if k.engine == "aicore"]
    busy = {p: sum(k.busy[p] for k in aicore) for p in PIPE_INDEX}
    core_cycles = sum(k.cycles * k.cores for k in aicore)
    aicore_cycles = sum(k.cycles for k in aicore)
    mean_cores = core_cycles / aicore_cycles if aicore_cycles else 0.0
    figures = _figures(busy, core_cycles, aicore_cycles, mean_cores, 0.0, 0.0, target)
    flops = sum(k.flops for k in kernels)
    seconds = sum(k.cycles for k in kernels) / target.clock_hz
    figures["tflops"] = flops / seconds / 1e12 if seconds > 0 else 0.0
    figures["cube_peak_fraction"] = flops / seconds / cube_peak_flops(target) if seconds > 0 else 0.0
    gm = result.gm
    # graph mode: capturing the program's task graph when it was loaded is GE's host work as its compile is
    out: dict[str, Any] = time_split(result, host_ge_us + result.capture_us)
    out.update({key: figures[key] for key in (*_RATIO_PIPES,
                                              "overlap_ratio", "memory_bound")})
    out.update(gm_read_bytes=gm.gm_read_bytes, gm_write_bytes=gm.gm_write_bytes, hbm_read_bytes=gm.hbm_read_bytes,
               hbm_write_bytes=gm.hbm_write_bytes, tflops=figures["tflops"],
               cube_peak_fraction=figures["cube_peak_fraction"])
    out["kernels"] = [kernel_profile(k, target) for k in kernels]
    out["plan_cache"] = plan_cache or {"hits": 0, "misses": 1, "replan_ms": 0.0}
    out["faults"] = faults if faults is not None else list(result.faults)
    out["launch_mode"] = result.launch_mode
    out["device_idle_us"] = device_idle_us(result)
    return out


# what each figure of the --profile table is (a definition, never a verdict the number could contradict)
_LEGEND = {
    "simulated_time_us": "the device's span: simulated us from the Runtime's start to the end of the last task",
    "kernel_time_us": "the kernels' simulated time on the cores (the fusion payoff is judged on this)",
    "transfer_time_us": "the host-device copies' simulated time (rt.h2d, rt.d2h)",
    "host_ge_us": "GE's host work this run waited for: compile or re-plan (0 on a plan-cache hit), and in graph mode "
                  "the capture of its task graph (once per program)",
    "end_to_end_us": "host_ge_us + the device's span, on one timeline: when the run's last task ended",
    "device_idle_us": "the device's idle time within its span: no kernel or copy running (waiting for submissions)",
    "launch_mode": "how launches reach the device: single-op (the host submits each) or graph (one replay)",
    "tflops": "TFLOP/s achieved: the kernels' FLOPs over the kernels' time",
    "cube_peak_fraction": "tflops / the target's f16 cube peak",
    "overlap_ratio": "overlapped share of the shorter of MTE2 (data in) and compute time",
    "memory_bound": "MTE2 time / max(cube, vector) time (above 1: loading takes longer than computing)",
    "mte2_ratio": "MTE2 (global memory in) busy: busy cycles / (kernel cycles x cores used)",
    "mte1_ratio": "MTE1 (L1 to L0A/L0B) busy, likewise",
    "cube_ratio": "cube unit (matmuls) busy, likewise",
    "vec_ratio": "vector unit busy, likewise",
    "mte3_ratio": "MTE3 (global memory out) busy, likewise",
    "fixp_ratio": "FIXP (cube results out of L0C) busy, likewise",
    "aiv_mte2_ratio": "the vector cores' own MTE2 (GM to UB) busy where they are separate cores, likewise",
    "gm_read_bytes": "bytes the cores read from global memory",
    "gm_write_bytes": "bytes the cores wrote to global memory",
    "hbm_read_bytes": "bytes of those reads that missed L2 and came from HBM",
    "hbm_write_bytes": "bytes of those writes that reached HBM past L2",
}


def format_profile(p: dict[str, Any], top: int = TOP_KERNELS) -> str:
    """The --profile table: the faults injected if any, each figure by its spec key with what it is, one line
    per kernel, then the op-type rollup (msprof's op_statistic) and the `top` longest kernels."""

    def row(key: str, value: str) -> str:
        return f"{key:<20}{value:>14}   {_LEGEND[key]}"

    def mib(key: str) -> str:
        return row(key, f"{p[key]}") + f" ({p[key] / 2**20:.2f} MiB)"

    lines = [
        *(row(key, f"{p[key]:.2f}") for key in ("simulated_time_us", "kernel_time_us", "transfer_time_us",
                                                 "host_ge_us", "end_to_end_us", "device_idle_us")),
        row("launch_mode", p["launch_mode"]),
        row("tflops", f"{p['tflops']:.2f}"),
        row("cube_peak_fraction", f"{p['cube_peak_fraction']:.3f}"),
        row("overlap_ratio", f"{p['overlap_ratio']:.2f}"),
        row("memory_bound", f"{p['memory_bound']:.2f}"),
        *(row(key, f"{p[key]:.2f}") for key in _RATIO_PIPES),
        *(mib(key) for key in ("gm_read_bytes", "gm_write_bytes", "hbm_read_bytes", "hbm_write_bytes")),
        "",
        "per kernel: time_us its simulated time, cores the cores it ran on, then the figures above",
        "(overlap = overlap_ratio, mem_bnd = memory_bound, TFLOP/s = tflops, peak% = 100 x cube_peak_fraction;",
        "engine: aicore, or aicpu for an op GE placed on the AI CPU, whose cores are AI CPU cores)",
        f"{'kernel':<24}{'time_us':>10}{'cores':>6}{'mte2':>7}{'mte1':>7}{'cube':>7}{'vec':>7}{'mte3':>7}{'fixp':>7}"
        f"{'overlap':>8}{'mem_bnd':>8}{'TFLOP/s':>9}{'peak%':>7}{'engine':>8}",
    ]
    for k in p["kernels"]:
        lines.append(f"{k['name']:<24}{k['time_us']:>10.2f}{k['cores']:>6}{k['mte2_ratio']:>7.2f}{k['mte1_ratio']:>7.2f}"
                     f"{k['cube_ratio']:>7.2f}"
                     f"{k['vec_ratio']:>7.2f}{k['mte3_ratio']:>7.2f}{k['fixp_ratio']:>7.2f}{k['overlap_ratio']:>8.2f}"
                     f"{k['memory_bound']:>8.2f}{k['tflops']:>9.2f}{100 * k['cube_peak_fraction']:>7.1f}"
                     f"{k.get('engine', 'aicore'):>8}")
    lines += ["", *_format_op_statistic(op_statistic(p["kernels"])), "", *_format_top(p["kernels"], top)]
    return "\n".join(_format_faults(p.get("faults") or []) + lines)


def op_statistic(kernels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """msprof's op_statistic of a profile's kernels: per op type and engine, the count, total, avg, min and max
    time (us) and the share of all kernel time, the largest total first."""
    groups: dict[tuple[str, str], list[float]] = {}
    for k in kernels:
        groups.setdefault((k["name"], k.get("engine", "aicore")), []).append(k["time_us"])
    total = sum(k["time_us"] for k in kernels)
    rows = [{"op_type": name, "engine": engine, "count": len(times), "total_time_us": sum(times),
             "avg_time_us": sum(times) / len(times), "min_time_us": min(times), "max_time_us": max(times),
             "ratio": sum(times) / total if total else 0.0}
            for (name, engine), times in groups.items()]
    return sorted(rows, key=lambda r: (-r["total_time_us"], r["op_type"]))


def _format_op_statistic(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["per op type (msprof's op_statistic): count, total/avg/min/max time_us, share of kernel time",
             f"{'op type':<24}{'count':>6}{'total_us':>11}{'avg_us':>10}{'min_us':>10}{'max_us':>10}{'share%':>8}"
             f"{'engine':>8}"]
    for r in rows:
        lines.append(f"{r['op_type']:<24}{r['count']:>6}{r['total_time_us']:>11.2f}{r['avg_time_us']:>10.2f}"
                     f"{r['min_time_us']:>10.2f}{r['max_time_us']:>10.2f}{100 * r['ratio']:>8.1f}{r['engine']:>8}")
    return lines


def _format_top(kernels: list[dict[str, Any]], top: int) -> list[str]:
    total = sum(k["time_us"] for k in kernels)
    ranked = sorted(enumerate(kernels), key=lambda ik: (-ik[1]["time_us"], ik[0]))[:top]
    lines = [f"top {len(ranked)} of {len(kernels)} kernels by time (#: its place in the run)",
             f"{'#':>4}  {'kernel':<24}{'time_us':>10}{'share%':>8}{'cum%':>7}"]
    cumulative = 0.0
    for i, k in ranked:
        share = k["time_us"] / total if total else 0.0
        cumulative += share
        lines.append(f"{i:>4}  {k['name']:<24}{k['time_us']:>10.2f}{100 * share:>8.1f}{100 * cumulative:>7.1f}")
    return lines


def _format_faults(faults: list[dict[str, Any]]) -> list[str]:
    """A heading the reader cannot miss when faults were injected: every figure below includes their recovery."""
    if not faults:
        return []
    lines = [f"FAULTS INJECTED: {len(faults)}, recovered; every figure below includes the recovery"]
    for f in sorted(faults, key=lambda f: f.get("task", 0)):
        cost = f", +{f['cost_us']:.2f} us" if isinstance(f.get("cost_us"), (int, float)) else ""
        lines.append(f"  {f.get('kind')}@{f.get('task')} on {f.get('op')} ({f.get('loc')}): {f.get('recovery')}{cost}")
    return lines + [""]
