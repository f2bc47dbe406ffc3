"""The timeline picture of a run: GE's passes, the Runtime's tasks and every core's pipes, as a PNG.

`timeline_data` collects the rows from the runs' one typed timeline (geir.runtime.trace, which the
Chrome trace renders too; no matplotlib needed) and
`render_png` draws them with matplotlib's Agg backend, imported only there, so GEIR works
without the `plot` extra. The picture has three panels, one clock each, top to bottom:
- GE: the compile and each re-plan with their passes, in host wall-clock milliseconds (the idle
  time between them cut out, as gerun's trace lays GE's steps end to end);
- Runtime: every task on its stream (copies, kernels) in simulated microseconds, all runs one
  after another, the stretch the kernels ran in shaded;
- cores, zoomed to that stretch: which kernel ran when, per pipe the share of the chip's cores
  busy (all cores at once), then a few cores in detail, one thin lane per pipe.
"""

from __future__ import annotations

import bisect
import io
from typing import Sequence

import attrs
import numpy as np

from geir.runtime.trace import CORE_PID0, DEVICE_PID, Span, Trace
from geir.target_npu.sim import PIPES
from geir.target_npu.target import Target

# One colour per pipe, the same in every panel and picture (the legend lists them in pipeline order).
PIPE_COLOURS = {
    "MTE2": "#1f77b4", "MTE1": "#17becf", "CUBE": "#d62728", "FIXP": "#ff7f0e", "VECTOR": "#2ca02c",
    "MTE3": "#9467bd", "AIV_MTE2": "#8c564b", "SCALAR": "#7f7f7f",
}
TASK_COLOURS = {"h2d": "#6baed6", "d2h": "#9e9ac8", "kernel": "#636363"}
PASS_COLOURS = ("#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb", "#fcbba1", "#d9d9d9")
DETAIL_CORES = 4  # cores drawn pipe by pipe; the busy-fraction band stands for all of them
WIDTH_IN, DPI = 16.0, 100


@attrs.frozen
class Row:
    """One lane of the picture: spans in microseconds on one clock, each with an optional name and kind."""

    track: str  # "GE", "Runtime" or "core N"
    lane: str  # GE: "steps" / "passes"; Runtime: "stream N"; a core: the pipe's name
    clock: str  # "host wall clock" or "simulated"
    start: np.ndarray
    end: np.ndarray
    names: tuple[str, ...] = ()  # one per span where spans are few (passes, tasks); empty for pipes
    kinds: tuple[str, ...] = ()  # one per span: the task kind that picks its colour
    core: int | None = None

    @property
    def busy_us(self) -> float:
        """Microseconds this lane was busy."""
        return float(np.sum(self.end - self.start))


@attrs.frozen
class Timeline:
    """Everything the picture shows, in microseconds: rows, kernel spans, run spans, and what ran where."""

    source: str
    target: str
    cores: int  # the chip's cores (the busy fraction's denominator)
    rows: list[Row]
    kernels: list[tuple[str, float, float]]  # simulated (name, start, end)
    runs: list[tuple[float, float]]  # simulated (start, end) of each run
    ge_cuts: list[float] = attrs.field(factory=list)  # where GE's idle wall-clock time was cut out

    def track(self, name: str) -> list[Row]:
        """The rows of one track ("GE", "Runtime", "core N"), top to bottom."""
        return [r for r in self.rows if r.track == name]

    @property
    def core_rows(self) -> list[Row]:
        """One row per core and pipe that did work, by core, then in pipeline order."""
        return [r for r in self.rows if r.core is not None]

    @property
    def simulated_us(self) -> float:
        """When the last run ended, in simulated microseconds."""
        return self.runs[-1][1] if self.runs else 0.0


