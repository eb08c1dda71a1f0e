#!/usr/bin/env bash
# One device run for jrl.kernels: install the carried wheels (benchmarks/gpu_env.sh), print the environment, then run
# the requested stages, each under its own time limit, logging to $OUT (or ./kernels_gpu_out).
#   bash benchmarks/kernels_gpu_run.sh tests gmm logprobs
# stages: tests (pytest -m gpu tests/kernels), suite (all of tests/kernels: the CPU-written tests on a GPU machine too),
#         gmm (benchmarks/kernels_gmm.py $GMM_ARGS, default --sweep),
#         logprobs (benchmarks/kernels_logprobs.py $LP_ARGS, default --sweep)
set -u
OUT=${OUT:-$PWD/kernels_gpu_out}
mkdir -p "$OUT"
. benchmarks/gpu_env.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax, jaxlib, triton, jax_triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__); print(jax.devices())"
  date -u; } 2>&1 | tee "$OUT/env.txt"
for stage in "$@"; do
  start=$(date +%s)
  case $stage in
    tests|suite) XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q \
             $([ $stage = tests ] && echo "-m gpu") tests/kernels -p no:cacheprovider -rfE -n ${TEST_WORKERS:-6} \
             ${TEST_ARGS:-} 2>&1 | tee "$OUT/${stage}.log" | tail -40 ;;
    gmm) timeout ${GMM_TIMEOUT:-300} python3 benchmarks/kernels_gmm.py ${GMM_ARGS---sweep} 2>&1 | tee "$OUT/gmm.md" ;;
    logprobs) timeout ${LP_TIMEOUT:-400} python3 benchmarks/kernels_logprobs.py ${LP_ARGS---sweep} 2>&1 | tee "$OUT/logprobs.md" ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "== stage $stage took $(( $(date +%s) - start )) s"
done
