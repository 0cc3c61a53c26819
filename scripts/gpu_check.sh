#!/usr/bin/env bash
# GPU check: redbatch on an NVIDIA GPU, every figure against bare session.run on the same GPU.
#
#   bash scripts/gpu_check.sh [--wheels DIR]... [--python PY]   on the GPU machine
#   bash scripts/gpu_check.sh --pack DIR [--ort-parts PARTS]    here: what the GPU machine lacks
#   bash scripts/gpu_check.sh --check-report REPORT.json        only the GPU check of one report
#
# Steps, each under `timeout` (a step that overruns is killed with what it started), 445 s in all:
#   1 preflight   nvidia-smi lists a GPU                                             10 s
#   2 install     the carried wheels (--wheels), or check the environment has all    45 s
#   3 probe       onnxruntime starts CUDAExecutionProvider on the tiny model          45 s
#   4 heavy       python -m tools.bench --model heavy --providers cuda,cpu, closed loop     130 s
#   5 graphs      the heavy model again, workers with [model.cuda] cuda_graph = true  50 s
#   6 resnet18    the same as 4 with the resnet18 model                              150 s
#   7 summary     every session of the reports ran on CUDA; summary.txt               15 s
# Steps 4 and 6: bare session.run (batch 1 and 32) and the Redis protocol alone as ceilings, then
# 1 (single caller), 16, 64 and 128 closed-loop callers against one worker (max_batch_size 32),
# each 1 or 2 s of warmup and 4 s measured; about a minute each on a 16-core machine. Step 5:
# 1 and 64 callers against a worker that pads batches to 1, 2, 4, ..., 32 rows and replays one
# CUDA graph per size (I/O binding included), set against step 4's bare ceiling.
#
# It fails (exit 1, one "gpu_check: FAILED:" line) when there is no nvidia-smi or GPU, when
# onnxruntime has no CUDA provider or cannot start it, or when a report shows a session that fell
# back to the CPU (the worker then logs one line and serves on the CPU): CPU figures are never
# reported as GPU ones. Output in $OUT, else ./gpu-check-out: summary.txt, heavy.json,
# heavy.txt, heavy-graphs.json, resnet18.json, resnet18.txt, nvidia-smi.txt and gpu_check.log
# (everything printed, heavy-graphs' table included).
#
# --wheels DIR (repeatable) installs DIR/*.whl with pip --target into a temporary folder, joins
# DIR/NAME.whl.part-* back into NAME.whl first, and puts DIR/bin (a carried redis-server) on PATH.
# --pack DIR, run on the development machine, fills such a folder: wheels of redis, hiredis and
# tenacity for CPython 3.12 (the versions of .venv), this machine's redis-server with its
# libraries; --ort-parts PARTS also cuts .venv's onnxruntime-gpu wheel (256 MB) into 56 MiB parts
# in PARTS, to travel one a call. docs/benchmarks.md, "GPU check", has the device tool's command.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS=(heavy resnet18)
CONCURRENCY=1,16,64,128
MAX_BATCH_SIZE=32
DURATION_S=4
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

fail() {
  echo "gpu_check: FAILED: $*" >&2
  exit 1
}

usage() {  # the comment at the top of this file
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
  exit "${1:-0}"
}

pick_python() {  # --python, else $PYTHON, else the checkout's .venv, else python3
  if [ -n "${python:-}" ]; then
    echo "$python"
  elif [ -n "${PYTHON:-}" ]; then
    echo "$PYTHON"
  elif [ -x "$root/.venv/bin/python" ]; then
    echo "$root/.venv/bin/python"
  else
    command -v python3 || fail "no python3 on PATH; give --python PY"
  fi
}

# ---------------------------------------------------------------------------------------------
# The GPU check of one report: every session asked for cuda and ran with CUDAExecutionProvider.

