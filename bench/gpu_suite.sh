#!/usr/bin/env bash
# Every GPU test and benchmark in one call on the GPU machine (one H200, jax 0.11.2).
#   bash bench/gpu_suite.sh [step ...]     steps: env tests resolve data_plane sparse_mla
# Each step has its own time limit and a failing step does not stop the others. The log goes
# to $OUT/suite.log and bench/results/ (also packed as $OUT/results.tar.gz) when OUT is set.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hisparse-gpu-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env tests resolve resolve_pallas data_plane sparse_mla)
summary=()

run_step() {  # name, time limit in s, command...
  local name=$1 limit=$2
  shift 2
  echo "=== [$name] $(date +%T) $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  summary+=("$name: exit $rc in $((SECONDS - t0)) s")
  echo "=== [$name] exit $rc after $((SECONDS - t0)) s"
}

{
  for step in "${steps[@]}"; do
    case $step in
      env) run_step env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv; python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices(), [m.kind for m in jax.devices()[0].addressable_memories()])"' ;;
      tests) run_step tests 360 python3 -m pytest -m gpu -q -rfE --timeout=200 -p no:cacheprovider tests ;;
      resolve) run_step resolve 150 python3 -m bench.bench_resolve --backend reference ;;
      resolve_pallas) run_step resolve_pallas 150 python3 -m bench.bench_resolve --backend pallas ;;
      data_plane) [ -f bench/bench_data_plane.py ] && run_step data_plane 240 python3 -m bench.bench_data_plane ;;
      sparse_mla) run_step sparse_mla 240 python3 -m bench.bench_sparse_mla ;;
      *) echo "unknown step $step" ;;
    esac
  done
  echo "=== summary"
  printf '%s\n' "${summary[@]}"
} 2>&1 | tee "$OUT/suite.log"
tar czf "$OUT/results.tar.gz" bench/results
