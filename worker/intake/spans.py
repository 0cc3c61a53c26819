"""Where a request's per-request values lie in its body, for admitting look-alike bodies.

A worker keeps the rest of an admitted body to admit later bodies that differ only in these
spans without decoding them (``worker.intake.layouts``).
"""

from __future__ import annotations

from dataclasses import dataclass

from producer.protocol.bounded import bounded_unpacker


@dataclass(frozen=True, slots=True)
class BodySpans:
    """Where the per-request values lie in a body that ``decode_request`` accepted.

    ``data``: input name to (offset, length) of its ``data`` bin's payload. ``deadline``:
    (offset, width, signed) of the payload of ``deadline_ms`` when it is a 32- or 64-bit integer
    (its type byte fixes its width), else None.
    """

    data: dict[str, tuple[int, int]]
    deadline: tuple[int, int, bool] | None


def body_spans(body: bytes) -> BodySpans:
    """The spans of a body that ``decode_request`` accepted (see ``BodySpans``)."""
    unpacker = bounded_unpacker(len(body))
    unpacker.feed(body)
    data: dict[str, tuple[int, int]] = {}
    deadline: tuple[int, int, bool] | None = None
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        payload = _INT_PAYLOADS.get(body[unpacker.tell()])
        if key == "deadline_ms" and payload is not None:
            deadline = (unpacker.tell() + 1, *payload)
        if key != "inputs":
            unpacker.skip()
            continue
        for _ in range(unpacker.read_map_header()):
            name = unpacker.unpack()
            for _ in range(unpacker.read_map_header()):
                key = unpacker.unpack()
                start = unpacker.tell()
                unpacker.skip()
                if key == "data":
                    data[name] = _bin_payload(body, start)
    return BodySpans(data, deadline)


def _bin_payload(body: bytes, start: int) -> tuple[int, int]:
    """(offset, length) of the payload of the msgpack bin whose header is at ``start``."""
    width = _BIN_WIDTHS[body[start]]
    return start + 1 + width, int.from_bytes(body[start + 1 : start + 1 + width], "big")


# msgpack integer types whose payload may hold any value of its width: (width, signed)
_INT_PAYLOADS = {0xCE: (4, False), 0xCF: (8, False), 0xD2: (4, True), 0xD3: (8, True)}
_BIN_WIDTHS = {0xC4: 1, 0xC5: 2, 0xC6: 4}
