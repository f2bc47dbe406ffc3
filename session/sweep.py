"""Design-space sweeps: a graph's time across chips, what-if chip parameters and shapes (getune --sweep).

Each axis (a `--set KEY=V1,V2` chip parameter or a `--shape ARG=DIMS,DIMS` binding) is varied one at a time
from each target's baseline, as a sensitivity study does: the table says how the graph's kernel time,
with the rules and tuned, moves when one parameter moves, so a user sees which parameter the model is
sensitive to ("what would twice the UB give?": `--set ub_bytes=x2`).
"""

from __future__ import annotations

import csv
import io
from typing import Any, Sequence

import attrs

from geir.session.tuning import Point, TuneReport
from geir.target_npu.overrides import target_spec


@attrs.frozen
class Axis:
    """One swept quantity: a chip parameter (`kind` "set") or an argument's shape ("shape"), with its values."""

    kind: str
    key: str
    values: tuple[str, ...]


def sweep_points(targets: Sequence[str], axes: Sequence[Axis]) -> list[tuple[Point, str, str, str]]:
    """(point, base target, swept key, value) for each target's baseline and each axis value in turn; shape axes'
    first values are the baseline's shapes."""
    base_shapes = tuple((a.key, parse_dims(a.values[0])) for a in axes if a.kind == "shape")
    out = []
    for target in targets:
        out.append((Point(target, base_shapes, f"{target} baseline"), target, "", ""))
        for axis in axes:
            for value in axis.values:
                if axis.kind == "set":
                    spec = target_spec(target, [(axis.key, value)])
                    out.append((Point(spec, base_shapes, f"{target} {axis.key}={value}"), target, axis.key, value))
                elif value != axis.values[0]:
                    shapes = tuple((k, parse_dims(value) if k == axis.key else dims) for k, dims in base_shapes)
                    out.append((Point(target, shapes, f"{target} %{axis.key}={value}"), target, f"%{axis.key}", value))
    return out


def parse_dims(text: str) -> tuple[int, ...]:
    """`1x4096x128` as a shape; ValueError says what is wrong."""
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"'{text}' is not a shape (dimensions joined by x, as 1x4096x128)") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"'{text}' has a negative dimension")
    return dims


@attrs.frozen
class SweepRow:
    """One point of a sweep: what changed, and the graph's kernel time with the rules and tuned."""

    target: str
    key: str
    value: str
    chip: str
    rules_us: float
    tuned_us: float
    base_rules_us: float
    base_tuned_us: float

    @property
    def vs_base(self) -> float:
        """The rules' time at this point over the baseline's: below 1, the change makes the graph faster."""
        return self.rules_us / self.base_rules_us if self.base_rules_us > 0 else 1.0

    @property
    def tuned_vs_base(self) -> float:
        """The tuned time over the baseline's tuned time: what the chip change gives once each point has its
        best tilings (the rules' column mixes in how well the heuristics suit each chip)."""
        return self.tuned_us / self.base_tuned_us if self.base_tuned_us > 0 else 1.0

    def record(self) -> dict[str, Any]:
        return {"target": self.target, "parameter": self.key or "baseline", "value": self.value, "chip": self.chip,
                "rules_us": self.rules_us, "tuned_us": self.tuned_us, "rules_vs_baseline": self.vs_base,
                "tuned_vs_baseline": self.tuned_vs_base}


@attrs.frozen
class SweepReport:
    rows: tuple[SweepRow, ...]
    tune: TuneReport

    @classmethod
    def of(cls, points: Sequence[tuple[Point, str, str, str]], report: TuneReport) -> "SweepReport":
        rows, base = [], {}
        for (point, target, key, value), graph in zip(points, report.graphs):
            if not key:
                base[target] = (graph.rules_us, graph.best_us)
            rows.append(SweepRow(target, key, value, graph.target, graph.rules_us, graph.best_us, *base[target]))
        return cls(tuple(rows), report)

    def most_sensitive(self) -> dict[str, tuple[str, str, float]]:
        """Per target: the (parameter, value, tuned time ratio) that moved the tuned graph's time the most."""
        out: dict[str, tuple[str, str, float]] = {}
        for r in self.rows:
            if r.key and (r.target not in out or abs(r.tuned_vs_base - 1) > abs(out[r.target][2] - 1)):
                out[r.target] = (r.key, r.value, r.tuned_vs_base)
        return out

    def render(self) -> str:
        lines = [f"{'target':<12} {'parameter':<16} {'value':<14} {'rules us':>11} {'tuned us':>11} "
                 f"{'rules vs base':>14} {'tuned vs base':>14}"]
        for r in self.rows:
            lines.append(f"{r.target:<12} {r.key or 'baseline':<16} {r.value:<14} {r.rules_us:>11.2f} "
                         f"{r.tuned_us:>11.2f} {r.vs_base:>13.3f}x {r.tuned_vs_base:>13.3f}x")
        for target, (key, value, ratio) in self.most_sensitive().items():
            lines.append(f"{target}: most sensitive to {key} ({key}={value}: {ratio:.3f}x the baseline's tuned time)")
        lines.append(f"timed {self.tune.timed} candidates on {self.tune.workers} worker"
                     f"{'s' * (self.tune.workers != 1)} in {self.tune.seconds:.1f} s "
                     f"({self.tune.candidates_per_second:.1f} candidates/s)")
        return "\n".join(lines)

    def csv(self) -> str:
        out = io.StringIO()
        fields = list(SweepRow("", "", "", "", 0, 0, 1, 1).record())
        writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for r in self.rows:
            writer.writerow(r.record())
        return out.getvalue()

    def record(self) -> dict[str, Any]:
        return {"sweep": [r.record() for r in self.rows], **self.tune.record()}
