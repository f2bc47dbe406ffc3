"""Framework adaptors: ONNX and PyTorch models into GEIR modules."""
