"""msprof's op_summary table of a run: one row per kernel task, msprof's columns for Atlas A2
(Ascend 910B) with the PipeUtilization metrics, so scripts written for real boards read it unchanged.

Sources (the column list, its order and each definition):
- msprof's op_summary page: https://www.hiascend.com/document/detail/en/canncommercial/850/devaids/profiling/atlasprofiling_16_0067.html
  (the table covers AI Core, AI Vector Core and AI CPU operators; host-device copies are not
  operators and appear in msprof's task_time table instead, so they have no row here) and its field
  table, https://www.hiascend.com/document/detail/zh/canncommercial/700/devtools/auxiliarydevtool/atlasprofiling_16_0201.html
  (Task Wait Time: from the previous task's end to this task's start; Block Dim: the cores the task
  ran on; Mix Block Dim: for a task on both cube and vector cores, the secondary kind's count).
- The PipeUtilization metrics and their `aic_` (cube core) / `aiv_` (vector core) split on Atlas A2:
  https://www.hiascend.com/document/detail/en/canncommercial/850/devaids/optool/atlasopdev_16_0099.html
  (a ratio is the pipe's cycles over the total cycles of the cores of its kind) and
  https://www.hiascend.com/document/detail/en/canncommercial/850/devaids/profiling/atlasprofiling_16_0070.html
- The order of the columns is the one msprof writes for Atlas A2 with PipeUtilization (the same
  list torch_npu's kernel_details.csv checks); `cube_utilization(%)` follows msprof's own formula
  (Ascend/msprof, analysis/viewer/runtime_report.py `cube_usage`): aic_total_cycles / (clock x the
  chip's AI cube cores x Task Duration); Task Wait Time is clipped at 0 and 0 for the first row, as
  msprof's op_summary export computes it.

What the simulation has is computed from the run. Op Name is the node's name (the launch's first
result, as GE names a node after it), OP Type the kernel's op; the input and output shapes, data
types and formats are the launch's operand and result types in msprof's spelling (`1,128,256;768`,
`FLOAT16;FLOAT`, `ND;FRACTAL_NZ`). Task ID numbers each stream's tasks in submission order, copies
included, as the Runtime hands them to the device. What the simulation does not have is N/A, as
msprof writes for a field it did not collect: Model ID, OP State, Context ID, the scalar pipe (no
kernel issues scalar work) and the instruction cache (not simulated). HF32 Eligible is NO: the simulated cube
never computes f32 as HF32.

One lane of the simulated chip is one AI core group: on the 910B one AIC (cube core) with two AIVs
(vector cores), which split the lane's vector work and run together, so each AIV is busy for the
lane's vector time and an `aiv_` ratio over the AIVs equals the lane's busy / (kernel cycles x lanes),
the figure `geir.runtime.profile.kernel_profile` gives. A kernel is an AI_CORE task when it uses
only cube-core pipes (CUBE, MTE1, FIXP), an AI_VECTOR_CORE task when it uses only vector-core pipes
(VECTOR, MTE3; Block Dim then counts AIVs), MIX_AIC when it uses both (Block Dim the AICs, Mix
Block Dim the AIVs; a non-mix task has 0 there, the count msprof's export takes from GE). The
columns of a kind of core a kernel did not use are 0. A lane has one MTE2 pipe: it is the AIC's
when the kernel uses the cube (its loads feed L1) and the AIV's otherwise. Every core of a kind the
kernel used is counted for the kernel's whole span (aic_total_cycles = kernel cycles x AICs). On a
target whose AI cores hold both units (910A, 310P) every kernel is an AI_CORE task on its cores,
and the `aic_` and `aiv_` columns split that one core's pipes by unit. A view (a reshape of ND
data) keeps no core busy and takes no time: it is no device task and has no row, as msprof's table,
built from the device's task records, has none. An op GE placed on the AI CPU is an AI_CPU task, as
msprof types AI CPU operators: Block Dim is the AI CPU cores its blocks ran on, and every AI Core
column (aicore_time, the aic_ and aiv_ figures, cube_utilization) is 0, as no AI Core worked on it.

Numbers are written as msprof writes them: microseconds and ratios to 3 decimals, cycles as integers.
"""

from __future__ import annotations

import csv
import io
from typing import Sequence

import attrs

from geir.kernels.base import AIC_PIPES, AIV_PIPES, KernelStats
from geir.runtime.interpreter import RunResult
from geir.target_npu.target import Target

