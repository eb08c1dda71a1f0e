#!/usr/bin/env bash
# The scale-out measurements of benchmarks/scaling.py in one device call, on every GPU of the machine, each stage
# under its own time limit, results appended to $OUT/scaling.jsonl and summarised in $OUT/summary.md (a machine with
# several GPUs is lent for a while and handed back when idle: one call measures everything).
#   bash benchmarks/scaling_gpu.sh train accum torch moe own
# stages: train (the 1B step, one micro-batch per GPU: the default (layers gathered two at a time where the weights
#         fit, jrl.train.fsdp_gathers) and grad_sync=update gathering the whole weights once), accum (8 micro-batches per GPU, both grad_sync values), torch (PyTorch FSDP2 and DDP peers),
#         moe (the Qwen3-30B-A3B layer gathered and expert parallel, dropless, then with capacity 1.25, then
#         dropless in 2 and 4 chunks),
#         own (one expert-parallel device's own work at EP = the GPU count, on one GPU),
#         nccl (the train stage's default program once per NCCL_MAX_NCHANNELS value of $CHANNELS, "2 4 8"),
#         groups (the per-layer program, then the layers gathered P at a time for P in $LAYERS, "1 2 4", each
#         --grad-sync micro_batch),
#         big (the 8B full fine-tune on every GPU, each layer gathered in its checkpoint and two layers at a time,
#         then its PyTorch FSDP2 peer with activation checkpointing; BIG_SHAPE, llama8b),
#         moe_model (the Qwen3-30B-A3B LoRA update on one GPU, then on every GPU experts gathered and expert
#         parallel dropless (efficiency against the one GPU), then expert parallel with capacity 1.25; its PyTorch
#         FSDP2 peer with gradient checkpointing; ~6 min at 2 GPUs: a call of its own)
# env: DEVICES (1,<all GPUs>), SHAPE (llama1b), MOE_SHAPE (qwen3_30b_a3b), STEPS (8), STAGE_TIMEOUT (300 s each),
#      EXTRA (more scaling.py args)
set -u
OUT=${OUT:-$PWD/scaling_gpu_out}
mkdir -p "$OUT"
. benchmarks/gpu_env.sh
N=$(python3 -c "import jax; print(jax.device_count())")
DEVICES=${DEVICES:-1,$N}
S="timeout ${STAGE_TIMEOUT:-300} python3 benchmarks/scaling.py"
A="--out $OUT/scaling.jsonl ${EXTRA:-}"
T="--shape ${SHAPE:-llama1b} --devices $DEVICES --steps ${STEPS:-8}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1
for stage in "$@"; do
  start=$(date +%s)
  case $stage in
    train) $S train $T --grad-sync micro_batch,update $A ;;
    accum) $S train $T --micro-batches 8 --grad-sync micro_batch,update $A ;;
    torch) $S torch $T --wraps fsdp2,ddp $A ;;
    moe) $S moe --devices "$DEVICES" $A && $S moe --devices "$N" --expert-capacity 1.25 $A \
           && for c in 2 4; do $S moe --devices "$N" --expert-chunks $c $A; done ;;
    own) $S moe --own-experts "$N" $A && $S moe --own-experts "$N" --expert-capacity 1.25 $A ;;
    groups) for p in 0 ${LAYERS:-1 2 4}; do $S train $T --grad-sync micro_batch --fsdp-layers-per-gather $p $A; done ;;
    nccl) for ch in ${CHANNELS:-2 4 8}; do NCCL_MAX_NCHANNELS=$ch $S train $T --grad-sync micro_batch $A; done ;;
    big) B="--shape ${BIG_SHAPE:-llama8b} --devices $N --steps 4"
         for p in 0 2; do $S train $B --init device --fsdp-layers-per-gather $p $A; done
         $S torch $B --wraps fsdp2 --torch-remat $A ;;
    moe_model) M="--shape ${MOE_SHAPE:-qwen3_30b_a3b} --mode lora --devices $N --rows-per-device 8 --seq 1024 --steps 4"
               $S train $M --devices 1,$N --init device --layouts fsdp,expert:$N $A
               $S train $M --init device --layouts expert:$N --expert-capacity 1.25 $A
               $S torch $M --wraps fsdp2 --torch-remat $A ;;
    *) echo "unknown stage $stage" ;;
  esac > "$OUT/$stage.log" 2>&1
  echo "== $stage: exit $? in $(( $(date +%s) - start )) s"
done
[ -f "$OUT/scaling.jsonl" ] || { echo "no results: see $OUT/*.log"; exit 1; }
python3 - "$OUT/scaling.jsonl" > "$OUT/summary.md" <<'PY'
import json, sys

FIELDS = ("bench", "wrap", "devices", "layout", "micro_batches", "grad_sync", "expert", "ep", "expert_capacity",
          "expert_chunks", "fsdp_layers_per_gather",
          "step_s", "fwd_bwd_ms", "tokens_per_s_per_device", "efficiency", "mfu", "first_update_s", "compile_s",
          "check_loss_rel_diff", "nccl_env", "error")
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| " + " | ".join(FIELDS) + " |")
print("|" + "---|" * len(FIELDS))
for r in rows:
    print("| " + " | ".join("" if r.get(f) is None else str(r[f]) for f in FIELDS) + " |")
PY
cat "$OUT/summary.md"
