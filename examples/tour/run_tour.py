"""A guided tour of five misconceptions about GE, the Runtime and the kernels, each shown by real runs.

    python examples/tour/run_tour.py [--out DIR] [--step N ...] [--quick]

Each step runs the project's own tools (gerun, geopt and the example scripts) with the Python that
runs this script, prints every command as you would type it ($OUT is the --out folder) with its
output, and then, after `=>`, the figures it read from the files the command wrote. Diagnostics
are shown one line each (the source line and caret under a remark are left out). Every command
must succeed: the first that fails stops the tour with its output and exit code 1.

Written under --out (default: a new temporary folder): the generated models and their inputs,
profiles (JSON), Chrome traces (open them in Perfetto), the tiled IR of step 4, and the PNG
timelines of steps 1 and 5 when matplotlib is installed (the plot extra) and --quick is not given.
examples/tour/README.md explains each step; test/test_tour.py runs them all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TOUR = "examples/tour"
STEP2 = f"{TOUR}/step2_attention.geir"
STEP2_PROBS = f"{TOUR}/step2_attention_probs.geir"
STEP4 = f"{TOUR}/step4_tiling.geir"
STEP5 = f"{TOUR}/step5_attention.geir"
DYNAMIC = "examples/dynamic/attention_kv.geir"
# step 5: the default pipeline with double buffering spelled out, and the same without it
DOUBLE_BUFFERED = "canonicalize,fuse,layout,tile{buffers=2},plan,lower"
SINGLE_BUFFERED = "canonicalize,fuse,layout,tile{buffers=1},plan,lower"
TARGETS = ("ascend910b", "ascend910a", "ascend310p")
# the graph of step4_tiling.geir whose key segments gerun --check runs
SEGMENTED_ENTRY = "f32_d512_q512_k128"
# the summary line of gerun --overlap-compile
OVERLAP_LINE = re.compile(
    r"compile overlap: (?P<parts>\d+) parts on one timeline; first kernel at (?P<first_kernel_us>[\d.]+) us "
    r"\(compile-then-run: (?P<serial_first_kernel_us>[\d.]+) us\); end to end (?P<end_to_end_us>[\d.]+) us "
    r"\(compile-then-run: (?P<compile_then_run_us>[\d.]+) us\); GE compiled for (?P<compile_us>[\d.]+) us "
    r"of host time, (?P<hidden_us>[\d.]+) us of it while the device ran; the device ran for (?P<device_us>[\d.]+) us")
# its verdict: whether the device's work hid GE's, or GE was the bottleneck
VERDICT_LINE = re.compile(r"compile overlap: (?P<verdict>(the device's work hid (most of )?GE's|GE is the bottleneck).*)")
# gerun --explain's line per run of a session
REPLAN_LINE = re.compile(
    r"--inputs (?P<inputs>\S+): re-plan for (?P<signature>\[.*?\]) in (?P<ms>[\d.]+) ms: (?P<fusion>.*?), "
    r"(?P<retiled>\d+) of (?P<tiled>\d+) tiled op\(s\) re-tiled, arena (?P<arena>\d+) B")
HIT_LINE = re.compile(r"--inputs (?P<inputs>\S+): plan cache hit, no re-plan")
DIAGNOSTIC = re.compile(r"^\S+:\d+:\d+: (remark|warning|error|note): ")


# each step: what it shows, and the misconception it answers (the seed article's five points)
TITLES = {
    1: "GE and the Runtime work together while the program runs (GE + Runtime)",
    2: "FlashAttention is fast only when GE's fusion matches (GE: fusion)",
    3: "GE's output is a plan that adapts to the shapes it meets (GE at run time)",
    4: "Fusion picks its strategy from dtype, shapes and the target (GE: tiling, for the kernel)",
    5: "The Runtime's overlap of data movement and compute is where speed is won (Runtime + kernel)",
}
MISCONCEPTIONS = {
    1: "'GE compiles, then the Runtime runs: two stages, one after the other.'",
    2: "'A fused kernel is called like a CUDA kernel; fusion is a detail.'",
    3: "'GE is a compiler like gcc: it emits a fixed binary and is done.'",
    4: "'Fusion is pasting a few ops into one kernel.'",
    5: "'The Runtime only dispatches tasks; once they are queued its job is over.'",
}


class TourError(RuntimeError):
    """A tour command failed: the message holds its command line, exit code and output."""


@dataclass(frozen=True)
class Ran:
    """One command of the tour as shown, with its exit code and output ($OUT for the output folder)."""

    command: str
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Step:
    """What a step ran and the figures it read from the runs' output and files."""

    number: int
    title: str
    ran: list[Ran] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