check_report() {  # check_report REPORT.json: exit 1 with the reason when it is not a GPU run
  "$py" - "$1" <<'EOF'
import json, sys

path = sys.argv[1]
try:
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
except (OSError, ValueError) as exc:
    sys.exit(f"gpu_check: FAILED: cannot read the bench report {path}: {exc}")
cuda = "CUDAExecutionProvider"
problems = []
asked = report.get("settings", {}).get("providers", [])
if not asked or asked[0] != "cuda":
    problems.append(f"the bench asked for providers {asked}, not cuda first")
for model, ceiling in report.get("ceilings", {}).get("bare", {}).items():
    ran = ceiling.get("providers") or []
    if cuda not in ran:
        problems.append(f"bare session.run of {model} ran with {ran}")
phases = report.get("phases") or []
if not phases:
    problems.append("the report has no phases")
served = {}  # providers -> the phases a worker served with them, when not CUDA
for phase in phases:
    ran = phase.get("worker", {}).get("providers") or []
    if cuda not in ran:
        served.setdefault(str(ran), []).append(phase.get("id"))
    elif not phase.get("ok"):
        problems.append(f"phase {phase.get('id')}: no request was answered OK")
for ran, ids in served.items():
    problems.append(f"the worker served {len(ids)} of {len(phases)} phases with {ran}")
binding = report.get("settings", {}).get("binding", "off")
for phase in phases:
    bound = phase.get("worker", {}).get("binding", "off")
    if bound != binding:
        problems.append(f"phase {phase.get('id')}: the worker ran with binding {bound}, "
                        f"not {binding}")
if problems:
    fell_back = any(" ran with " in p or " served " in p for p in problems)
    sys.exit(
        f"gpu_check: FAILED: {path} is not a GPU run: " + "; ".join(problems) + "."
        + (" The CUDA provider fell back to the CPU (the worker logs one line and goes on):"
           " these figures are not GPU figures." if fell_back else "")
    )
print(f"gpu_check: {path}: every session ran with {cuda}")
EOF
}

# ---------------------------------------------------------------------------------------------
# --pack DIR: what the GPU machine lacks, from this (development) machine.

download() {  # download DIR NAME...: cp312 manylinux wheels of .venv's versions of NAME...
  local dir=$1 pins=() name version platform_flags=()
  shift
  for name in "$@"; do
    version="$("$py" -c "import importlib.metadata as m; print(m.version('$name'))")" \
      || fail "$name is not installed in $py"
    pins+=("$name==$version")
  done
  for name in "${PLATFORMS[@]}"; do platform_flags+=(--platform "$name"); done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platform_flags[@]}" -d "$dir" "${pins[@]}"
}

pack() {  # pack DIR [PARTS]
  local dir=$1 parts=${2:-} wheel
  py="$(pick_python)"
  mkdir -p "$dir/bin" "$dir/lib"
  dir="$(cd "$dir" && pwd)"
  download "$dir" redis hiredis tenacity
  if [ -n "$parts" ]; then
    mkdir -p "$parts"
    download "$parts" onnxruntime-gpu
    for wheel in "$parts"/onnxruntime_gpu-*.whl; do
      split -b 56M -d -a 2 "$wheel" "$wheel.part-"
      rm "$wheel"
    done
    ls -l "$parts"
  fi
  # redis-server with every library it loads except the C and C++ runtimes, behind a wrapper
  # that points the loader at them for redis-server alone (python keeps the machine's own).
  local server lib
  server="$(command -v redis-server)" || fail "redis-server is not installed here"
  cp -L "$server" "$dir/lib/redis-server"  # Debian's is a link to redis-check-rdb: name matters
  for lib in $(ldd "$server" | awk '/=> \// {print $3}'); do
    case "$(basename "$lib")" in
      libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | ld-linux*) ;;
      libstdc++.so.* | libgcc_s.so.*) ;;
      *) cp -L "$lib" "$dir/lib/" ;;
    esac
  done
  cat >"$dir/bin/redis-server" <<'EOF'
#!/bin/sh
here="$(cd "$(dirname "$0")/../lib" && pwd)"
LD_LIBRARY_PATH="$here${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server" "$@"
EOF
  chmod +x "$dir/bin/redis-server"
  "$dir/bin/redis-server" --version
  du -sh "$dir"
  ls -l "$dir"
}

