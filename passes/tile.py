"""tile: place each op on an engine, then ask each AI Core op's kernel for its tiling (the kernel's
TilingInterface), checked against the target's buffers. Ops the AI Core cannot take go to the AI CPU
(geir.passes.placement) and need no tiling. With `db=DB` the tuning repository getune wrote is consulted:
its entry replaces the rules' tiling only when it was measured faster than them."""

from __future__ import annotations

import attrs

from geir.diagnostics import Location
from geir.ir import Module, Operation
from geir.kernels import KERNELS
from geir.kernels.base import Kernel
from geir.kernels.tiling import KernelTiling, Miss, OpSignature, TilingAttrError
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.placement import AICPU, ENGINE_ATTR, Unplaceable, place_op
from geir.passes.tuning_repository import Entry, RepositoryError, TuningRepository, tiling_text
from geir.target_npu.target import Target, load_target
from geir.traits import NoKernel


@attrs.frozen
class TilingDecision:
    """What the tile pass decided for one op: its tiling, or why it has none (`miss`)."""

    op: str  # the op's name without its dialect: "flash_attention"
    loc: Location
    tiling: KernelTiling | None
    miss: Miss | None = None
    # where the tiling came from: "rules", or "repository" (a tuned entry that beat them)
    source: str = "rules"

    def render(self) -> str:
        """The --explain remark (or, for an overflow, the error) this decision prints as."""
        if self.miss is None:
            return f"tile: {self.op} {self.tiling.rule}"
        if self.miss.overflow:
            return self.miss.reason
        return f"tile: {self.op} left untiled: {self.miss.reason}"


@register_pass("tile")
class Tile(Pass):
    """Place each op on the AI Core or the AI CPU; put `tiling = {...}` on each AI Core op.

    Tilings: FlashAttention templates, matmul blocks, vector tiles; ops placed on the AI CPU need none."""

    REQUIRES = ("infer-shapes",)
    target: str = ""  # empty: the context's --target
    buffers: int = 2
    db: str = ""  # a tuning repository (getune --db) to consult; empty: the rules alone

    def __attrs_post_init__(self) -> None:
        # checked when the pipeline is parsed: the pass manager reports a ValueError as a usage error
        if self.buffers not in (1, 2):
            raise ValueError(f"option 'buffers' must be 1 (single) or 2 (double buffering), not {self.buffers}")
        if self.db:
            try:
                TuningRepository(self.db).close()
            except RepositoryError as e:
                raise ValueError(f"option 'db': {e}") from None
        if self.target:
            try:
                load_target(self.target)
            except KeyError as e:  # TargetError: an unknown name or an invalid file, said in its message
                raise ValueError(f"option 'target': {e}") from None

    def run(self, module: Module, ctx: PassContext) -> None:
        chip = load_target(self.target) if self.target else ctx.target
        repository = TuningRepository(self.db) if self.db else None
        try:
            self._tile(module, ctx, chip, repository)
        finally:
            if repository is not None:
                repository.close()

    def _tile(self, module: Module, ctx: PassContext, chip: Target, repository: TuningRepository | None) -> None:
        for graph in module.graphs:
            for op in graph.walk():
                if op.has_trait(NoKernel):
                    continue  # constants and the terminator become no task
                try:
                    placement = place_op(op, chip)
                except Unplaceable as e:
                    ctx.error(str(e), op.loc)
                    continue
                ctx.record(placement)
                if placement.engine == AICPU:
                    op.attributes[ENGINE_ATTR] = AICPU
                    op.attributes.pop("tiling", None)  # the AI CPU runs the op whole
                    ctx.remark(placement.render(), op.loc)
                    continue
                op.attributes.pop(ENGINE_ATTR, None)
                kernel = KERNELS[op.name]
                sig = OpSignature.of(op)
                if not kernel.needs_tiling(sig):
                    continue
                chosen = self._choose(op, sig, chip, ctx.tiling_memo)
                source = "rules"
                if repository is not None and not isinstance(chosen, Miss):
                    chosen, source = consult(repository, kernel, sig, chip, self.buffers, chosen)
                decision = TilingDecision(op.name.partition(".")[2], op.loc, None if isinstance(chosen, Miss) else chosen,
                                          chosen if isinstance(chosen, Miss) else None, source)
                ctx.record(decision)
                if decision.miss is not None and decision.miss.overflow:
                    ctx.error(decision.render(), op.loc)
                    continue
                if decision.miss is not None:
                    op.attributes.pop("tiling", None)
                else:
                    op.attributes["tiling"] = decision.tiling.to_attr()
                ctx.remark(decision.render(), op.loc)

    def _choose(self, op: Operation, sig: OpSignature, chip: Target, memo: dict | None) -> KernelTiling | Miss:
        """tile_op, remembered in `memo` by everything the choice depends on."""
        if memo is None:
            return tile_op(op, chip, self.buffers)
        key = (chip.name, self.buffers, sig.key)
        found = memo.get(key)
        if found is None:
            found = memo[key] = tile_op(op, chip, self.buffers)
        return found


