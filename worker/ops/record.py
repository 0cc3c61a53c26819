"""The validation record: exactly which model, runtime, inputs and settings a worker serves.

It is logged at start and kept in Redis under ``P:{M}:worker:NAME`` with a TTL that a heartbeat
thread renews, so ``redbatch status`` lists every live worker and forgets dead ones on its own.
The heartbeat also runs ``on_beat`` (the worker samples the stream's state for metrics there).
It beats until ``close()``, not until the worker's stop: a draining worker still answers, so it
stays listed (as ``draining``) and its stream gauges stay current until the drain ends.

A beat is a script flagged ``allow-oom``: the record replaces itself, so on a full Redis
(``maxmemory``) the workers draining it stay listed in ``redbatch status``, where operators look
during the incident. A beat that still fails is logged once and never stops serving.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import redis

from producer.protocol.keys import worker_key, workers_key
from producer.redisio.retry import describe_redis_error
from worker.config import WorkerConfig
from worker.errors import WorkerError
from worker.model.schema import Schema, dtype_name
from worker.model.session import ModelFile, OnnxModel

__all__ = ["Registry", "build_record", "utc_now"]

log = logging.getLogger(__name__)

# KEYS: the record, the registry set; ARGV: the record, its TTL, the name, "nx" to create only.
# Returns 1 when the record was written (0: NX found one there).
_BEAT_LUA = """#!lua flags=allow-oom
local made
if ARGV[4] == 'nx' then
  made = redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2], 'NX')
else
  made = redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