class Tour:
    """Runs the tour's commands from the repository root with this Python and shows them."""

    def __init__(self, out: Path, pictures: bool, echo: Callable[[str], None] | None = print):
        self.out = Path(out).resolve()
        self.pictures = pictures
        self.echo = echo or (lambda text: None)
        self.cache: dict[str, Any] = {}  # runs two steps share (the generation run)

    def file(self, name: str) -> Path:
        """A path in the output folder."""
        return self.out / name

    def tool(self, name: str, *args: Any) -> Ran:
        """Run a GEIR command-line tool (gerun, geopt, ...) as `python -m geir.tools.NAME`."""
        return self._run([sys.executable, "-m", f"geir.tools.{name}", *map(str, args)], [name, *map(str, args)])

    def script(self, path: str, *args: Any) -> Ran:
        """Run a script of the repository, given relative to its root."""
        return self._run([sys.executable, str(REPO / path), *map(str, args)], ["python", path, *map(str, args)])

    def say(self, text: str) -> None:
        """Show a figure the tour read from a command's output or files."""
        for line in text.splitlines():
            self.echo(f"=> {line}")

    def _hide_out(self, text: str) -> str:
        return text.replace(str(self.out), "$OUT")

    def _run(self, argv: list[str], shown: list[str]) -> Ran:
        command = self._hide_out(" ".join(shlex.quote(a) for a in shown))
        self.echo(f"$ {command}")
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
        ran = Ran(command, proc.returncode, self._hide_out(proc.stdout), self._hide_out(proc.stderr))
        shown_output = condense(ran.stdout + ran.stderr)
        if shown_output:
            self.echo(shown_output)
        if proc.returncode != 0:
            raise TourError(f"'{command}' exited with {proc.returncode}:\n{ran.stdout}{ran.stderr}")
        return ran


def condense(text: str) -> str:
    """Output as shown: each diagnostic on its one line (its source line and caret left out)."""
    lines = text.rstrip("\n").splitlines()
    kept: list[str] = []
    i = 0
    while i < len(lines):
        kept.append(lines[i])
        if DIAGNOSTIC.match(lines[i]) and i + 2 < len(lines) and lines[i + 2].strip() == "^":
            i += 3
        else:
            i += 1
    return "\n".join(kept)


def read_json(path: Path) -> Any:
    """A JSON file a command wrote."""
    return json.loads(Path(path).read_text())


def kernel_us(profile: dict[str, Any]) -> float:
    """Device time of the kernels of one run (simulated microseconds), host copies left out."""
    return sum(k["time_us"] for k in profile["kernels"])


# --- step 1 -------------------------------------------------------------------------------------------

def host_spans(trace_path: Path) -> list[dict[str, Any]]:
    """The GE and Runtime spans of gerun --overlap-compile's trace (one modelled timeline), in order of start."""
    events = read_json(trace_path)["traceEvents"]
    track = {0: "GE", 1: "Runtime"}
    spans = [{"track": track[e["tid"]], "name": e["name"], "start_ms": e["ts"] / 1e3,
              "end_ms": (e["ts"] + e["dur"]) / 1e3, "kernels": e.get("args", {}).get("kernels")}
             for e in events if e["ph"] == "X"]
    return sorted(spans, key=lambda s: (s["start_ms"], s["track"]))


def session_story(trace_path: Path) -> list[dict[str, Any]]:
    """GE's compile and re-plans and the Runtime's runs of a gerun session's trace, in the order they happened.

    GE's steps are in host milliseconds, the runs in simulated microseconds, laid end to end on
    the trace's one axis as gerun writes it.
    """
    every = [e for e in read_json(trace_path)["traceEvents"] if e["ph"] == "X"]
    events = [e for e in every if e.get("pid") == 0]  # the host: GE (tid 0) and the Runtime's submissions (tid 1)
    device = [e for e in every if e.get("pid") == 1]  # the device's streams: copies and kernels as they ran
    story: list[dict[str, Any]] = []
    for e in events:
        if e["tid"] == 0 and (e["name"] == "compile" or e["name"].startswith("specialise")):
            args = e.get("args", {})
            story.append({"track": "GE", "what": "compile" if e["name"] == "compile" else "re-plan",
                          "name": e["name"], "run": args.get("run"), "start": e["ts"], "end": e["ts"] + e["dur"],
                          "ms": e["dur"] / 1e3, "unfused": len(args.get("unfused", [])),
                          "retiled": len(args.get("retiled", [])), "arena": args.get("arena_size")})
    # a run is its tasks on the device's streams (the submission track would count no kernel and time the host)
    runs: dict[int, list[dict]] = {}
    for e in device:
        runs.setdefault(e.get("args", {}).get("run", 0), []).append(e)
    for run, tasks in runs.items():
        start, end = min(t["ts"] for t in tasks), max(t["ts"] + t["dur"] for t in tasks)
        story.append({"track": "Runtime", "what": "run", "name": f"run {run}", "run": run, "start": start, "end": end,
                      "us": end - start, "kernels": sum(t.get("cat") == "kernel" for t in tasks)})
    return sorted(story, key=lambda s: (s["start"], s["track"] == "Runtime"))