NA = "N/A"

# msprof's op_summary header for Atlas A2 with --aic-metrics=PipeUtilization, in its order, each with
# the OpSummaryRow field that fills it (None: the simulation does not have it, written N/A)
_COLUMNS: tuple[tuple[str, str | None], ...] = (
    ("Device_id", "device_id"),
    ("Model ID", None),
    ("Task ID", "task_id"),
    ("Stream ID", "stream_id"),
    ("Op Name", "op_name"),
    ("OP Type", "op_type"),
    ("OP State", None),
    ("Task Type", "task_type"),
    ("Task Start Time(us)", "task_start_us"),
    ("Task Duration(us)", "task_duration_us"),
    ("Task Wait Time(us)", "task_wait_us"),
    ("Block Dim", "block_dim"),
    ("Mix Block Dim", "mix_block_dim"),
    ("HF32 Eligible", "hf32_eligible"),
    ("Input Shapes", "input_shapes"),
    ("Input Data Types", "input_dtypes"),
    ("Input Formats", "input_formats"),
    ("Output Shapes", "output_shapes"),
    ("Output Data Types", "output_dtypes"),
    ("Output Formats", "output_formats"),
    ("Context ID", None),
    ("aicore_time(us)", "aicore_time_us"),
    ("aic_total_cycles", "aic_total_cycles"),
    ("aic_mac_time(us)", "aic_mac_time_us"),
    ("aic_mac_ratio", "aic_mac_ratio"),
    ("aic_scalar_time(us)", None),
    ("aic_scalar_ratio", None),
    ("aic_mte1_time(us)", "aic_mte1_time_us"),
    ("aic_mte1_ratio", "aic_mte1_ratio"),
    ("aic_mte2_time(us)", "aic_mte2_time_us"),
    ("aic_mte2_ratio", "aic_mte2_ratio"),
    ("aic_fixpipe_time(us)", "aic_fixpipe_time_us"),
    ("aic_fixpipe_ratio", "aic_fixpipe_ratio"),
    ("aic_icache_miss_rate", None),
    ("aiv_time(us)", "aiv_time_us"),
    ("aiv_total_cycles", "aiv_total_cycles"),
    ("aiv_vec_time(us)", "aiv_vec_time_us"),
    ("aiv_vec_ratio", "aiv_vec_ratio"),
    ("aiv_scalar_time(us)", None),
    ("aiv_scalar_ratio", None),
    ("aiv_mte2_time(us)", "aiv_mte2_time_us"),
    ("aiv_mte2_ratio", "aiv_mte2_ratio"),
    ("aiv_mte3_time(us)", "aiv_mte3_time_us"),
    ("aiv_mte3_ratio", "aiv_mte3_ratio"),
    ("aiv_icache_miss_rate", None),
    ("cube_utilization(%)", "cube_utilization_pct"),
)
OP_SUMMARY_COLUMNS: tuple[str, ...] = tuple(name for name, _ in _COLUMNS)

_INTEGER_FIELDS = {"device_id", "task_id", "stream_id", "block_dim", "mix_block_dim", "aic_total_cycles",
                   "aiv_total_cycles"}


@attrs.frozen
class OpSummaryRow:
    """One kernel task as msprof's op_summary lists it (times in us of simulated device time, ratios in [0, 1])."""

    device_id: int
    task_id: int
    stream_id: int
    op_name: str
    op_type: str
    task_type: str  # AI_CORE, AI_VECTOR_CORE, MIX_AIC or AI_CPU
    task_start_us: float
    task_duration_us: float
    task_wait_us: float
    block_dim: int
    mix_block_dim: int
    aicore_time_us: float
    aic_total_cycles: float
    aic_mac_time_us: float
    aic_mac_ratio: float
    aic_mte1_time_us: float
    aic_mte1_ratio: float
    aic_mte2_time_us: float
    aic_mte2_ratio: float
    aic_fixpipe_time_us: float
    aic_fixpipe_ratio: float
    aiv_time_us: float
    aiv_total_cycles: float
    aiv_vec_time_us: float
    aiv_vec_ratio: float
    aiv_mte2_time_us: float
    aiv_mte2_ratio: float
    aiv_mte3_time_us: float
    aiv_mte3_ratio: float
    cube_utilization_pct: float
    hf32_eligible: str = "NO"
    # msprof's spelling: shapes `1,128,256;768`, types `FLOAT16;FLOAT`, formats `ND;FRACTAL_NZ`
    input_shapes: str = NA
    input_dtypes: str = NA
    input_formats: str = NA
    output_shapes: str = NA
    output_dtypes: str = NA
    output_formats: str = NA


