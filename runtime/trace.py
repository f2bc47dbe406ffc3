"""The one typed timeline: tracks of spans and counters on one clock (microseconds), and its renderers.

Every trace, report and picture of a run renders from these records, never from each other's output:
- `Track`: one lane, a thread of a process in Chrome's terms (GE on the host, the Runtime's submissions,
  a device stream, a core's pipe, the AI CPU, a request);
- `Span`: something that took time on a track (a GE pass, a submission, a copy, a kernel, a pipe's work,
  a whole run), with its kind ("ge", "submit", "h2d", "d2h", "kernel", "aicpu", "pipe", "run", ...);
- `Counter`: values sampled at a time on a track (device memory, a pool's occupancy).
`run_trace` records one Runtime run from its start; `Trace.extend` places records after others on the
one clock. Renderers: `chrome_trace_json` (Perfetto, chrome://tracing), `format_trace` (the text
report) and geir.runtime.timeline (the picture).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

import attrs

from geir.runtime.interpreter import RunResult
from geir.target_npu.sim import PIPES


@attrs.frozen(order=True)
class Track:
    """One lane of the timeline: `name` (a thread) in `process`, with the ids a Chrome trace gives them."""

    pid: int
    tid: int
    process: str = attrs.field(order=False)
    name: str = attrs.field(order=False)


@attrs.frozen
class Span:
    """Something that took time on a track, from `start_us` to `end_us`."""

    track: Track
    name: str
    start_us: float
    end_us: float
    kind: str = ""
    args: Mapping[str, Any] = attrs.field(factory=dict)

    def shifted(self, offset_us: float, args: Mapping[str, Any] | None = None) -> Span:
        """The span `offset_us` later, with `args` added to its own."""
        return attrs.evolve(self, start_us=self.start_us + offset_us, end_us=self.end_us + offset_us,
                            args={**self.args, **args} if args else self.args)


@attrs.frozen
class Counter:
    """Values sampled at `t_us` on a track (one series per key of `values`, as a Chrome counter has)."""

    track: Track
    name: str
    t_us: float
    values: Mapping[str, float]


@attrs.define
class Trace:
    """The records of one timeline: spans and counters on one clock."""

    spans: list[Span] = attrs.field(factory=list)
    counters: list[Counter] = attrs.field(factory=list)

    def extend(self, other: Trace, offset_us: float = 0.0, args: Mapping[str, Any] | None = None) -> None:
        """Add another timeline's records, `offset_us` later and with `args` added to every span's."""
        self.spans += [s.shifted(offset_us, args) for s in other.spans]
        self.counters += [attrs.evolve(c, t_us=c.t_us + offset_us) for c in other.counters]

    def of_kind(self, *kinds: str) -> list[Span]:
        """The spans of these kinds, in the order recorded."""
        return [s for s in self.spans if s.kind in kinds]

    def on(self, track: Track) -> list[Span]:
        """The spans on one track, in the order recorded."""
        return [s for s in self.spans if s.track == track]

    @property
    def tracks(self) -> list[Track]:
        """Every track a span or counter is on, by process then thread id."""
        return sorted({s.track for s in self.spans} | {c.track for c in self.counters})

    @property
    def end_us(self) -> float:
        """When the last span ended (or the last counter was sampled)."""
        return max([s.end_us for s in self.spans] + [c.t_us for c in self.counters], default=0.0)


# --- the tracks of a Runtime run --------------------------------------------------------------------------

HOST_PID, DEVICE_PID, CORE_PID0 = 0, 1, 2
AICPU_PID = 100_000  # the AI CPU engine's process: far above any core's (CORE_PID0 + core)
GE = Track(HOST_PID, 0, "host", "GE")
RUNTIME = Track(HOST_PID, 1, "host", "Runtime")
RUNS = Track(HOST_PID, 2, "host", "runs")
AICPU = Track(AICPU_PID, 0, "AI CPU", "AI CPU")


def stream_track(stream: int) -> Track:
    """A device stream's track (stream 0: the copies)."""
    return Track(DEVICE_PID, stream, "device", f"stream {stream}" + (" (copies)" if stream == 0 else ""))


def pipe_track(core: int, pipe: int) -> Track:
    """One pipe of one core."""
    return Track(CORE_PID0 + core, pipe, f"core {core}", PIPES[pipe])


def ge_spans(spans: Iterable[Span], start_us: float | None = None) -> Trace:
    """GE's host spans as the passes timed them (geir.session's), moved to begin at `start_us` (default: as
    measured)."""
    spans = list(spans)
    first = min((s.start_us for s in spans), default=0.0)
    return Trace([s.shifted(0.0 if start_us is None else start_us - first) for s in spans])


