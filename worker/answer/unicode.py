"""Outputs whose reply UTF-8 cannot encode: the error that says which output, and why.

A string output can hold a lone surrogate (a model or a pipeline that builds text from bytes),
which msgpack's UTF-8 refuses; such a reply is answered INFERENCE_FAILED alone, naming the
output, while its run-mates are answered as usual (``worker.answer.answerer``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from producer.protocol.text import utf8_encodable
from worker.errors import Rejected

__all__ = ["not_unicode", "unencodable"]

log = logging.getLogger(__name__)


def unencodable(whose: str, outputs: Mapping[str, Any], rid: str) -> Rejected:
    """INFERENCE_FAILED for outputs whose reply UTF-8 cannot encode: the model (or the
    pipeline) made them, so the fault is not the caller's (the pipeline's postprocess
    answers its own such output so: ``worker.pipeline.hooks``)."""
    name = next((n for n, a in outputs.items() if not_unicode(a)), None)
    what = "an output" if name is None else f"output {name!r}"
    error = Rejected(
        "INFERENCE_FAILED",
        f"{whose} {what} holds a string that is not valid Unicode (a lone surrogate, which "
        "UTF-8 cannot encode).",
    )
    log.warning(
        "a reply could not be encoded",
        extra={"fields": {"rid": rid, "error": error.message}},
    )
    return error


def not_unicode(value: Any) -> bool:
    """Whether an output holds a str that UTF-8 cannot encode (a lone surrogate)."""
    array = np.asarray(value)
    return array.dtype.kind in "OU" and not utf8_encodable(array)