def timeline_data(trace: Trace, target: Target, source: str = "") -> Timeline:
    """The rows of the picture, from the runs' one timeline (geir.runtime.trace): GE's spans on the host
    clock, the device's tasks and every core's pipes on the simulated clock, the runs one after another (the
    GE time between them, when the device had nothing to do, taken out)."""
    run_spans = sorted(trace.of_kind("run"), key=lambda s: s.start_us)
    if not run_spans:
        raise ValueError("a timeline needs at least one run")
    starts, shifts, runs = [], [], []
    for r in run_spans:  # each run starts on the device clock where the one before it ended
        offset = runs[-1][1] if runs else 0.0
        starts.append(r.start_us)
        shifts.append(r.start_us - offset)
        runs.append((offset, offset + r.end_us - r.start_us))

    def device_clock(span: Span) -> tuple[float, float]:
        shift = shifts[max(bisect.bisect_right(starts, span.start_us) - 1, 0)]
        return span.start_us - shift, span.end_us - shift

    rows, cuts = _ge_rows([(s.name, s.start_us, s.end_us) for s in trace.of_kind("ge")])
    tasks_by_stream: dict[int, list[tuple[float, float, str, str]]] = {}
    kernels: list[tuple[str, float, float]] = []
    pipes: dict[int, list[tuple[int, float, float]]] = {}  # pipe -> (core, start, end)
    for span in trace.spans:
        if span.track.pid == DEVICE_PID:
            start, end = device_clock(span)
            tasks_by_stream.setdefault(span.track.tid, []).append((start, end, span.name, span.kind))
            if span.kind == "kernel":
                kernels.append((span.name, start, end))
        elif span.kind == "pipe":
            start, end = device_clock(span)
            pipes.setdefault(span.track.tid, []).append((span.track.pid - CORE_PID0, start, end))
    for stream in sorted(tasks_by_stream):
        spans = sorted(tasks_by_stream[stream])
        rows.append(Row("Runtime", f"stream {stream}", "simulated", np.array([s[0] for s in spans]),
                        np.array([s[1] for s in spans]), tuple(s[2] for s in spans), tuple(s[3] for s in spans)))
    by_core: list[Row] = []
    for pipe, parts in pipes.items():
        cores = np.array([p[0] for p in parts], dtype=int)
        start = np.array([p[1] for p in parts], dtype=float)
        end = np.array([p[2] for p in parts], dtype=float)
        work = end > start
        cores, start, end = cores[work], start[work], end[work]
        order = np.lexsort((start, cores))
        cores, start, end = cores[order], start[order], end[order]
        bounds = np.flatnonzero(np.diff(cores)) + 1
        for c, s, e in zip(np.split(cores, bounds), np.split(start, bounds), np.split(end, bounds)):
            if c.size:
                by_core.append(Row(f"core {int(c[0])}", PIPES[pipe], "simulated", s, e, core=int(c[0])))
    rows += sorted(by_core, key=lambda r: (r.core, PIPES.index(r.lane)))
    return Timeline(source, target.name, target.cube_cores, rows, kernels, runs, cuts)


def _ge_rows(ge_spans: Sequence[tuple]) -> tuple[list[Row], list[float]]:
    """GE's spans in two lanes, steps (a compile, a re-plan) above the passes they contain, and the cuts.

    GE works in bursts (the compile, then a re-plan before a run with new shapes); the host time
    between bursts (reading inputs, running) is cut out, so the spans are wide enough to read.
    """
    spans = sorted((span[1], span[2], span[0]) for span in ge_spans)  # (start, end, name), details dropped
    if not spans:
        return [], []
    shifted, cuts = [], []
    removed, reach = 0.0, spans[0][0]
    for s, e, name in spans:
        if s > reach:  # GE was idle from `reach` to `s`
            cuts.append(reach - removed)
            removed += s - reach
        reach = max(reach, e)
        shifted.append((name, s - removed, e - removed))
    spans = shifted
    steps, passes = [], []
    for i, (name, s, e) in enumerate(spans):
        inner = any(j != i and s2 >= s and e2 <= e and e2 - s2 < e - s for j, (_, s2, e2) in enumerate(spans))
        (steps if inner else passes).append((s, e, name))
    rows = []
    for lane, items in (("steps", sorted(steps)), ("passes", sorted(passes))):
        if items:
            rows.append(Row("GE", lane, "host wall clock", np.array([x[0] for x in items]),
                            np.array([x[1] for x in items]), tuple(x[2] for x in items)))
    return rows, cuts