# ---------------------------------------------------------------------------------------------
# The run on the GPU machine.

step() {  # step NAME BUDGET_S: run this script's step NAME under timeout, keep its elapsed time
  local name=$1 budget=$2 t0=$SECONDS rc=0
  echo "== $name: starting (budget $budget s; $((SECONDS - start)) s elapsed)"
  timeout --kill-after=10 "$budget" bash "${BASH_SOURCE[0]}" --step "$name" || rc=$?
  printf '  %-10s %4d s  (budget %3d s)\n' "$name" $((SECONDS - t0)) "$budget" >>"$work/steps"
  echo "== $name: $((SECONDS - t0)) s (rc $rc)"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    fail "step $name ran over its $budget s budget"
  fi
  return "$rc"
}

preflight() {
  command -v nvidia-smi >/dev/null \
    || fail "nvidia-smi is not on PATH: this machine has no NVIDIA GPU (or no driver). The GPU" \
      "check measures nothing without one; run it on the GPU machine (docs/benchmarks.md)."
  nvidia-smi -L | grep -q '^GPU' || fail "nvidia-smi lists no GPU: $(nvidia-smi -L 2>&1)"
  nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
  nvidia-smi -L
}

install() {
  local dir wheel group wheels=() joined
  joined="$(mktemp -d)"
  for dir in ${GPU_CHECK_WHEELS:-}; do
    [ -d "$dir" ] || fail "--wheels $dir is not a folder"
    for group in $(find "$dir" -maxdepth 1 -name '*.whl.part-*' -printf '%f\n' \
      | sed 's/\.part-[0-9a-z]*$//' | sort -u); do
      cat "$dir/$group".part-* >"$joined/$group"  # the shell sorts the parts: 00, 01, ...
      wheels+=("$joined/$group")
    done
    for wheel in "$dir"/*.whl; do [ -f "$wheel" ] && wheels+=("$wheel"); done
  done
  if [ "${#wheels[@]}" -gt 0 ]; then
    echo "installing ${#wheels[@]} wheel(s) into $site: ${wheels[*]##*/}"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${wheels[@]}"
  fi
  rm -rf "$joined"
  PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}" "$py" - <<'EOF'
import importlib, sys

needed = ["numpy", "redis", "msgpack", "tenacity", "tqdm", "prometheus_client", "onnx",
          "onnxruntime"]
missing = []
for name in needed:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        missing.append(f"{name} ({exc})")
if missing:
    sys.exit("gpu_check: FAILED: missing Python packages: " + ", ".join(missing)
             + ". Carry them as wheels: scripts/gpu_check.sh --pack DIR here, --wheels DIR there.")
print(f"python {sys.version.split()[0]}: every package the bench needs imports")
EOF
}

cuda_libraries() {  # the lib folders of the nvidia-* pip packages (cuBLAS, cuDNN, ...), if any
  "$py" - <<'EOF'
import importlib.util, pathlib

spec = importlib.util.find_spec("nvidia")
found = []
for base in (spec.submodule_search_locations or []) if spec else []:
    found += [str(p) for p in sorted(pathlib.Path(base).glob("**/lib")) if any(p.glob("*.so*"))]
print(":".join(found))
EOF
}

