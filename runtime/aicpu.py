"""The AI CPU engine's cost model: how long one AI CPU task takes, from the target file's [aicpu] numbers.

An AI CPU task runs an op GE placed there (no AI Core kernel takes it) with the op's numpy semantics,
reading its operands from and writing its results to global memory. GE splits the task's elements
into blocks over the AI CPU cores as CANN's GE does (`AicpuNodeTaskBase::UpdateBlockDimInfo`: at
most two blocks per core, of equal size), the cores run the blocks in waves, and every task pays a
fixed dispatch and scheduling overhead first:

    time_us = task_overhead_us + waves x block x cycles_per_element / (clock_ghz x 1e3)
    cycles_per_element = ops / elements x cycles_per_op + bytes / elements / bytes_per_cycle

with `elements` the results' elements, `ops` the op's arithmetic (at least one per result element)
and `bytes` its operands and results. The timing never depends on the values, so a timing-only run
times a task exactly as a full run does.
"""

from __future__ import annotations

import attrs

from geir.ir import Operation
from geir.target_npu.target import Target


class NoAicpu(ValueError):
    """A target without an AI CPU engine ([aicpu] table) asked to time an AI CPU task."""


@attrs.frozen
class AicpuCost:
    """One AI CPU task's cost and the figures it comes from."""

    elements: int  # result elements, split into blocks
    blocks: int  # GE's block count (block_num)
    block: int  # elements per block
    cores: int  # AI CPU cores that ran a block
    waves: int  # rounds of blocks over the cores
    ops: float  # arithmetic operations in all
    nbytes: int  # operand and result bytes in global memory
    overhead_us: float
    compute_us: float

    @property
    def time_us(self) -> float:
        """The task's whole time: overhead, then the waves of blocks."""
        return self.overhead_us + self.compute_us


def ge_blocks(total: int, cores: int) -> tuple[int, int]:
    """(block count, elements per block) of GE's split of `total` elements over `cores` AI CPU cores."""
    if total <= 0:
        return 1, 0
    cores = max(1, cores)
    per_unit = total // min(cores, total)
    block = max(1, min(total, per_unit))
    shards = min(2 * cores, -(-total // block))
    block = -(-total // shards)
    return -(-total // block), block


def has_semantics(op: Operation) -> bool:
    """Whether the op's class defines its numpy semantics (`compute`), which is what the AI CPU runs."""
    return type(op).compute is not Operation.compute


def aicpu_cost(elements: int, ops: float, nbytes: int, target: Target, cores: int | None = None) -> AicpuCost:
    """The cost of an AI CPU task over `elements` result elements with `ops` operations moving `nbytes`
    (`cores`: fewer AI CPU cores than the target has, when one has stopped)."""
    spec = target.aicpu
    if spec is None:
        raise NoAicpu(f"{target.name} has no AI CPU engine (no [aicpu] table in its target file)")
    cores = spec.cores if cores is None else cores
    blocks, block = ge_blocks(elements, cores)
    waves = -(-blocks // cores)
    ops = max(float(ops), float(elements))  # every result element takes at least one operation
    if elements > 0:
        per_element = ops / elements * spec.cycles_per_op + nbytes / elements / spec.bytes_per_cycle
    else:
        per_element = 0.0
    compute_us = waves * block * per_element / (spec.clock_ghz * 1e3)
    return AicpuCost(elements, blocks, block, min(blocks, cores) if elements > 0 else 0, waves, ops, nbytes,
                     float(spec.task_overhead_us), compute_us)