def busy_fraction(rows: Sequence[Row], edges: np.ndarray, cores: int) -> np.ndarray:
    """Per bin between `edges`: the busy time of these rows over the bin width times `cores` (0 to 1 per pipe)."""
    if not rows:
        return np.zeros(len(edges) - 1)
    start = np.sort(np.concatenate([r.start for r in rows]))
    end = np.sort(np.concatenate([r.end for r in rows]))
    # busy time before t, summed over spans: sum over s < t of (t - s) minus sum over e < t of (t - e)
    cs = np.concatenate([[0.0], np.cumsum(start)])
    ce = np.concatenate([[0.0], np.cumsum(end)])
    ks = np.searchsorted(start, edges)
    ke = np.searchsorted(end, edges)
    before = (ks * edges - cs[ks]) - (ke * edges - ce[ke])
    return np.diff(before) / (np.diff(edges) * max(cores, 1))


def detail_cores(timeline: Timeline, limit: int = DETAIL_CORES) -> list[tuple[int, str]]:
    """The cores drawn pipe by pipe, each with a note: the first ones, and the one that finished last."""
    last_end: dict[int, float] = {}
    for r in timeline.core_rows:
        last_end[r.core] = max(last_end.get(r.core, 0.0), float(r.end.max()))
    used = sorted(last_end)
    if len(used) <= limit:
        return [(c, "") for c in used]
    latest = max(used, key=lambda c: (last_end[c], -c))
    chosen = [c for c in used if c != latest][: limit - 1]
    ends = sorted(last_end.values())
    note = "finished last" if ends[-1] > ends[-2] else ""
    return sorted([(c, "") for c in chosen] + [(latest, note)])


def _merge(start: np.ndarray, end: np.ndarray, gap: float) -> tuple[np.ndarray, np.ndarray]:
    """Spans closer than `gap` (under a pixel) joined, so the drawing has one bar per visible bar."""
    if start.size < 2:
        return start, end
    end = np.maximum.accumulate(end)
    breaks = start[1:] - end[:-1] > gap
    keep_start = np.concatenate([[True], breaks])
    keep_end = np.concatenate([breaks, [True]])
    return start[keep_start], end[keep_end]


def matplotlib_available() -> bool:
    """Whether the `plot` extra (matplotlib) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def render_png(timeline: Timeline, detail: int = DETAIL_CORES) -> bytes:
    """The picture as PNG bytes (matplotlib's Agg backend, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import ConnectionPatch, Patch

    ge_rows = timeline.track("GE")
    runtime_rows = timeline.track("Runtime")
    core_rows = timeline.core_rows
    pipes_used = [p for p in PIPES if any(r.lane == p for r in core_rows)]
    shown = detail_cores(timeline, detail)
    core_lanes = 1 + len(pipes_used) * (1 + len(shown))  # the kernels, the busy band, then each detailed core

    heights = ([0.45 + 0.3 * len(ge_rows)] if ge_rows else []) + [0.45 + 0.35 * len(runtime_rows)]
    heights.append(0.5 + 0.17 * core_lanes)
    height = sum(heights) + 1.9
    fig = Figure(figsize=(WIDTH_IN, height), dpi=DPI)
    FigureCanvasAgg(fig)
    left, right = 0.125, 0.985
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights, hspace=0.75 * len(heights) / sum(heights),
                            left=left, right=right, top=1 - 0.75 / height, bottom=0.95 / height)
    axes = [fig.add_subplot(grid[i, 0]) for i in range(len(heights))]
    plot_px = WIDTH_IN * DPI * (right - left)

    if ge_rows:
        _draw_ge(axes[0], timeline, ge_rows, plot_px)
    run_ax, core_ax = axes[-2], axes[-1]
    window = _draw_runtime(run_ax, timeline, runtime_rows, plot_px)
    _draw_cores(core_ax, timeline, pipes_used, shown, window, plot_px)
    if window[1] > window[0]:  # tie the shaded stretch of the Runtime panel to the zoomed cores panel below
        for x_run, x_cores in zip(window, core_ax.get_xlim()):
            fig.add_artist(ConnectionPatch((x_run, 0), (x_cores, 1), coordsA=run_ax.get_xaxis_transform(),
                                           coordsB=core_ax.get_xaxis_transform(), color="#b8a200", lw=0.8, ls=":"))

    n_kernels = len(timeline.kernels)
    runs = len(timeline.runs)
    title = (f"{timeline.source or 'program'} on {timeline.target}: {timeline.simulated_us:,.1f} µs simulated"
             f" ({runs} run{'s' * (runs != 1)}, {n_kernels} kernel launch{'es' * (n_kernels != 1)})")
    if ge_rows:  # idle time is cut out of GE's rows, so where they end is how long GE worked
        busy_ms = max(float(r.end.max()) for r in ge_rows) / 1e3
        title += f"; GE busy {busy_ms:,.1f} ms of host wall clock"
    fig.suptitle(title, fontsize=12, fontweight="bold")
    handles = [Patch(color=PIPE_COLOURS[p], label=p) for p in pipes_used]
    handles += [Patch(color=TASK_COLOURS[k], label={"h2d": "copy in", "d2h": "copy out", "kernel": "kernel"}[k])
                for k in TASK_COLOURS if any(k in r.kinds for r in runtime_rows)]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _fits(width_px: float, text: str) -> bool:
    return width_px > 6.2 * len(text) + 6


