"""The Runtime: task streams, events, device memory and the interpreter of lowered rt.programs."""