def tile_op(op: Operation, chip: Target, buffers: int = 2) -> KernelTiling | Miss:
    """The tiling the op's kernel chooses for it, or why there is none."""
    sig = OpSignature.of(op)
    if any(t is None for t in sig.operands + sig.results):
        return Miss("its types are unknown")
    return KERNELS[op.name].choose(sig, chip, buffers)


def consult(repository: TuningRepository, kernel: Kernel, sig: OpSignature, chip: Target, buffers: int,
            rules: KernelTiling) -> tuple[KernelTiling, str]:
    """The tiling to use for an op the rules tiled: the repository's entry when it beat these rules (and still
    fits the chip's buffers), else the rules'; its `rule` says which and why (the --explain remark)."""
    try:
        entry = repository.entry(sig, buffers, chip)
    except RepositoryError as e:
        return attrs.evolve(rules, rule=f"{rules.rule}; the tuning repository cannot be read ({e})"), "rules"
    if entry is None:
        return attrs.evolve(rules, rule=f"{rules.rule}; not in the tuning repository"), "rules"
    if not entry.current:
        return attrs.evolve(rules, rule=f"{rules.rule}; the tuning repository's entry was measured by another version "
                                       f"of the cost model ({entry.model}): run getune again"), "rules"
    if entry.rules_tiling != rules.to_attr():
        return attrs.evolve(rules, rule=f"{rules.rule}; the tuning repository's entry was measured against other "
                                       f"rules ({describe(entry.rules_tiling)}): run getune again"), "rules"
    if not entry.beats_rules:
        return attrs.evolve(rules, rule=f"{rules.rule}; the tuning repository found nothing faster in "
                                       f"{entry.candidates} candidates ({entry.rules_us:.2f} us)"), "rules"
    try:
        tuned = kernel.with_budget(kernel.decode(entry.tiling, "the tuning repository's tiling"), sig, chip)
    except (TilingAttrError, TypeError, ValueError) as e:
        return attrs.evolve(rules, rule=f"{rules.rule}; the tuning repository's entry is not a tiling: {e}"), "rules"
    overflow = kernel.budget(tuned, sig, chip).overflow(chip)
    if overflow is not None:
        name, need, cap = overflow
        return attrs.evolve(rules, rule=f"{rules.rule}; the tuning repository's {describe(entry.tiling)} needs "
                                       f"{need} bytes of {name}, which holds {cap}"), "rules"
    # the kernel's own legal tilings, as getune timed them: a damaged or hand-edited entry (a block of 0, a
    # block off the fractal) would otherwise reach the kernel's loops
    legal = {tiling_text(c) for c in kernel.candidates(sig, chip, buffers)}
    if tiling_text(tuned) not in legal:
        return attrs.evolve(rules, rule=f"{rules.rule}; the tuning repository's {describe(entry.tiling)} is not one "
                                       f"of the kernel's legal tilings for this op: run getune again"), "rules"
    return attrs.evolve(tuned, rule=tuned_rule(entry)), "repository"


def tuned_rule(entry: Entry) -> str:
    """The --explain prose of a tiling taken from the repository."""
    return (f"tuned {describe(entry.tiling)} from the tuning repository: {entry.time_us:.2f} us against the rules' "
            f"{describe(entry.rules_tiling)} at {entry.rules_us:.2f} us ({entry.speedup:.2f}x, "
            f"best of {entry.candidates} candidates)")


_NOT_BLOCKS = ("cores", "work_units", "skipped_blocks")


def describe(tiling: dict) -> str:
    """A tiling attribute in a few words: its template and blocks (not its budgets or core counts)."""
    parts = [str(tiling.get("template", ""))]
    parts += [f"{k} {v}" for k, v in tiling.items() if k != "template" and k not in _NOT_BLOCKS
              and not k.endswith("_bytes")]
    return " ".join(p for p in parts if p)
