"""Load a target description: a TOML file of the chip's numbers with their sources."""

from __future__ import annotations

import difflib
import math
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import attrs

TARGET_DIR = Path(__file__).with_name("targets")
DEFAULT_TARGET = "ascend910b"


@attrs.frozen
class MemorySystem:
    """The [memory] table: global memory as the cores see it, and the on-chip blocks."""

    l2_bytes: int
    l2_read_bytes_per_cycle: float  # a core's GM read rate when the bytes are in L2
    hbm_read_bytes_per_cycle: float  # a core's GM read rate from HBM
    hbm_bytes_per_s: float  # the whole chip's HBM bandwidth
    ub_block_bytes: int  # UB is allocated in blocks of this size
    hbm_block_bytes: int  # the burst HBM transfers round up to
    dma_latency_cycles: float  # the start of one DMA
    onchip_bytes_per_cycle: float  # L1 -> L0 and UB <-> L1 moves
    hbm_bytes: int = 0  # the device memory's capacity (0: the target file does not name it)

    @classmethod
    def of(cls, table: dict[str, Any]) -> MemorySystem:
        return cls(int(table["l2_mib"] * 2**20), table["gm_read_bytes_per_cycle_l2"],
                   table["gm_read_bytes_per_cycle_hbm"], table["hbm_tb_per_s"] * 1e12, table["ub_block_bytes"],
                   table["hbm_block_bytes"], table.get("dma_latency_cycles", 0),
                   table.get("onchip_bytes_per_cycle", 256), int(table.get("hbm_gib", 0) * 2**30))


@attrs.frozen
class HostLink:
    """The [host] table: the link between host and device, and the host's cost of submitting a task."""

    pcie_gb_per_s: float = 32.0
    copy_latency_us: float = 0.0
    launch_latency_us: float = 0.0  # the host's cost of submitting one task to a stream

    @classmethod
    def of(cls, table: dict[str, Any]) -> HostLink:
        return cls(table.get("pcie_gb_per_s", 32.0), table.get("copy_latency_us", 0.0),
                   table.get("launch_latency_us", 0.0))


@attrs.frozen
class AicpuEngine:
    """The [aicpu] table: the AI CPU cores that take the ops no AI Core kernel does."""

    cores: int
    clock_ghz: float
    cycles_per_op: float
    bytes_per_cycle: float
    task_overhead_us: float

    @classmethod
    def of(cls, table: dict[str, Any]) -> AicpuEngine:
        return cls(int(table["cores"]), table["clock_ghz"], table["cycles_per_op"], table["bytes_per_cycle"],
                   table["task_overhead_us"])


@attrs.frozen
class FusionGuard:
    """The [fusion] table: where the fused attention's decode-shaped calls stop paying off (measured by
    bench/fusion_crossover.py); None where the target gives no threshold."""

    decode_max_q: int | None = None
    decode_min_kv: int | None = None
    decode_max_busy: float = 0.5

    @classmethod
    def of(cls, table: dict[str, Any]) -> FusionGuard:
        return cls(table.get("flash_attention_decode_max_q"), table.get("flash_attention_decode_min_kv"),
                   table.get("flash_attention_decode_max_busy", 0.5))