end
redis.call('SADD', KEYS[2], ARGV[3])
if made then return 1 end
return 0
"""


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_record(
    name: str,
    config: WorkerConfig,
    model: OnnxModel,
    model_file: ModelFile,
    schema: Schema,
    warmup: dict[str, Any],
) -> dict[str, Any]:
    """Everything an operator needs to know what this worker answers with."""
    return {
        "name": name,
        "state": "ready",
        "model": {
            "name": config.model.name,
            "version": config.model.version,
            "sha256": model_file.sha256,
            "path": str(model_file.path),
            "size_bytes": model_file.size_bytes,
            "opset": model_file.opsets.get("ai.onnx"),
            "opsets": model_file.opsets,
            "ir_version": model_file.ir_version,
            "producer": model_file.producer,
        },
        "inputs": [
            {
                "name": rule.spec.name,
                "dtype": dtype_name(rule.spec.dtype),
                "shape": rule.spec.shape,
                "batch_axis": _axis(rule.batch_axis),
                "min": rule.min,
                "max": rule.max,
                "reject_non_finite": rule.reject_non_finite and rule.is_float,
            }
            for rule in schema.inputs.values()
        ],
        "outputs": [
            {
                "name": s.name,
                "dtype": dtype_name(s.dtype),
                "shape": s.shape,
                "batch_axis": _axis(schema.axes.output_axis(s.name)),
            }
            for s in schema.outputs.values()
        ],
        "runtime": {
            "onnxruntime": model.runtime_version,
            "providers": model.providers,
            "requested_providers": model.requested,
            "intra_op_threads": config.model.intra_op_threads,
            "inter_op_threads": config.model.inter_op_threads,
            "allow_spinning": config.model.allow_spinning,
            "binding": model.binding,
            "batch_buckets": list(model.buckets),
        },
        "batching": {
            "max_batch_size": config.batching.max_batch_size,
            "max_wait_ms": config.batching.max_wait_ms,
            "adaptive_wait": config.batching.adaptive_wait,
            "fixed_batch": schema.fixed_batch,
        },
        "limits": {
            "max_request_bytes": config.limits.max_request_bytes,
            "max_element_bytes": config.limits.max_element_bytes,
        },
        "delivery": {
            "claim_idle_ms": config.delivery.claim_idle_ms,
            "max_deliveries": config.delivery.max_deliveries,
            "reply_ttl_s": config.delivery.reply_ttl_s,
            "max_run_s": config.delivery.max_run_s,
        },
        "warmup": warmup,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": utc_now(),
        "heartbeat_at": utc_now(),
        "served": {"requests": 0, "batches": 0},
    }


class Registry(threading.Thread):
    """Keeps this worker's record alive in Redis until ``close()`` (or ``stop`` is set)."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        record: dict[str, Any],
        stop: threading.Event | None = None,
        interval_s: float = 5.0,
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="redbatch-heartbeat", daemon=True)
        self.on_beat = on_beat
        self.client = client
        self.record = record
        self.stop = stop or threading.Event()  # ends the heartbeat; ``close()`` sets it
        self.interval_s = interval_s
        model = record["model"]["name"]
        self.key = worker_key(prefix, model, record["name"])
        self.set_key = workers_key(prefix, model)
        self._beat_script = client.register_script(_BEAT_LUA)
        self._lock = threading.Lock()
        self._wake = threading.Event()  # beat now rather than at the next interval
        self._remove_on_exit = False
        self._removed = False
        self._down = False
        self.published = False  # the record has reached Redis at least once
        self._name_free: bool | None = None  # beat_first's answer, once one came
        self._nx_tried = False

    def update(self, **changes: Any) -> None:
        """Change fields of the record (thread-safe); the next heartbeat publishes them."""
        with self._lock:
            for key, value in changes.items():
                if isinstance(value, dict) and isinstance(self.record.get(key), dict):
                    self.record[key].update(value)
                else:
                    self.record[key] = value

    def beat_soon(self) -> None:
        """Have the heartbeat thread publish the record now (e.g. a changed ``state``), without
        waiting for Redis on the calling thread."""
        self._wake.set()

    def beat_first(self) -> bool:
        """Publish the record for the first time; False when a live record already held this
        worker's name. Two workers under one name would share one consumer of the group and
        overwrite each other's record. ``SET NX`` tells without reading the key, which the
        worker's ACL user may not do (docs/security.md). Retried through an outage, it asks
        only until one answer came; a refusal after a try that failed may be that try's own
        write, so it counts as free."""
        if self._name_free is None:
            tried_before, self._nx_tried = self._nx_tried, True
            created = self._publish(only_new=True)
            self._name_free = created or tried_before
            self.published = self.published or created
        if self._name_free:  # a taken name's record is not this worker's to overwrite
            self.beat()
        return self._name_free

    def take_over_name(self, stop: threading.Event) -> bool:
        """After ``beat_first`` found the name taken: take the name over from a stopped worker
        (this worker's previous run, crashed, its record not yet expired), or raise
        WorkerError when another live worker holds it; False when ``stop`` came first. Two
        live workers under one name would share one consumer of the group and run each other's
        requests again. The worker's ACL user cannot read the record, so it takes the record
        away and waits a heartbeat and a half: a live worker writes it again, a stopped one
        never does."""
        wait_s = self.interval_s * 1.5
        name = self.record["name"]
        log.warning(
            "a worker record already held the name %r: this worker's previous run, or another "
            "live worker; waiting %.1f s to see whether its worker is alive",
            name,
            wait_s,
            extra={"fields": {"worker": name}},
        )
        self.client.delete(self.key)
        if stop.wait(wait_s):
            return False
        if not self._publish(only_new=True):
            raise WorkerError(
                f"another live worker holds the name {name!r}: its record came back within "
                f"{wait_s:g} s. Two workers under one name would share one consumer of the group "
                "and run each other's requests again. Give each worker its own --name (or leave "
                "--name out: the default is unique); `redbatch status` shows the other one's "
                "host and pid"
            )
        self.beat()
        log.info("the record under %r was a stopped worker's; taking the name over", name)
        return True

    def _payload(self) -> tuple[str, int]:
        """The record as published now, and its TTL: three heartbeats."""
        with self._lock:
            self.record["heartbeat_at"] = utc_now()
            payload = json.dumps(self.record)
        return payload, max(int(self.interval_s * 3), 1)

    def beat(self) -> None:
        """Publish the record now, with a TTL of three heartbeats."""
        self._publish(only_new=False)
        self.published = True

    def _publish(self, *, only_new: bool) -> bool:
        """Write the record and list its name; with ``only_new``, only if no record is there.
        Returns whether the record was written."""
        payload, ttl_s = self._payload()
        args = [payload, ttl_s, self.record["name"], "nx" if only_new else ""]
        try:
            return self._beat_script(keys=[self.key, self.set_key], args=args) == 1
        except redis.exceptions.NoPermissionError as exc:
            raise WorkerError(
                f"Redis refused the worker record's script ({exc}): the worker's ACL user "
                f"needs {self.key.rsplit(':', 1)[0]}:* and {self.set_key} in its EVALSHA "
                "selector (docs/security.md, 'Upgrading')"
            ) from exc

    def run(self) -> None:
        try:
            while True:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                if self.stop.is_set():
                    return
                self._beat_once()
        finally:
            if self._remove_on_exit:
                self.remove()  # here, after the last beat, so no beat can bring it back

    def _beat_once(self) -> None:
        try:
            try:
                self.beat()
            finally:
                # Also when the beat failed: on a cluster the record's master may be the one
                # failing over, and ``on_beat`` is where the worker reads the slot map again.
                if self.on_beat is not None:
                    self.on_beat()
            if self._down:
                self._down = False
                log.warning("heartbeat reached Redis again")
        except (redis.RedisError, WorkerError) as exc:  # it only informs: never stop serving
            if not self._down:
                self._down = True
                log.warning(
                    "heartbeat cannot update Redis (%s); will keep trying, and serving",
                    describe_redis_error(exc),
                )

    def close(self, remove: bool = True, timeout_s: float = 1.0) -> None:
        """End the heartbeat and, with ``remove`` (a clean exit), take the record out of Redis,
        waiting at most ``timeout_s`` for a beat in progress (one stuck on an unreachable Redis
        removes the record when it returns, if the process still runs). Without ``remove`` (a
        failed exit, Redis likely gone) it waits for nothing: the record expires on its own."""
        self._remove_on_exit = remove
        self.stop.set()
        self._wake.set()
        if not remove:
            return
        if self.is_alive():
            self.join(timeout_s)
            if self.is_alive():
                return
        if not self._removed:  # never started, or ended before the flag was seen
            self.remove()

    def remove(self) -> None:
        """Take the record out of Redis on a clean exit."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self.key)
            pipe.srem(self.set_key, self.record["name"])
            pipe.execute()
            self._removed = True
        except redis.RedisError as exc:
            log.warning("could not remove the worker record (%s); it expires on its own", exc)


def _axis(axis: int | None) -> int | str:
    return "none" if axis is None else axis