def story_lines(story: list[dict[str, Any]]) -> str:
    """The session story as aligned lines, each run saying whether GE had to re-plan before it."""
    replanned = {s["run"] for s in story if s["what"] == "re-plan"}
    lines = []
    for s in story:
        if s["what"] == "compile":
            lines.append(f"GE       compile, dims still ?                          {s['ms']:7.1f} ms host")
        elif s["what"] == "re-plan":
            lines.append(f"GE       re-plan for run {s['run']}: {s['name'][len('specialise '):]:<29}{s['ms']:7.1f} ms host"
                         f"  ({s['retiled']} ops re-tiled, arena {s['arena']} B)")
        else:
            cached = "" if s["run"] in replanned else "  (plan cache hit: no GE work before it)"
            lines.append(f"Runtime  run {s['run']}: {s['kernels']} kernels {'':<29}{s['us']:7.1f} us simulated{cached}")
    return "\n".join(lines)


def overlap_figures(ran: Ran) -> tuple[dict[str, float], str]:
    """The figures and the verdict of gerun --overlap-compile's two summary lines."""
    m, verdict = OVERLAP_LINE.search(ran.stdout), VERDICT_LINE.search(ran.stdout)
    if m is None or verdict is None:
        raise TourError(f"no compile overlap lines in the output of '{ran.command}'")
    return {k: float(v) for k, v in m.groupdict().items()}, verdict.group("verdict")


GENERATION_SUMMARY = re.compile(
    r"(?P<steps>\d+) steps, (?P<compiles>\d+) compiles, plan cache (?P<hits>\d+) hits / (?P<misses>\d+) misses; "
    r"end to end (?P<end_us>\d+) us, host GE (?P<ge_us>\d+) us \((?P<share>\d+) %, (?P<hidden_us>\d+) us of it hidden")


def generation(t: Tour) -> dict[str, Any] | None:
    """The seed's own scenario, once per tour: a small LLaMA generating token by token (needs the hf extra)."""
    if "generation" not in t.cache:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            t.say("a language model generating token by token needs torch and the hf extra: skipped")
            t.cache["generation"] = None
            return None
        ran = t.script("examples/generate/run_llama.py", "--new", 12, "--buckets", "pow2")
        m = GENERATION_SUMMARY.search(ran.stdout)
        if m is None:
            raise TourError(f"examples/generate/run_llama.py printed no summary:\n{ran.stdout}")
        facts = {k: int(v) for k, v in m.groupdict().items()}
        facts["tokens_equal"] = "tokens equal" in ran.stdout
        t.cache["generation"] = {"ran": ran, "facts": facts}
    return t.cache["generation"]