def _lanes_axis(ax, labels: list[str], title: str, xlabel: str) -> None:
    ax.set_yticks(range(len(labels)), labels, fontsize=8.5)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_title(title, loc="left", fontsize=10, pad=4)
    ax.set_xlabel(xlabel, fontsize=9, labelpad=2)
    ax.tick_params(axis="x", labelsize=8)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="#e0e0e0", lw=0.6)
    ax.set_axisbelow(True)


def _draw_ge(ax, timeline: Timeline, rows: list[Row], plot_px: float) -> None:
    end = max(float(r.end.max()) for r in rows) / 1e3 or 1e-3
    for y, row in enumerate(rows):
        colours = ["#bdbdbd" if row.lane == "steps" else PASS_COLOURS[i % len(PASS_COLOURS)]
                   for i in range(len(row.names))]
        start, stop = row.start / 1e3, row.end / 1e3
        ax.broken_barh(list(zip(start, stop - start)), (y - 0.4, 0.8), facecolors=colours, edgecolors="white",
                       linewidth=0.5)
        for s, e, name in zip(start, stop, row.names):
            if _fits((e - s) * plot_px / end, name):
                ax.text((s + e) / 2, y, name, ha="center", va="center", fontsize=8, clip_on=True)
    for cut in timeline.ge_cuts:
        ax.axvline(cut / 1e3, color="black", lw=1.2, ls=(0, (2, 2)))
    ax.set_xlim(0, end)
    _lanes_axis(ax, [f"GE {r.lane}" for r in rows], "GE (host): the compile, then each re-plan for new shapes",
                "host wall clock, ms of GE work (idle time between steps cut out at the dotted lines)")


def _stream_label(row: Row) -> str:
    kinds = set(row.kinds)
    what = "kernels" if kinds == {"kernel"} else "copies" if "kernel" not in kinds else "copies and kernels"
    return f"Runtime {row.lane}\n({what})"


def _draw_runtime(ax, timeline: Timeline, rows: list[Row], plot_px: float) -> tuple[float, float]:
    """The Runtime's tasks; returns the simulated stretch the kernels ran in (the cores panel's range)."""
    total = timeline.simulated_us or 1.0
    for y, row in enumerate(rows):
        ax.broken_barh(list(zip(row.start, row.end - row.start)), (y - 0.4, 0.8),
                       facecolors=[TASK_COLOURS.get(k, "#999999") for k in row.kinds], edgecolors="white",
                       linewidth=0.5)
        for s, e, name, kind in zip(row.start, row.end, row.names, row.kinds):
            if _fits((e - s) * plot_px / total, name):
                ax.text((s + e) / 2, y, name, ha="center", va="center", fontsize=8, clip_on=True,
                        color="white" if kind == "kernel" else "black")
    if len(timeline.runs) > 1:
        for i, (s, _) in enumerate(timeline.runs):
            ax.axvline(s, color="black", lw=1.2)
            ax.text(s, 0.5, f"run {i}", transform=ax.get_xaxis_transform(), va="center", ha="left", fontsize=8,
                    fontweight="bold", bbox={"facecolor": "white", "lw": 0, "pad": 1})
    window = (min((k[1] for k in timeline.kernels), default=0.0), max((k[2] for k in timeline.kernels), default=0.0))
    if window[1] > window[0]:
        ax.axvspan(*window, color="#fff3b0", zorder=0)
    ax.set_xlim(0, total)
    _lanes_axis(ax, [_stream_label(r) for r in rows],
                "Runtime: tasks on the streams (shaded: where the kernels ran, zoomed in below)",
                "simulated time (µs)")
    return window