probe() {
  "$py" -c 'import onnxruntime as ort, sys
names = ort.get_available_providers()
print(f"onnxruntime {ort.__version__} from {ort.__file__}: {names}")
if "CUDAExecutionProvider" not in names:
    sys.exit(f"gpu_check: FAILED: this onnxruntime ({ort.__version__}) has no CUDA provider: it "
             "is the CPU build. Carry onnxruntime-gpu (scripts/gpu_check.sh --pack DIR "
             "--ort-parts PARTS; docs/benchmarks.md, GPU check).")'
  "$py" -m tools.benchkit build tiny "$work/tiny.onnx" >/dev/null
  "$py" -m tools.benchkit bare --model-file "$work/tiny.onnx" --providers cuda,cpu \
    --batch-sizes 1 --duration-s 0.5 >"$work/probe.json" 2>"$work/probe.err" \
    || fail "benchkit bare on the CUDA provider failed: $(tail -n 5 "$work/probe.err")"
  if ! "$py" - "$work/probe.json" <<'EOF'
import json, sys

providers = json.load(open(sys.argv[1]))["providers"]
print(f"benchkit bare with --providers cuda,cpu: sessions run with {providers}")
sys.exit("CUDAExecutionProvider" not in providers)
EOF
  then
    echo "the worker's words: $(cat "$work/probe.err")"
    echo "onnxruntime's own (its log, which the worker silences):"
    "$py" - "$work/tiny.onnx" 2>&1 <<'EOF' | tail -n 15
import onnxruntime as ort, sys

ort.set_default_logger_severity(3)
session = ort.InferenceSession(sys.argv[1], providers=["CUDAExecutionProvider"])
print("providers:", session.get_providers())
EOF
    fail "onnxruntime has the CUDA provider but could not start it (CUDA or cuDNN libraries" \
      "missing? onnxruntime's error is above); the worker would fall back to the CPU."
  fi
}

bench() {  # bench MODEL WARMUP_S: the model's report and table, with its ceilings
  "$py" -m tools.bench --model "$1" --providers cuda,cpu --concurrency "$CONCURRENCY" \
    --max-batch-size "$MAX_BATCH_SIZE" --duration-s "$DURATION_S" --warmup-s "$2" \
    --json "$out/$1.json" >"$out/$1.txt"
}

graphs() {  # heavy with CUDA graphs; no ceilings (the summary uses heavy's), table to the log
  "$py" -m tools.bench --model heavy --providers cuda,cpu --binding cuda_graph \
    --concurrency 1,64 --max-batch-size "$MAX_BATCH_SIZE" --duration-s "$DURATION_S" \
    --warmup-s 1 --no-ceilings --json "$out/heavy-graphs.json"
}

summary() {
  "$py" - "$out" "${MODELS[@]}" heavy-graphs <<'EOF' >"$out/summary.txt"
import json, sys
from pathlib import Path

out, models = Path(sys.argv[1]), sys.argv[2:]
for model in models:
    r = json.loads((out / f"{model}.json").read_text())
    if model == "heavy-graphs":  # ratios against the plain heavy run's bare ceiling
        bare32 = json.loads((out / "heavy.json").read_text())["ceilings"]["bare"]["heavy"]
        bare32 = bare32["batch"]["32"]["rows_per_s"]
        print("heavy with [model.cuda] cuda_graph = true (bare: the heavy run's, batch 32)")
        print(f"  {'callers':>7} {'req/s':>8} {'/ bare':>7} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'batch':>6}")
        for p in r["phases"]:
            lat = p["latency_ms"]
            stages = (p.get("worker_side") or {}).get("stages", {})
            run = stages.get("inference", {}).get("mean_ms")
            print(f"  {p['load']['concurrency']:>7} {p['throughput_per_s']:>8,.0f} "
                  f"{p['throughput_per_s'] / bare32:>7.2f} {lat.get('p50', 0):>7.2f} "
                  f"{lat.get('p99', 0):>7.2f} {p['batch_rows']['mean']:>6.1f} "
                  f"run {'-' if run is None else f'{run:.2f}'} ms  binding "
                  f"{p['worker'].get('binding')}")
        print()
        continue
    m = r["machine"]
    print(f"{model}: GPU {'; '.join(m.get('gpus') or ['?'])}; onnxruntime {m.get('onnxruntime')};"
          f" {m['cpus_usable']} cores; sessions ran with {', '.join(m.get('providers') or [])}")
    bare = r["ceilings"]["bare"][model]["batch"]
    print("  bare session.run: " + "; ".join(
        f"batch {n}: {b['rows_per_s']:,.0f} rows/s ({b['run_ms']['p50']:.2f} ms a run, p50)"
        for n, b in sorted(bare.items(), key=lambda kv: int(kv[0]))))
    proto = r["ceilings"]["protocol"].get(model)
    if proto:
        print(f"  Redis protocol alone: {proto['throughput_per_s']:,.0f} req/s, 64 in flight")
    print(f"  {'callers':>7} {'req/s':>8} {'/ bare':>7} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'batch':>6} {'queue ms':>8} {'run ms':>7} {'write ms':>8}")
    for p in r["phases"]:
        lat, ratio = p["latency_ms"], p["vs_ceiling"].get("throughput_over_bare")
        stages = (p.get("worker_side") or {}).get("stages", {})
        worker = [stages.get(k, {}).get("mean_ms") for k in ("queue_wait", "inference",
                                                             "reply_write")]
        print(f"  {p['load']['concurrency']:>7} {p['throughput_per_s']:>8,.0f} "
              f"{'-' if ratio is None else f'{ratio:.2f}':>7} {lat.get('p50', 0):>7.2f} "
              f"{lat.get('p99', 0):>7.2f} {p['batch_rows']['mean']:>6.1f} "
              + " ".join(f"{'-' if v is None else f'{v:.2f}':>{w}}"
                         for v, w in zip(worker, (8, 7, 8)))
              + (f"  lost {p['lost']}" if p["lost"] else "")
              + (f"  errors {p['errors']}" if p["errors"] else ""))
    print()
EOF
}