def op_summary_rows(result: RunResult) -> list[OpSummaryRow]:
    """The op_summary rows of one run, in start order (AI Core kernels run one at a time; an AI CPU task may overlap them)."""
    return op_summary_rows_of_runs([result])


def op_summary_rows_of_runs(results: Sequence[RunResult]) -> list[OpSummaryRow]:
    """The rows of several runs on one device timeline, each run starting where the one before ended.

    As msprof lists several iterations: task ids keep counting per stream, and the first kernel of
    a run waits from the last kernel of the run before.
    """
    partial: list[tuple[float, dict]] = []  # (start, the row's fields but the wait)
    offset = 0.0
    task_ids: dict[int, int] = {}
    for result in results:
        kernels = iter(result.kernels)
        for task in result.tasks:
            # the Runtime numbers tasks per stream in submission order, copies included
            task_id = task_ids.get(task.stream, 0)
            task_ids[task.stream] = task_id + 1
            if task.kind != "kernel":
                continue
            k = next(kernels)
            if k.cores == 0 and k.cycles == 0:
                continue  # a view: no device task
            start = offset + task.start_us
            fields = _fields(k, task_id, task.stream, start, result.target)
            fields.update(_tensor_fields(task))
            partial.append((start, fields))
        offset += max((t.end_us for t in result.tasks), default=0.0)
    partial.sort(key=lambda p: p[0])  # stable: launch order among equal starts
    rows: list[OpSummaryRow] = []
    previous_end: float | None = None
    for start, fields in partial:
        wait = 0.0 if previous_end is None else max(start - previous_end, 0.0)
        previous_end = start + fields["task_duration_us"]
        rows.append(OpSummaryRow(task_wait_us=wait, **fields))
    return rows


# msprof's names of the data types and formats (its op_summary writes GE's enum names without DT_)
_MSPROF_DTYPES = {"f16": "FLOAT16", "bf16": "BF16", "f32": "FLOAT", "f64": "DOUBLE", "i1": "BOOL", "i8": "INT8",
                  "i16": "INT16", "i32": "INT32", "i64": "INT64", "u8": "UINT8"}
_MSPROF_FORMATS = {"ND": "ND", "NZ": "FRACTAL_NZ"}


def _tensor_fields(task) -> dict:
    """Op Name (the launch's result, as GE names a node after it) and the tensors' shapes, types and formats."""
    def join(types, render) -> str:
        return ";".join(render(t) for t in types) if types else NA

    out: dict = {}
    if task.label:
        out["op_name"] = task.label
    for side, types in (("input", task.inputs), ("output", task.outputs)):
        out[f"{side}_shapes"] = join(types, lambda t: ",".join(str(d) for d in t.shape))
        out[f"{side}_dtypes"] = join(types, lambda t: _MSPROF_DTYPES.get(t.dtype.name, t.dtype.name.upper()))
        out[f"{side}_formats"] = join(types, lambda t: _MSPROF_FORMATS.get(t.format, t.format))
    return out


