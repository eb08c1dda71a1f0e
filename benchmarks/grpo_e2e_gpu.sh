#!/usr/bin/env bash
# One device call of benchmarks/grpo_e2e.py: install the carried wheels (.whl), write the checkpoint once, then run
# the requested cases in order, each under its own time limit, results appended to $OUT/e2e.jsonl, the logs' tails
# folded into $OUT/e2e.log.
#   bash benchmarks/grpo_e2e_gpu.sh one bucketed trl            # one GPU: padded, length-bucketed, TRL
#   bash benchmarks/grpo_e2e_gpu.sh shared split                 # all visible GPUs: shared devices, 2 + rest split
# cases: one, bucketed (one GPU, --optim.length-bucket 128), packed (one GPU, --optim.packing), lora (one GPU), shared_lora (all GPUs),
#        trl (TRL's GRPOTrainer, one GPU),
#        packed_saveprobs (packed, the log-prob kernel keeping probabilities for its backward),
#        paged_packed / partial_packed (paged / partial with --optim.packing),
#        paged (one GPU, --rollout.kv.layout paged, every row in a slot), partial (paged + --rollout.partial), shared,
#        shared_packed / shared_paged / shared_partial (all GPUs, --optim.packing / paged / paged + partial),
#        shared_micro_sync (shared, gradients reduced every micro-batch: --optim.grad-sync micro_batch), shared_fsdp
#        (the sampler on the learner's FSDP shards), split (--rollout-devices $ROLLOUT_DEVICES, prefetch 1),
#        split_paged_packed / split_partial_packed (split, paged + packing / + partial)
# env: ONE_GPU (0: the GPU of the one-GPU cases), SHAPE (llama1b), STEPS (3), MAX_NEW (1024), MEAN_FRACTION (0.4: mean
#      completion length over MAX_NEW), PROMPTS (32 prompts per device and step), MICRO (8 rows per device and
#      micro-batch; 1 for rows of thousands of tokens), CASE_TIMEOUT (170 s), WORK (/tmp/e2e),
#      PY (python3), WHEELS (1: install the carried .whl files, built for the device image's Python 3.12),
#      CACHE (a directory: JAX's compilation cache for every case, shared between them; default off),
#      STALENESS (--rollout.max-staleness of the partial cases; default the config's, 1),
#      PARTIAL_KV (--rollout.partial-kv of the partial cases: keep, the default, or recompute),
#      SLOTS (--rollout.kv.slots of the paged and partial cases; default the config's),
#      SLOT_BUCKETS (--rollout.kv.slot-buckets of the paged and partial cases: slot counts per doubling, 1 2 4 or 8),
#      KV_DTYPE (--rollout.kv.dtype of the paged and partial cases: model, the default, or float8_e4m3fn),
#      EXTRA (more config overrides of the paged and partial cases, e.g. "--model.no-scan-layers"),
#      ROLLOUT_DEVICES (2: the devices that only generate in the split cases),
#      PROCESSES (the shared cases as this many processes, one share of the GPUs each, joined as a pod's hosts are)
# A partial case reaches its steady state once its carried rows have aged to the staleness bound: give it STEPS of
# at least STALENESS + 3.
set -u
OUT=${OUT:-$PWD/e2e_out}
WORK=${WORK:-/tmp/e2e}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
. benchmarks/gpu_env.sh
trap 'fold_logs "$LOGS" "$OUT/e2e.log"' EXIT
B="${PY:-python3} benchmarks/grpo_e2e.py"
INIT=$([ "${SHAPE:-llama1b}" = llama8b ] && echo torch || echo jrl)
[ -f "$WORK/meta.json" ] || timeout 300 $B prepare --work "$WORK" --shape "${SHAPE:-llama1b}" \
  --max-new-tokens "${MAX_NEW:-1024}" --mean-fraction "${MEAN_FRACTION:-0.4}" --init "$INIT" > "$LOGS/prepare.log" 2>&1 || { tail -5 "$LOGS/prepare.log"; exit 1; }
