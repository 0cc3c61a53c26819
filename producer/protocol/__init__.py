"""The wire format, with no I/O: tensor and body codecs, bounded msgpack reading, string and
bytes tensors, key names, and the error codes and exceptions (contract sections 1 to 4)."""
