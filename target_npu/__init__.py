"""The simulated NPU: named target configurations read from data files (see targets/)."""

from geir.target_npu.target import Target, as_target, available_targets, load_target

__all__ = ["Target", "as_target", "available_targets", "load_target"]