def step1(t: Tour) -> Step:
    """GE compiles the next part while the Runtime runs this one, and re-plans between runs for new shapes."""
    step = Step(1, TITLES[1])
    model = t.file("model4.geir")
    step.ran.append(t.script("examples/make_model.py", "--layers", 4, "--hidden", 256, "--heads", 4, "--seq", 128,
                             "-o", model))
    trace = t.file("step1_overlap_trace.json")
    ran = t.tool("gerun", model, "--overlap-compile", 4, "--check", "--trace", trace)
    step.ran.append(ran)
    step.facts["overlap"], step.facts["verdict"] = overlap_figures(ran)
    spans = host_spans(trace)
    step.facts["overlap_spans"] = spans
    t.say("that run's one modelled timeline (GE's measured compile of each part, each part's simulated run):")
    for s in spans:
        kernels = f" ({s['kernels']} kernels)" if s["kernels"] is not None else ""
        t.say(f"  {s['start_ms']:7.1f} - {s['end_ms']:7.1f} ms  {s['track']:<8} {s['name']}{kernels}")

    # the regime where the seed's claim holds: a LLaMA-7B-shaped stack whose layers keep the device busy
    # longer than GE takes to compile the next; timing only (no weights, no arithmetic), two layers a part
    big = t.file("llama8.geir")
    step.ran.append(t.script("examples/make_model.py", "--layers", 8, "--hidden", 4096, "--heads", 32, "--mlp", 11008,
                             "--seq", 8192, "--attention", "sdpa", "--no-weights", "-o", big))
    ran = t.tool("gerun", big, "--overlap-compile", 4, "--timing-only")
    step.ran.append(ran)
    step.facts["overlap_big"], step.facts["verdict_big"] = overlap_figures(ran)
    o = step.facts["overlap_big"]
    t.say(f"big model: {100 * o['hidden_us'] / o['compile_us']:.0f} % of GE's {o['compile_us'] / 1e3:.1f} ms compile "
          f"hidden behind {o['device_us'] / 1e3:.1f} ms of device work; end to end "
          f"{o['compile_then_run_us'] / o['end_to_end_us']:.2f}x sooner than compile-then-run")

    dyn = t.file("model_dyn.geir")
    step.ran.append(t.script("examples/make_model.py", "--layers", 2, "--hidden", 256, "--heads", 4, "--dynamic-seq",
                             "-o", dyn))
    step.ran.append(t.script(f"{TOUR}/make_inputs.py", t.out, "--hidden", 256, "--seq", 128, 512))
    trace = t.file("step1_session_trace.json")
    args: list[Any] = [dyn, "--inputs", t.file("seq128.npz"), "--inputs", t.file("seq512.npz"),
                       "--inputs", t.file("seq128.npz"), "--output", t.file("step1_outputs.npz"), "--trace", trace]
    if t.pictures:
        args += ["--timeline", t.file("step1_session.png")]
    step.ran.append(t.tool("gerun", *args))
    story = session_story(trace)
    step.facts["story"] = story
    t.say("the session, from its trace (GE in host time, the runs in simulated time, one after another):")
    t.say("\n".join(f"  {line}" for line in story_lines(story).splitlines()))
    gen = generation(t)
    if gen is not None:
        step.ran.append(gen["ran"])
        g = step.facts["generation"] = gen["facts"]
        t.say(f"generating {g['steps']} tokens: GE prepared each step's plan while the device ran the step before; "
              f"{g['hidden_us']} us of GE's {g['ge_us']} us ran behind the device")
    return step


# --- step 2 -------------------------------------------------------------------------------------------

def step2(t: Tour) -> Step:
    """The same attention fused, unfused, and spelled so that the pattern misses."""
    step = Step(2, TITLES[2])
    profiles = {}
    for label, path, extra in (("fused", STEP2, ["--check", "--explain"]), ("unfused", STEP2, ["--no-fuse"]),
                               ("miss", STEP2_PROBS, ["--explain"])):
        out = t.file(f"step2_{label}.json")
        step.ran.append(t.tool("gerun", path, *extra, "--profile", "--profile-json", out))
        profiles[label] = read_json(out)
    miss = re.findall(r"remark: flash_attention not fused: (.*)", step.ran[-1].stderr)
    step.facts.update(
        kernel_us={k: kernel_us(p) for k, p in profiles.items()},
        simulated_us={k: p["simulated_time_us"] for k, p in profiles.items()},
        kernels={k: [x["name"] for x in p["kernels"]] for k, p in profiles.items()},
        miss_reasons=miss,
    )
    us = step.facts["kernel_us"]
    step.facts["ratio"] = us["unfused"] / us["fused"]
    step.facts["miss_ratio"] = us["miss"] / us["fused"]
    t.say(f"kernel time: fused {us['fused']:.1f} us in {len(profiles['fused']['kernels'])} kernel, unfused "
          f"{us['unfused']:.1f} us in {len(profiles['unfused']['kernels'])} kernels: {step.facts['ratio']:.2f}x")
    t.say(f"the spelling that misses runs op by op: {us['miss']:.1f} us, {step.facts['miss_ratio']:.2f}x the fused "
          f"kernel; why: {miss[0] if miss else '(no remark)'}")
    sim = step.facts["simulated_us"]
    t.say(f"whole runs with the host copies of q, k, v and the results: fused {sim['fused']:.1f} us, unfused "
          f"{sim['unfused']:.1f} us, the miss {sim['miss']:.1f} us")
    return step