@attrs.frozen
class Target:
    """A chip's numbers, as typed records read from its data file (the raw tables stay available in `data`, for
    the what-if overrides that rewrite them). A target is its name: the bundled name, a what-if spec in its
    canonical spelling, or the name a user's file declares."""

    name: str
    data: dict[str, Any] = attrs.field(repr=False, eq=False)
    memory: MemorySystem = attrs.field(init=False, repr=False, eq=False)
    host: HostLink = attrs.field(init=False, repr=False, eq=False)
    aicpu: AicpuEngine | None = attrs.field(init=False, repr=False, eq=False)
    fusion: FusionGuard = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        # the records are read once, when the (checked) data file is loaded; frozen, so set through object
        object.__setattr__(self, "memory", MemorySystem.of(self.data["memory"]))
        object.__setattr__(self, "host", HostLink.of(self.data.get("host", {})))
        object.__setattr__(self, "aicpu", AicpuEngine.of(self.data["aicpu"]) if "aicpu" in self.data else None)
        object.__setattr__(self, "fusion", FusionGuard.of(self.data.get("fusion", {})))

    def cube_fractal(self, dtype: str) -> tuple[int, int, int] | None:
        """The cube's m x k x n MACs per cycle for an element type (`"f16"`), None where the cube has no such
        mode."""
        mode = self.data["cube"].get(dtype)
        return None if mode is None else (mode[0], mode[1], mode[2])

    @property
    def cube_modes(self) -> tuple[str, ...]:
        """The element types the cube multiplies ([cube] table)."""
        return tuple(self.data["cube"])

    @property
    def vector_bytes_per_cycle(self) -> float:
        """Bytes a vector unit processes per cycle ([vector] bytes_per_cycle)."""
        return self.data["vector"]["bytes_per_cycle"]

    @property
    def nd2nz_on_load(self) -> bool:
        """Whether the load into L1 converts ND to the cube's NZ fractal layout on the way ([layout])."""
        return bool(self.data.get("layout", {}).get("nd2nz_on_load", False))

    @property
    def clock_hz(self) -> float:
        return self.data["cores"]["clock_ghz"] * 1e9

    @property
    def cube_cores(self) -> int:
        return self.data["cores"]["cube"]

    @property
    def vector_cores(self) -> int:
        return self.data["cores"]["vector"]

    @property
    def vector_per_cube(self) -> int:
        """Vector units (AIVs) paired with each cube core: 2 on Atlas A2's split cores, 1 where they share a core."""
        return int(self.data["cores"].get("vector_per_cube", 1))

    @property
    def separate_cube_vector(self) -> bool:
        """Whether the cube and vector units are separate cores exchanging data only through GM ([cores]
        separate_cube_vector: Atlas A2's AIC and AIV), rather than units of one AI core."""
        return bool(self.data["cores"].get("separate_cube_vector", False))

    @property
    def aicore_dtypes(self) -> tuple[str, ...]:
        """The element types the AI Core computes ([aicore] dtypes); without the table, every one but f64."""
        return tuple(self.data.get("aicore", {}).get("dtypes", AICORE_DTYPES))

    @property
    def has_aicpu(self) -> bool:
        """Whether the target has an AI CPU engine ([aicpu]) for the ops the AI Core cannot take."""
        return self.aicpu is not None

    def overhead(self, key: str) -> float:
        """A cost of running kernels on the board that no pipe's work accounts for ([overhead] table; 0 where the
        target gives none: no public measurement for that chip)."""
        return float(self.data.get("overhead", {}).get(key, 0.0))

    @property
    def launch_cores(self) -> int:
        """The cores a launch may start: AIC and AIV where they are separate cores, else the AI cores."""
        return self.cube_cores + (self.vector_cores if self.separate_cube_vector else 0)

    def head_cycles(self, started: int) -> float:
        """Cycles of a launch's head (core start, instruction fetch, initialisation) on the `started` cores:
        [overhead] head_full_chip_us for every core of the chip, in proportion to the cores started."""
        full = self.overhead("head_full_chip_us")
        return full * 1e-6 * self.clock_hz * min(started, self.launch_cores) / self.launch_cores if full else 0.0

    def buffer_bytes(self, name: str) -> int:
        """Capacity of an on-chip buffer (ub, l1, l0a, l0b, l0c) in bytes."""
        # A what-if chip may hold a fractional KiB (any whole number of 32-byte blocks); callers want bytes
        return int(round(self.data["buffers_kib"][name] * 1024))


class TargetError(KeyError):
    """A target that cannot be had: an unknown name, or a data file that is not valid TOML or lacks a
    quantity the model needs (the message names the file and the key)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


# Upper bounds: far beyond any chip (what-if chips included) but within what the simulator can hold, each
# with its reason, which the error states.
MAX_CORES = 4096
MAX_KIB = 1 << 30
MAX_RATE = 1e9
MAX_CYCLES = 1e9
MAX_US = 1e9
MAX_GHZ = 1e3
MAX_ROWS = 1 << 31
_WHY_CORES = "the simulator keeps a timeline per core; the largest Ascend has 32 AI cores"
_WHY_KIB = "1 TiB, more than any tensor a tile could hold"
_WHY_RATE = "a million times any chip's"
_WHY_TIME = "longer than any run GEIR simulates"
_WHY_GHZ = "1 THz"
_WHY_ROWS = "more rows than any tensor GEIR holds"


class Bound(NamedTuple):
    """A quantity's allowed values: least and most (with why no more), and whether it is a count."""

    least: float
    most: float
    why: str
    whole: bool = False


