"""Fuzzing the wire format and the worker's intake with seeded mutations of valid request bodies.

The oracle is not a second decoder but the contract's promise: every input gets exactly one
answer, whose code is OK (the mutation happened to stay valid) or a client-error code, never
INTERNAL and never nothing; no input crashes, hangs or bloats the worker. On top of that each
input's code is predicted by running ``admit`` (and the batch's value screen) locally, so the
worker must also answer with the right code, not just an allowed one.

Two drivers share one seeded ``Mutator``: ``fuzz_admit`` calls ``worker.intake.admit.admit``
in-process
(fast, with allocation tracking), and ``fuzz_worker`` pushes bodies through a real worker via
Redis and returns a plain summary dict for reports. The same seed gives the same inputs, so a
failure is replayed by its seed and index.

The package, one job a module: ``target`` (the model and limits under test), ``bodies`` (valid
bodies), ``hostile`` (raw msgpack pieces), ``mutator`` (seeded mutations and fuzzed entries),
``oracle`` (expected codes), ``rss`` (memory sampling), ``admit_driver`` and ``worker_driver``.
"""

from .admit_driver import fuzz_admit
from .hostile import INVALID_UTF8, raw_str
from .mutator import Mutator, iter_bodies
from .oracle import ADMIT_CODES, WORKER_CODES
from .target import SPECS, FuzzTarget, ModelSpec, schema_for, text_schema
from .worker_driver import fuzz_worker, wait_for_worker

__all__ = [
    "ADMIT_CODES",
    "INVALID_UTF8",
    "SPECS",
    "WORKER_CODES",
    "FuzzTarget",
    "ModelSpec",
    "Mutator",
    "fuzz_admit",
    "fuzz_worker",
    "iter_bodies",
    "raw_str",
    "schema_for",
    "text_schema",
    "wait_for_worker",
]