# --- step 3 -------------------------------------------------------------------------------------------

def step3(t: Tour) -> Step:
    """One dynamic-shape program, four calls: GE re-plans each new shape and the plan cache serves repeats."""
    step = Step(3, TITLES[3])
    step.ran.append(t.script("examples/dynamic/make_inputs.py", t.out))
    calls = ["prefill_1024", "decode_1024", "prefill_1024", "decode_2048"]
    out = t.file("step3_profile.json")
    args: list[Any] = [DYNAMIC, "--explain", "--profile-json", out]
    for name in calls:
        args += ["--inputs", t.file(f"{name}.npz")]
    ran = t.tool("gerun", *args)
    step.ran.append(ran)
    runs = []
    for line in ran.stdout.splitlines():
        if m := REPLAN_LINE.match(line):
            runs.append({"replan": True, "ms": float(m["ms"]), "arena": int(m["arena"]), "fusion": m["fusion"],
                         "retiled": int(m["retiled"]), "tiled": int(m["tiled"]), "signature": m["signature"]})
        elif HIT_LINE.match(line):
            runs.append({"replan": False})
    profile = read_json(out)
    for run, p in zip(runs, profile["runs"]):
        run["kernels"] = [k["name"] for k in p["kernels"]]
        run["kernel_us"] = kernel_us(p)
    step.facts.update(calls=calls, runs=runs, plan_cache=profile["plan_cache"],
                      retiled=re.findall(r"^  flash_attention at \S+: (.*)$", ran.stdout, re.MULTILINE))
    for name, run in zip(calls, runs):
        plan = (f"re-planned in {run['ms']:.1f} ms, arena {run['arena']} B" if run["replan"] else "plan cache hit")
        t.say(f"{name:<13} {plan:<38} kernels: {', '.join(run['kernels'])}")
    pc = profile["plan_cache"]
    t.say(f"plan cache after the four calls: {pc['hits']} hit(s), {pc['misses']} miss(es), "
          f"{pc['replan_ms']:.1f} ms of re-planning in all")
    gen = generation(t)
    if gen is not None:
        g = step.facts["generation"] = gen["facts"]
        t.say(f"the seed's own case, a model generating text (cache lengths rounded up to powers of two): "
              f"{g['steps']} steps, the shapes changing every step, {g['compiles']} compiles, {g['misses']} re-plans, "
              f"{g['hits']} plan-cache hits; tokens {'equal' if g['tokens_equal'] else 'differ from'} "
              f"Hugging Face's generate")
    return step


# --- step 4 -------------------------------------------------------------------------------------------

def tilings(path: Path) -> dict[str, dict[str, Any]]:
    """Per graph of a tiled module: the attention's tiling, or (left unfused) its softmax's."""
    from geir.parser import parse

    out: dict[str, dict[str, Any]] = {}
    for graph in parse(path.read_text(), str(path)).graphs:
        ops = {op.name: op for op in graph.ops if "tiling" in op.attributes}
        op = ops.get("ge.flash_attention") or ops.get("ge.softmax")
        if op is not None:
            out[graph.name] = {"op": op.name, **op.attributes["tiling"]}
    return out


def tiling_cell(t: dict[str, Any]) -> str:
    """One cell of step 4's table: the template and s1 x s2 block, or the unfused softmax's row pieces."""
    segments = t.get("segments", 1)
    if t["op"] == "ge.flash_attention" and t.get("preload"):  # the CV-split schedule (Atlas A2)
        if t["template"] == "Bn2S2FD":  # flash-decoding on it: the keys in parts over the idle cores
            return f"Bn2S2FD CV {t['s1']}x{t['s2']}, {segments} parts"
        return f"CV {t['s1']}x{t['s2']}, vector {t['v_rows']} rows"
    if t["op"] == "ge.flash_attention":
        return f"{t['template']} {t['s1']}x{t['s2']}" + (f", {segments} segments" if segments > 1 else "")
    return f"unfused; softmax {segments} x {t['cols']}"