def _count(most: float = MAX_CORES, why: str = _WHY_CORES, least: int = 1) -> Bound:
    return Bound(least, most, why, True)


# Every quantity the model reads, by table: key -> its bounds; optional tables may be absent.
_REQUIRED = {
    "cores": {"cube": _count(), "vector": _count(), "clock_ghz": Bound(1e-9, MAX_GHZ, _WHY_GHZ)},
    "buffers_kib": {b: Bound(1, MAX_KIB, _WHY_KIB) for b in ("ub", "l1", "l0a", "l0b", "l0c")},
    "vector": {"bytes_per_cycle": Bound(1, MAX_RATE, _WHY_RATE)},
    "memory": {"l2_mib": Bound(0, MAX_KIB // 1024, "1 TiB, more than any device's memory"),
               "gm_read_bytes_per_cycle_l2": Bound(1e-9, MAX_RATE, _WHY_RATE),
               "gm_read_bytes_per_cycle_hbm": Bound(1e-9, MAX_RATE, _WHY_RATE),
               "hbm_tb_per_s": Bound(1e-9, MAX_RATE, _WHY_RATE),
               "ub_block_bytes": _count(MAX_KIB, _WHY_KIB), "hbm_block_bytes": _count(MAX_KIB, _WHY_KIB),
               "dma_latency_cycles": Bound(0, MAX_CYCLES, _WHY_TIME),
               "onchip_bytes_per_cycle": Bound(1e-9, MAX_RATE, _WHY_RATE)},
}
_OPTIONAL = {
    "cores": {"vector_per_cube": _count()},
    "memory": {"hbm_gib": Bound(2**-20, MAX_KIB // 2**20, "1 TiB, more than any device's memory")},
    "host": {"pcie_gb_per_s": Bound(1e-9, MAX_RATE, _WHY_RATE), "copy_latency_us": Bound(0, MAX_US, _WHY_TIME),
             "launch_latency_us": Bound(0, MAX_US, _WHY_TIME)},
    "fusion": {"flash_attention_decode_max_q": _count(MAX_ROWS, _WHY_ROWS, 0),
               "flash_attention_decode_min_kv": _count(MAX_ROWS, _WHY_ROWS, 0),
               "flash_attention_decode_max_busy": Bound(0, 1, "a share of the cores")},
}
# An [aicpu] table, when present, needs every one of these
_AICPU = {"cores": _count(), "clock_ghz": Bound(1e-9, MAX_GHZ, _WHY_GHZ),
          "cycles_per_op": Bound(0, MAX_CYCLES, _WHY_TIME), "bytes_per_cycle": Bound(1e-9, MAX_RATE, _WHY_RATE),
          "task_overhead_us": Bound(0, MAX_US, _WHY_TIME)}
# A cube fractal's m, k and n: the kernels align blocks to it (16 on every Ascend)
MAX_FRACTAL = 1024
# What the AI Core computes when a target file does not say: every element type but f64 (spec section 1)
AICORE_DTYPES = ("f16", "bf16", "f32", "i8", "i32", "i64", "i1")
_CUBE_MODES = ("f16", "bf16", "f32")


def _show(x: float) -> str:
    """A bound or a value as the error prints it: integers exactly, others in the shortest form."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _check_data(data: dict[str, Any], where: str) -> None:
    """TargetError naming the first missing or out-of-range quantity."""
    def number(table: str, key: str, bound: Bound, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TargetError(f"{where}: [{table}] {key} must be a number, not {value!r}")
        if not math.isfinite(value):  # NaN passes every comparison and would make every figure NaN
            raise TargetError(f"{where}: [{table}] {key} must be a finite number, not {value}")
        if bound.whole and not isinstance(value, int):
            raise TargetError(f"{where}: [{table}] {key} must be a whole number, not {value}")
        if value < bound.least:
            what = "positive" if bound.least > 0 else "non-negative"
            raise TargetError(f"{where}: [{table}] {key} must be {what}, not {value}")
        if value > bound.most:
            raise TargetError(f"{where}: [{table}] {key} must be at most {_show(bound.most)}, not {_show(value)} "
                              f"({bound.why})")

    for table, keys in _REQUIRED.items():
        section = data.get(table)
        if not isinstance(section, dict):
            raise TargetError(f"{where}: the target has no [{table}] table")
        for key, bound in keys.items():
            if key not in section:
                raise TargetError(f"{where}: [{table}] has no {key}")
            number(table, key, bound, section[key])
    for table, keys in _OPTIONAL.items():
        section = data.get(table, {})
        if not isinstance(section, dict):
            raise TargetError(f"{where}: [{table}] must be a table")
        for key, bound in keys.items():
            if key in section:
                number(table, key, bound, section[key])
    if "aicpu" in data:
        section = data["aicpu"]
        if not isinstance(section, dict):
            raise TargetError(f"{where}: [aicpu] must be a table")
        for key, bound in _AICPU.items():
            if key not in section:
                raise TargetError(f"{where}: [aicpu] has no {key}")
            number("aicpu", key, bound, section[key])
    dtypes = data.get("aicore", {}).get("dtypes", AICORE_DTYPES) if isinstance(data.get("aicore", {}), dict) else None
    if not (isinstance(dtypes, (list, tuple)) and all(isinstance(d, str) for d in dtypes)):
        raise TargetError(f"{where}: [aicore] dtypes must be a list of element types, not {dtypes!r}")
    cube = data.get("cube")
    if not isinstance(cube, dict) or not any(m in cube for m in _CUBE_MODES):
        raise TargetError(f"{where}: [cube] needs an m x k x n fractal for at least one of {', '.join(_CUBE_MODES)}")
    for mode, fractal in cube.items():
        if not (isinstance(fractal, list) and len(fractal) == 3
                and all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= MAX_FRACTAL for x in fractal)):
            raise TargetError(f"{where}: [cube] {mode} must be three positive integers [m, k, n] of at most "
                              f"{MAX_FRACTAL}, not {fractal!r}")


def available_targets() -> list[str]:
    """Names of the bundled targets."""
    return sorted(p.stem for p in TARGET_DIR.glob("*.toml"))


@lru_cache(maxsize=None)
def load_target(name_or_path: str = DEFAULT_TARGET) -> Target:
    """A bundled target by name, a user's own TOML file by path, or either with overrides, `BASE[key=value,...]`
    (a what-if chip, see overrides.py); TargetError (a KeyError) if none, or if the file or spec is not a valid
    target."""
    path = Path(name_or_path)
    if not (path.suffix == ".toml" and path.is_file()):
        path = TARGET_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            if str(name_or_path).endswith("]") and "[" in str(name_or_path):
                return _load_spec(str(name_or_path))
            known = available_targets()
            close = difflib.get_close_matches(str(name_or_path), known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (available: {', '.join(known)})"
            raise TargetError(f"unknown target '{name_or_path}'{hint}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
        raise TargetError(f"{name_or_path}: not a valid target file: {e}") from None
    _check_data(data, str(name_or_path))
    return Target(data.get("name", path.stem), data)


def as_target(target: Target | str) -> Target:
    """A Target as is, or the one a name (bundled, a TOML path, a what-if spec) loads: for the public entry points,
    which take either; everything below them takes a Target."""
    return target if isinstance(target, Target) else load_target(target)


def _load_spec(spec: str) -> Target:
    """The what-if chip `BASE[key=value,...]`: the base target with the overrides applied."""
    # Imported here: overrides.py builds on this module
    from geir.target_npu.overrides import OverrideError, apply_overrides, split_spec

    try:
        base, items = split_spec(spec)
    except OverrideError as e:
        raise TargetError(f"{spec}: {e}") from None
    try:
        chip = apply_overrides(load_target(base), items, base=base)
        if chip.name == spec:
            return chip
        # Equal chips are one object: another spelling (ub_bytes=x2 for ub_bytes=393216) loads the canonical
        # name's, once that is checked to be its own canonical name (so a rendering slip cannot recurse)
        again_base, again = split_spec(chip.name)
        if apply_overrides(load_target(again_base), again, base=again_base).name != chip.name:
            return chip
    except OverrideError as e:  # its message starts with the spec
        raise TargetError(str(e)) from None
    return load_target(chip.name)


def check_target(instance: object, attribute: object, name: str) -> None:
    """attrs validator for a pass's `target` option: empty (use --target), a bundled name, a TOML path, or
    either with overrides (`ascend910b[ub_bytes=x2]`)."""
    if name:
        try:
            load_target(name)
        except TargetError as e:
            raise ValueError(str(e)) from None