def run_trace(result: RunResult) -> Trace:
    """One Runtime run from its start (time 0: the first submission): the run, each task's submission on the
    host, each task on its stream, each AI CPU task on the AI CPU's track, every pipe's work on its core."""
    trace = Trace()
    submit_us = result.target.host.launch_latency_us
    end = max((t.end_us for t in result.tasks), default=0.0)
    trace.spans.append(Span(RUNS, "run", 0.0, end, "run",
                            {"tasks": len(result.tasks), "kernels": len(result.kernels)}))
    for t in result.tasks:
        trace.spans.append(Span(RUNTIME, f"submit {t.name}", t.submitted_us - submit_us, t.submitted_us, "submit",
                                {"stream": t.stream}))
        trace.spans.append(Span(stream_track(t.stream), t.name, t.start_us, t.end_us, t.kind,
                                {"stream": t.stream, "submitted_us": t.submitted_us}
                                | ({"bytes": t.nbytes} if t.kind != "kernel" else {})))
        if t.engine == "aicpu":
            trace.spans.append(Span(AICPU, t.name, t.start_us, t.end_us, "aicpu", {"stream": t.stream,
                                                                                   "node": t.label}))
    us = 1e6 / result.target.clock_hz
    for iv in result.cores.intervals:
        for core, start, stop in zip(iv.cores.tolist(), iv.start.tolist(), iv.end.tolist()):
            trace.spans.append(Span(pipe_track(core, iv.pipe), iv.name, start * us, stop * us, "pipe"))
    return trace


def runs_trace(results: list[RunResult], ge_groups: list[list[Span]] = ()) -> Trace:
    """Several runs on one clock, in the order they happened: GE's spans of group 0 (the compile), then for
    each run r GE's spans of group r + 1 (its re-plan, if it needed one) and the run. With several runs every
    span of run r says `run: r`."""
    trace = Trace()
    groups = list(ge_groups)
    several = len(results) > 1

    def add_ge(spans: list[Span], run: int | None) -> None:
        if spans:
            trace.extend(ge_spans(spans, trace.end_us), args={"run": run} if run is not None else None)

    add_ge(groups[0] if groups else [], None)
    for r, result in enumerate(results):
        add_ge(groups[r + 1] if r + 1 < len(groups) else [], r)
        trace.extend(run_trace(result), trace.end_us, {"run": r} if several else None)
    return trace


# --- renderers ----------------------------------------------------------------------------------------------

def chrome_trace(trace: Trace, display_unit: str = "ns") -> dict[str, Any]:
    """The timeline as a Chrome trace-event document: a process and thread name per track, then the spans in
    time order on every track, then the counters in time order per process."""
    events: list[dict[str, Any]] = []
    named: set[int] = set()
    span_tracks = {s.track for s in trace.spans}
    for track in trace.tracks:
        if track.pid not in named:
            named.add(track.pid)
            events.append({"ph": "M", "name": "process_name", "pid": track.pid, "args": {"name": track.process}})
        if track in span_tracks:
            events.append({"ph": "M", "name": "thread_name", "pid": track.pid, "tid": track.tid,
                           "args": {"name": track.name}})
    spans = []
    for s in trace.spans:
        e = {"ph": "X", "name": s.name, "cat": s.kind, "pid": s.track.pid, "tid": s.track.tid, "ts": s.start_us,
             "dur": max(s.end_us - s.start_us, 0.0)}
        if not s.kind:
            del e["cat"]
        if s.args:
            e["args"] = dict(s.args)
        spans.append(e)
    spans.sort(key=lambda e: (e["pid"], e["tid"], e["ts"]))
    counters = [{"ph": "C", "name": c.name, "pid": c.track.pid, "ts": c.t_us, "args": dict(c.values)}
                for c in trace.counters]
    counters.sort(key=lambda e: (e["pid"], e["ts"]))
    return {"traceEvents": events + spans + counters, "displayTimeUnit": display_unit}


def chrome_trace_json(trace: Trace, display_unit: str = "ns") -> str:
    """`chrome_trace` as JSON text."""
    return json.dumps(chrome_trace(trace, display_unit))


def format_trace(trace: Trace) -> str:
    """The text report: per track its spans, busy time and extent; per counter series its samples and peak."""
    lines = [f"{'process':<12}{'track':<22}{'spans':>7}{'busy_us':>13}{'first_us':>13}{'last_us':>13}"]
    for track in trace.tracks:
        spans = trace.on(track)
        if spans:
            busy = sum(s.end_us - s.start_us for s in spans)
            lines.append(f"{track.process:<12}{track.name:<22}{len(spans):>7}{busy:>13.2f}"
                         f"{min(s.start_us for s in spans):>13.2f}{max(s.end_us for s in spans):>13.2f}")
    series: dict[tuple[str, str, str], list[float]] = {}
    for c in trace.counters:
        for key, value in c.values.items():
            series.setdefault((c.track.process, c.name, key), []).append(value)
    if series:
        lines += ["", f"{'process':<12}{'counter':<36}{'samples':>8}{'peak':>14}"]
        for (process, name, key), values in series.items():
            lines.append(f"{process:<12}{f'{name}: {key}':<36}{len(values):>8}{max(values):>14g}")
    return "\n".join(lines)