R="run --work $WORK --steps ${STEPS:-3} --prompts-per-device ${PROMPTS:-32} --micro-rows-per-device ${MICRO:-8}"
R="$R --out $OUT/e2e.jsonl${CACHE:+ --compile-cache $CACHE}"
ONE="env CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}"
RD=${ROLLOUT_DEVICES:-2}
SHARED="--layout shared${PROCESSES:+ --processes $PROCESSES}"
PAGED="--rollout.kv.layout paged ${SLOTS:+--rollout.kv.slots $SLOTS} ${KV_DTYPE:+--rollout.kv.dtype $KV_DTYPE} ${EXTRA:-}"
PAGED="$PAGED ${SLOT_BUCKETS:+--rollout.kv.slot-buckets $SLOT_BUCKETS}"
PARTIAL="$PAGED --rollout.partial ${STALENESS:+--rollout.max-staleness $STALENESS} ${PARTIAL_KV:+--rollout.partial-kv $PARTIAL_KV}"
for case in "$@"; do
  start=$(date +%s)
  case $case in
    one) $ONE timeout ${CASE_TIMEOUT:-170} $B $R --layout one ;;
    bucketed) $ONE timeout ${CASE_TIMEOUT:-170} $B $R --layout one -- --optim.length-bucket 128 ;;
    packed) $ONE timeout ${CASE_TIMEOUT:-170} $B $R --layout one -- --optim.packing ;;
    packed_saveprobs) $ONE timeout ${CASE_TIMEOUT:-170} $B $R --layout one -- --optim.packing \
      --logprobs-impl triton_saveprobs ;;
    paged_packed) $ONE timeout ${CASE_TIMEOUT:-170} $B $R --layout one -- $PAGED --optim.packing ;;
    partial_packed) $ONE timeout ${CASE_TIMEOUT:-170} $B $R --layout one -- $PARTIAL --optim.packing ;;
    lora) $ONE timeout ${CASE_TIMEOUT:-170} $B $R --layout one --lora ;;
    shared_lora) timeout ${CASE_TIMEOUT:-170} $B $R $SHARED --lora ;;
    paged) $ONE timeout ${CASE_TIMEOUT:-170} $B $R --layout one -- $PAGED ;;
    partial) $ONE timeout ${CASE_TIMEOUT:-170} $B $R --layout one -- $PARTIAL ;;
    trl) $ONE timeout ${CASE_TIMEOUT:-170} $B trl --work "$WORK" --steps "${STEPS:-3}" --prompts-per-device "${PROMPTS:-32}" \
      --out "$OUT/e2e.jsonl" ;;
    shared) timeout ${CASE_TIMEOUT:-170} $B $R $SHARED ;;
    shared_micro_sync) timeout ${CASE_TIMEOUT:-170} $B $R $SHARED -- --optim.grad-sync micro_batch ;;
    shared_packed) timeout ${CASE_TIMEOUT:-170} $B $R $SHARED -- --optim.packing ;;
    shared_paged) timeout ${CASE_TIMEOUT:-170} $B $R $SHARED -- $PAGED ;;
    shared_partial) timeout ${CASE_TIMEOUT:-170} $B $R $SHARED -- $PARTIAL ;;
    shared_fsdp) timeout ${CASE_TIMEOUT:-170} $B $R $SHARED --rollout-mesh data=1,fsdp=-1 ;;
    split) timeout ${CASE_TIMEOUT:-170} $B $R --layout split --rollout-devices $RD ;;
    split_paged_packed) timeout ${CASE_TIMEOUT:-170} $B $R --layout split --rollout-devices $RD -- $PAGED --optim.packing ;;
    split_partial_packed) timeout ${CASE_TIMEOUT:-170} $B $R --layout split --rollout-devices $RD -- $PARTIAL --optim.packing ;;
    *) echo "unknown case $case" ;;
  esac > "$LOGS/$case.log" 2>&1
  echo "== $case: exit $? in $(( $(date +%s) - start )) s"; grep -h "^step\|^trl step" "$LOGS/$case.log" | tail -3
done
