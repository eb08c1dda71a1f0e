#!/usr/bin/env bash
# One benchmark command run against two source trees in turn, in one device call (a change's effect is measured
# side by side: the same machine, its noise spread over both). The other tree is a copy of an earlier commit's
# files, made beside the working tree (in an ignored folder, carried with the call):
#   mkdir -p .ab/before && git archive HEAD jrl benchmarks | tar -x -C .ab/before
#   ORDER="before this before this" bash benchmarks/ab_trees.sh .ab/before -- \
#       python3 benchmarks/sampler.py --shape llama1b --kv paged --reps 1
# Each run is a process of its own, in the tree it measures (the command's paths are that tree's), with a JAX
# compilation cache shared by all runs (the same programs are not compiled twice), its last lines of output in
# $OUT/ab_logs.txt and its JSON lines (the command's `--out`, added here) in $OUT/ab.jsonl, each prefixed with the
# run's label ("before" or "this") and number.
# env: ORDER ("before this before this"), RUN_TIMEOUT (seconds per run, 300), WHEELS (gpu_env.sh)
set -u
[ $# -ge 3 ] && [ "$2" = "--" ] || { echo "usage: ab_trees.sh BEFORE_TREE -- COMMAND..."; exit 2; }
before=$(cd "$1" && pwd) this=$PWD
shift 2
OUT=${OUT:-$PWD/ab_out}
mkdir -p "$OUT"
. benchmarks/gpu_env.sh
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_ab_cache} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
paths=${PYTHONPATH%"$PWD"}  # gpu_env.sh's path (the carried wheels' folder) without this tree, which each run names
work=$(mktemp -d)
n=0
for label in ${ORDER:-before this before this}; do
  n=$((n + 1))
  case $label in before) root=$before ;; this) root=$this ;; *) echo "ORDER names before or this, not $label"; exit 2 ;; esac
  start=$(date +%s)
  (cd "$root" && PYTHONPATH="$paths$root" timeout "${RUN_TIMEOUT:-300}" "$@" --out "$work/$n.jsonl") > "$work/$n.log" 2>&1
  echo "== run $n ($label): exit $? in $(( $(date +%s) - start )) s"
  [ -f "$work/$n.jsonl" ] && sed "s|^|$label $n |" "$work/$n.jsonl" >> "$OUT/ab.jsonl"
  { echo "##### run $n ($label)"; tail -n 12 "$work/$n.log" | cut -c1-400; } >> "$OUT/ab_logs.txt"
done