def _draw_cores(ax, timeline: Timeline, pipes: list[str], shown: list[tuple[int, str]],
                window: tuple[float, float], plot_px: float) -> None:
    lo, hi = window
    if hi <= lo:
        ax.set_axis_off()
        ax.set_title("cores: no kernel ran", loc="left", fontsize=10)
        return
    gap = (hi - lo) / plot_px * 0.5  # half a pixel
    labels: list[str] = []
    sections: list[tuple[str, float, float]] = []  # (name, first lane, last lane)
    edges = np.linspace(lo, hi, int(plot_px) // 2 + 1)
    by_pipe = {p: [r for r in timeline.core_rows if r.lane == p] for p in pipes}
    for i, (name, s, e) in enumerate(timeline.kernels):  # lane 0: which kernel ran when
        ax.broken_barh([(s, e - s)], (-0.42, 0.84), facecolors=("#d9d9d9", "#bdbdbd")[i % 2], linewidth=0)
        if _fits((e - s) * plot_px / (hi - lo), name):
            ax.text((s + e) / 2, 0, name, ha="center", va="center", fontsize=8, clip_on=True)
        for x in (s, e):
            ax.axvline(x, color="#555555", lw=0.6, ls="--")
    labels.append("kernels")
    y = 1
    for p in pipes:  # the band: what fraction of the chip's cores kept this pipe busy
        frac = busy_fraction(by_pipe[p], edges, timeline.cores)
        ax.fill_between(np.repeat(edges, 2)[1:-1], y + 0.45, y + 0.45 - 0.9 * np.repeat(frac, 2),
                        color=PIPE_COLOURS[p], lw=0)
        ax.axhline(y + 0.45, color="#bbbbbb", lw=0.4)
        mean = sum(r.busy_us for r in by_pipe[p]) / (timeline.cores * (hi - lo))
        labels.append(f"{p} {100 * mean:3.0f} %")
        y += 1
    sections.append((f"all {timeline.cores} cores:\nshare busy", 1, y - 1))
    for core, note in shown:
        rows = {r.lane: r for r in timeline.core_rows if r.core == core}
        first = y
        for p in pipes:
            row = rows.get(p)
            if row is not None:
                s, e = _merge(row.start, row.end, gap)
                ax.broken_barh(list(zip(s, e - s)), (y - 0.42, 0.84), facecolors=PIPE_COLOURS[p], linewidth=0)
            labels.append(p)
            y += 1
        sections.append((f"core {core}" + (f"\n({note})" if note else ""), first, y - 1))
    for _, first, _ in sections:
        ax.axhline(first - 0.5, color="black", lw=0.8)
    for name, first, last in sections:
        ax.text(-0.062, (first + last) / 2, name, transform=ax.get_yaxis_transform(), ha="right", va="center",
                fontsize=9, fontweight="bold")
    pad = (hi - lo) * 0.004
    ax.set_xlim(lo - pad, hi + pad)
    used = len({r.core for r in timeline.core_rows})
    shown_text = f"{len(shown)} of them pipe by pipe" if len(shown) < used else "each pipe by pipe"
    _lanes_axis(ax, labels,
                f"cores, {lo:,.1f} to {hi:,.1f} µs: {used} of {timeline.cores} did work; the share of all cores "
                f"busy on each pipe, then {shown_text} (dashed: kernel boundaries)",
                "simulated time (µs)")