def _fields(k: KernelStats, task_id: int, stream: int, start_us: float, target: Target) -> dict:
    """Every field of a kernel's row except the wait, which depends on the row before it."""
    if k.engine == "aicpu":
        return _aicpu_fields(k, task_id, stream, start_us, target)
    per_cube = target.vector_per_cube
    split = per_cube > 1  # cube and vector units are separate cores (Atlas A2)
    lanes = k.cores
    uses_cube = any(k.busy[p] > 0 for p in AIC_PIPES)
    uses_vector = any(k.busy[p] > 0 for p in AIV_PIPES)
    if not split:
        task_type, block_dim, mix = "AI_CORE", lanes, 0
        aic_cores = aiv_cores = lanes
    elif uses_cube:
        task_type = "MIX_AIC" if uses_vector else "AI_CORE"
        block_dim, mix = lanes, (lanes * per_cube if uses_vector else 0)
        aic_cores, aiv_cores = lanes, mix
    else:
        task_type, block_dim, mix = "AI_VECTOR_CORE", lanes * per_cube, 0
        aic_cores, aiv_cores = 0, lanes * per_cube
    us_per_cycle = 1e6 / target.clock_hz
    duration = k.cycles * us_per_cycle
    mte2_side = "aic" if uses_cube else "aiv"

    def side(pipe: str, used: bool) -> tuple[float, float]:
        """(time per core in us, ratio) of a pipe on the lanes; zeros on a kind of core the kernel did not use."""
        if not used or lanes == 0 or k.cycles <= 0:
            return 0.0, 0.0
        return k.busy[pipe] / lanes * us_per_cycle, k.busy[pipe] / (k.cycles * lanes)

    aic = aic_cores > 0
    aiv = aiv_cores > 0
    mac = side("CUBE", aic)
    mte1 = side("MTE1", aic)
    fixp = side("FIXP", aic)
    aic_mte2 = side("MTE2", aic and mte2_side == "aic")
    vec = side("VECTOR", aiv)
    mte3 = side("MTE3", aiv)
    # a kernel whose vector cores load on their own engine (the CV-split FlashAttention) reports it as theirs
    aiv_mte2 = side("AIV_MTE2", aiv) if k.busy.get("AIV_MTE2", 0.0) > 0 else side("MTE2", aiv and mte2_side == "aiv")
    aic_total = k.cycles * aic_cores
    # msprof's cube_utilization(%): aic_total_cycles / (clock x the chip's AI cube cores x duration)
    cube_use = (100.0 * aic_total * us_per_cycle / (target.cube_cores * duration)
                if mac[1] > 0 and duration > 0 else 0.0)
    return dict(
        device_id=0, task_id=task_id, stream_id=stream, op_name=k.name, op_type=k.name, task_type=task_type,
        task_start_us=start_us, task_duration_us=duration, block_dim=block_dim, mix_block_dim=mix,
        aicore_time_us=duration if aic else 0.0, aic_total_cycles=aic_total,
        aic_mac_time_us=mac[0], aic_mac_ratio=mac[1], aic_mte1_time_us=mte1[0], aic_mte1_ratio=mte1[1],
        aic_mte2_time_us=aic_mte2[0], aic_mte2_ratio=aic_mte2[1], aic_fixpipe_time_us=fixp[0],
        aic_fixpipe_ratio=fixp[1],
        aiv_time_us=duration if aiv else 0.0, aiv_total_cycles=k.cycles * aiv_cores,
        aiv_vec_time_us=vec[0], aiv_vec_ratio=vec[1], aiv_mte2_time_us=aiv_mte2[0], aiv_mte2_ratio=aiv_mte2[1],
        aiv_mte3_time_us=mte3[0], aiv_mte3_ratio=mte3[1], cube_utilization_pct=cube_use,
    )


def _aicpu_fields(k: KernelStats, task_id: int, stream: int, start_us: float, target: Target) -> dict:
    """An AI CPU task's row: its time and AI CPU cores; no AI Core pipe worked, so their columns are 0."""
    zero = ("aicore_time_us", "aic_total_cycles", "aic_mac_time_us", "aic_mac_ratio", "aic_mte1_time_us",
            "aic_mte1_ratio", "aic_mte2_time_us", "aic_mte2_ratio", "aic_fixpipe_time_us", "aic_fixpipe_ratio",
            "aiv_time_us", "aiv_total_cycles", "aiv_vec_time_us", "aiv_vec_ratio", "aiv_mte2_time_us",
            "aiv_mte2_ratio", "aiv_mte3_time_us", "aiv_mte3_ratio", "cube_utilization_pct")
    return dict(device_id=0, task_id=task_id, stream_id=stream, op_name=k.name, op_type=k.name, task_type="AI_CPU",
                task_start_us=start_us, task_duration_us=k.cycles * 1e6 / target.clock_hz, block_dim=k.cores,
                mix_block_dim=0, **dict.fromkeys(zero, 0.0))


def _cell(row: OpSummaryRow, field: str | None) -> str:
    if field is None:
        return NA
    value = getattr(row, field)
    if field in _INTEGER_FIELDS:
        return str(int(round(value)))
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def render_csv(rows: Sequence[OpSummaryRow]) -> str:
    """The op_summary CSV: msprof's header, then one line per row."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(OP_SUMMARY_COLUMNS)
    for row in rows:
        writer.writerow([_cell(row, field) for _, field in _COLUMNS])
    return out.getvalue()