# ---------------------------------------------------------------------------------------------

python=""
wheel_dirs=()
pack_dir=""
ort_parts=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheel_dirs+=("$(cd "${2:?--wheels needs a folder}" && pwd)"); shift 2 ;;
    --python) python="${2:?--python needs a path}"; shift 2 ;;
    --pack) pack_dir="${2:?--pack needs a folder}"; shift 2 ;;
    --ort-parts) ort_parts="${2:?--ort-parts needs a folder}"; shift 2 ;;
    --check-report)
      py="$(pick_python)"
      check_report "${2:?--check-report needs a report}"
      exit 0
      ;;
    --step)  # internal: one step, run by step() under timeout with the run's settings exported
      case "${2:-}" in
        preflight) preflight ;;
        install) install ;;
        probe) probe ;;
        heavy) bench heavy 1 ;;
        graphs) graphs ;;
        resnet18) bench resnet18 2 ;;
        summary) summary ;;
        *) fail "unknown step ${2:-}" ;;
      esac
      exit 0
      ;;
    -h | --help) usage 0 ;;
    *) echo "gpu_check: unknown option $1" >&2; usage 2 ;;
  esac
done
if [ -n "$pack_dir" ]; then
  pack "$pack_dir" "$ort_parts"
  exit 0
fi

start=$SECONDS
out="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
exec > >(tee -a "$out/gpu_check.log") 2>&1
work="$(mktemp -d)"
site="$work/site"
trap 'rm -rf "$work"' EXIT
cd "$root"
echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), output in $out"
export out work site
GPU_CHECK_WHEELS="${wheel_dirs[*]}"  # folders without spaces: pip --target paths, like $site
export GPU_CHECK_WHEELS

step preflight 10
py="$(pick_python)"
export py
for dir in "${wheel_dirs[@]}"; do
  if [ -x "$dir/bin/redis-server" ]; then PATH="$dir/bin:$PATH"; fi
done
step install 45
export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
libraries="$(cuda_libraries)"
echo "CUDA libraries from pip packages: ${libraries:-none found}"
export LD_LIBRARY_PATH="$libraries${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
command -v redis-server >/dev/null \
  || fail "redis-server is not on PATH: the bench starts its own private redis-server and" \
    "needs the binary. Carry one: scripts/gpu_check.sh --pack DIR here, --wheels DIR there."
echo "redis-server: $(command -v redis-server): $(redis-server --version)"
step probe 45
step heavy 130
check_report "$out/heavy.json"
step graphs 50
check_report "$out/heavy-graphs.json"
step resnet18 150
check_report "$out/resnet18.json"
step summary 15
{
  echo "steps (elapsed):"
  cat "$work/steps"
  echo "  total      $((SECONDS - start)) s"
} >>"$out/summary.txt"
cat "$out/summary.txt"
echo "gpu_check: done in $((SECONDS - start)) s; reports in $out"
