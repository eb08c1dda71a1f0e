#!/usr/bin/env bash
# The paged sampler's GPU measurements in one device call, on one GPU: the compiled paged and dense decode kernels' tests, the uniform
# workload on the dense and the paged sampler, a long-tailed one (512 rows, up to 8192 new tokens) paged and, where
# it fits, dense, and whole GRPO steps dense / paged / partial (benchmarks/grpo_e2e_gpu.sh). Sampler rows go to
# $OUT/sampler.jsonl, GRPO steps to $OUT/e2e.jsonl (their logs' tails to $OUT/e2e.log), the other logs' tails to
# $OUT/paged.log (few files come back).
#   bash benchmarks/paged_gpu.sh                      # all stages
#   bash benchmarks/paged_gpu.sh tests uniform e2e    # some: tests, uniform, longtail, longtail_keep, static, e2e,
#                                                     # partial_buckets
# (longtail_keep: the long-tailed workload with rollout.kv.tail_slots 0, the slots never shrunk; partial_buckets: a
# partial step's generation, float8 pool, every row in a slot, with rollout.kv.slot_buckets $BUCKETS in turn)
# Time limits: tests 240 s, uniform 440 s, longtail and static LONG_TIMEOUT each, e2e 3 x CASE_TIMEOUT plus writing
# its checkpoint; pick stages to fit a call.
# env: WHEELS (1: install the carried .whl files), LONG_TIMEOUT (500 s), CASE_TIMEOUT (150 s, per GRPO case),
#      BUCKETS (partial_buckets' slot buckets, one run each in order: "1 4 1 4")
set -u
OUT=${OUT:-$PWD/paged_out}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
. benchmarks/gpu_env.sh
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
trap 'fold_logs "$LOGS" "$OUT/paged.log"' EXIT
S="python3 benchmarks/sampler.py --shape llama1b --out $OUT/sampler.jsonl"
LONG="--rows 512 --generations 8 --prompt 256 --new 8192 --stop-fraction 0.001"
run() {  # name, time limit, command...
  local name=$1 limit=$2 start=$(date +%s); shift 2
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "== $name: exit $? in $(( $(date +%s) - start )) s"
}
for stage in ${@:-tests uniform longtail static e2e}; do
  case $stage in
    tests) run tests 240 python3 -m pytest -q -m gpu tests/kernels/test_paged_attention.py \
             tests/kernels/test_decode_attention.py -p no:cacheprovider -rfE ;;
    uniform) run uniform_dense 120 $S --rows 64 --prompt 128 --new 256 --kv dense
             run uniform_paged 120 $S --rows 64 --prompt 128 --new 256 --kv paged
             run uniform_256 200 $S --rows 256 --generations 8 --prompt 256 --new 1024 --kv paged --slots 256 --reps 1 ;;
    longtail) run longtail_paged "${LONG_TIMEOUT:-500}" $S $LONG --kv paged --slots 256 --reps 1 ;;
    longtail_keep) run longtail_keep "${LONG_TIMEOUT:-500}" $S $LONG --kv paged --slots 256 --reps 1 --tail-slots 0 ;;
    partial_buckets) i=0
                     for b in ${BUCKETS:-1 4 1 4}; do
                       i=$((i + 1))
                       run "partial_buckets${i}_$b" 200 $S $LONG --kv paged --reps 1 --kv-dtype float8_e4m3fn --carried 96 \
                         --groups-needed 64 --no-scan-layers --bandwidth-tbs 4.8 --slot-buckets $b
                     done ;;
    static) run longtail_dense_128 "${LONG_TIMEOUT:-500}" $S ${LONG/--rows 512/--rows 128} --kv dense --reps 1 ;;
    e2e) OUT=$OUT WHEELS=0 CASE_TIMEOUT=${CASE_TIMEOUT:-150} STEPS=${STEPS:-4} \
           bash benchmarks/grpo_e2e_gpu.sh one paged partial ;;
    *) echo "unknown stage $stage" ;;
  esac
done