def step4(t: Tour) -> Step:
    """The tilings the tile pass picks for one attention across dtypes, head dims, lengths and targets."""
    step = Step(4, TITLES[4])
    table: dict[str, dict[str, Any]] = {}
    for target in TARGETS:
        out = t.file(f"step4_{target}.geir")
        extra = ["--explain"] if target == TARGETS[0] else ["--target", target]
        step.ran.append(t.tool("geopt", STEP4, "--passes=fuse,tile", *extra, "-o", out))
        for graph, tiling in tilings(out).items():
            table.setdefault(graph, {})[target] = tiling
    step.facts["table"] = table
    t.say(f"{'graph':<22}" + "".join(f"{target:<30}" for target in TARGETS).rstrip())
    for graph, row in table.items():
        t.say(f"{graph:<22}" + "".join(f"{tiling_cell(row[target]):<30}" for target in TARGETS).rstrip())
    # key segments are the on-chip schedule's (the 910A's); the 910B's CV-split schedule never splits a row's keys
    ran = t.tool("gerun", STEP4, "--entry", SEGMENTED_ENTRY, "--target", "ascend910a", "--check", "--profile")
    step.ran.append(ran)
    step.facts["segmented_check"] = "check: PASS" in ran.stdout
    return step


# --- step 5 -------------------------------------------------------------------------------------------

# the profile figures step 5 sets side by side: kernel time, then the spec's keys
FIGURES = ("kernel_us", "cube_ratio", "cube_peak_fraction", "overlap_ratio", "mte2_ratio")


def side_by_side(left: Path, right: Path, out: Path, titles: tuple[str, str]) -> None:
    """Two timeline PNGs next to each other in one PNG (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = [plt.imread(str(p)) for p in (left, right)]
    height = max(im.shape[0] for im in images)
    width = sum(im.shape[1] for im in images)
    fig, axes = plt.subplots(1, 2, figsize=(width / 100, height / 100 + 0.5), dpi=100)
    for ax, image, title in zip(axes, images, titles):
        ax.imshow(image)
        ax.set_title(title, fontsize=16)
        ax.axis("off")
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, out)


def step5(t: Tour) -> Step:
    """The same fused kernel with and without double buffering: the profile and the timeline side by side."""
    step = Step(5, TITLES[5])
    profiles = {}
    for buffers, passes in ((2, DOUBLE_BUFFERED), (1, SINGLE_BUFFERED)):
        out = t.file(f"step5_buffers{buffers}.json")
        args: list[Any] = [STEP5, f"--passes={passes}", "--profile", "--profile-json", out,
                           "--output", t.file(f"step5_buffers{buffers}.npz")]
        if t.pictures:
            args += ["--timeline", t.file(f"step5_buffers{buffers}.png")]
        step.ran.append(t.tool("gerun", *args))
        profiles[buffers] = read_json(out)
    step.facts["profiles"] = {b: {"kernel_us": kernel_us(p), **{k: p[k] for k in FIGURES[1:]},
                                  "tiling": p["kernels"][0]["tiling"]} for b, p in profiles.items()}
    t.say(f"{'':<22}{'2 buffers':>12}{'1 buffer':>12}")
    for key in FIGURES:
        a, b = (step.facts["profiles"][n][key] for n in (2, 1))
        t.say(f"{key:<22}{a:>12.2f}{b:>12.2f}")
    if t.pictures:
        both = t.file("step5_side_by_side.png")
        side_by_side(t.file("step5_buffers2.png"), t.file("step5_buffers1.png"), both,
                     ("tile{buffers=2}: K/V loads overlap compute", "tile{buffers=1}: every load waits"))
        t.say(f"timelines: $OUT/step5_buffers2.png, $OUT/step5_buffers1.png, side by side in $OUT/{both.name}")
    return step


STEPS: dict[int, Callable[[Tour], Step]] = {1: step1, 2: step2, 3: step3, 4: step4, 5: step5}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", metavar="DIR", help="folder for the files the tour writes (default: a new temporary one)")
    ap.add_argument("--step", type=int, action="append", choices=sorted(STEPS), metavar="N",
                    help="run only step N (repeatable; default all five)")
    ap.add_argument("--quick", action="store_true", help="draw no PNG timelines (the slowest part)")
    args = ap.parse_args(argv)
    from geir.runtime.timeline import matplotlib_available

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="geir-tour-"))
    out.mkdir(parents=True, exist_ok=True)
    pictures = not args.quick and matplotlib_available()
    tour = Tour(out, pictures)
    print(f"# the tour writes its files to {out.resolve()} ($OUT below)")
    if not pictures:
        print("# no PNG timelines: " + ("--quick" if args.quick else "matplotlib is not installed (the plot extra)"))
    for n in args.step or sorted(STEPS):
        print(f"\n== Step {n}: {TITLES[n]}\n   misconception: {MISCONCEPTIONS[n]}")
        try:
            STEPS[n](tour)
        except TourError as e:
            print(f"run_tour: error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
