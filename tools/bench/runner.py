"""One bench run, in order: its ceilings, its phases, then its rounds.

``Bench.run`` is the table of contents: measure the ceilings the chosen scenarios (or the
custom load) are compared with, then run each phase, then (``--rounds``) measure each ratio
target's ceiling and phase again, back to back. What is measured, and how, is ``Phases``'s
(``phases.py``); what each preset runs is ``scenarios.py``'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tools.bench import provenance
from tools.bench.phases import Options, Phases, Workers
from tools.bench.processes import PREFIX, WorkerSetup, request_inputs, worker_records
from tools.bench.report import say, targets
from tools.bench.scenarios import SCENARIOS, Paired

__all__ = ["Bench", "Options", "Workers"]


class Bench(Phases):
    """One run: builds models, measures ceilings, runs phases, and keeps the report."""

    def run(self) -> dict[str, Any]:
        """Measure the ceilings, then run the scenarios (or the custom load); returns the report."""
        try:
            if self.o.no_start:
                self._run_against_live_workers()
            elif self.o.scenarios:
                self._run_scenarios()
            else:
                self._run_custom()
        finally:
            self.workers.stop()
        self.report["targets"] = targets(self.report)
        self.report["finished_at"] = provenance.utc_now()
        return self.report

    def _run_scenarios(self) -> None:
        chosen = [SCENARIOS[name] for name in self.o.scenarios]
        if self.o.ceilings:
            bare: dict[str, set[int]] = {}
            for scenario in chosen:
                for model, model_sizes in scenario.bare:
                    bare.setdefault(model, set()).update(model_sizes)
            for model, sizes in sorted(bare.items()):
                self.bare(model, sorted(sizes))
            for model in sorted({m for s in chosen for m in s.protocol}):
                self.protocol(model, ("--model-file", str(self.model_file(model))), 32)
            for model in sorted({m for s in chosen for m in s.asyncio}):
                self.asyncio_batcher(model)
        for scenario in chosen:
            scenario.run(self)
        self.rounds([paired for scenario in chosen for paired in scenario.paired])

    def rounds(self, pairs: Sequence[Paired]) -> None:
        """``--rounds N``: measure each target's ceiling and then its phase again, N times, and
        keep every round's ratio; ``report.targets`` judges by their median. The run's own
        ceilings are measured minutes before its phases, on machines whose speed drifts by a
        third within that (shared/FACTS.md); a ceiling and a phase back to back drift alike."""
        by_phase: dict[str, list[Paired]] = {}
        for paired in pairs:
            by_phase.setdefault(paired.phase, []).append(paired)
        for n in range(1, self.o.rounds + 1):
            for phase_id, paired_here in by_phase.items():
                setup, load = self._loads[phase_id]
                self.workers.stop()  # the ceiling gets the machine to itself, as at the start
                references = [(p.target, p.ceiling(self)) for p in paired_here]
                got = self.phase(f"{phase_id} (round {n})", setup, load, keep=False)
                measured = got["throughput_per_s"]
                for target, reference in references:
                    ratio = measured / reference if reference else 0.0
                    say(f"round {n}: {target} {measured:,.0f} / {reference:,.0f} = {ratio:.2f}")
                    self.report["rounds"].setdefault(target, []).append(
                        {"round": n, "measured": measured, "reference": reference, "ratio": ratio}
                    )

    def _custom_phases(self) -> Iterator[tuple[str, dict[str, Any], str]]:
        o = self.o
        for c in o.concurrency:
            yield f"custom/closed-C{c}", {"mode": "closed", "concurrency": c}, "closed"
        for rate in o.rates:
            load = {"mode": o.arrivals, "rate_per_s": rate, "burst_size": o.burst_size}
            yield f"custom/{o.arrivals}-{rate:g}", load, o.arrivals

    def _run_custom(self) -> None:
        o = self.o
        setup = WorkerSetup(o.model, o.max_batch_size, o.max_wait_ms)
        self.shard(PREFIX, o.model, o.shards)  # before the worker starts: it reads the list
        if o.ceilings:
            self.bare(o.model, sorted({1, o.max_batch_size}))
            source = ("--model-file", str(self.model_file(o.model)))
            self.protocol(o.model, source, o.max_batch_size)
        for phase_id, load, kind in self._custom_phases():
            self.phase(phase_id, setup, load, series=f"{o.model} {kind}")

    def _run_against_live_workers(self) -> None:
        o = self.o
        record = worker_records(self.url, o.prefix, o.model)[0]
        self.shard(o.prefix, o.model, 1, live=True)
        self.report["machine"].setdefault("onnxruntime", record["runtime"]["onnxruntime"])
        if o.ceilings:
            sizes = sorted({1, int(record["batching"]["max_batch_size"])})
            if o.model_file:
                self.bare(o.model, sizes, Path(o.model_file))
            specs = self.workdir / "specs.json"
            specs.write_text(json.dumps({k: record[k] for k in ("inputs", "outputs")}))
            self.protocol(o.model, ("--specs", str(specs)), sizes[-1])
        for phase_id, load, kind in self._custom_phases():
            spec = self.load_spec(o.prefix, o.model, request_inputs(record), load)
            phase = self._measure(phase_id, spec, o.model, record, o.metrics_urls)
            phase["series"] = f"{o.model} {kind}"
