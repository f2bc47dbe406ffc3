"""The fusion rules `fuse` applies, one module per rule family (see passes/fuse.py)."""
