"""The model: the ONNX Runtime session, device I/O binding, the input schema every request is
checked against, batch axes and value ranges."""
