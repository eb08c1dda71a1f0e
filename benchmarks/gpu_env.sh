# Sourced by the device-call scripts (grpo_e2e_gpu.sh, paged_gpu.sh, kernels_gpu_run.sh): install the carried wheels
# (.whl, built for the device image's Python; WHEELS=0 skips), the environment every call wants, and fold_logs.
if [ "${WHEELS:-1}" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>/dev/null || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

fold_logs() {  # DIR FILE: the last 40 lines of every DIR/*.log into FILE (a device call returns only a few files)
  for f in "$1"/*.log; do
    [ -f "$f" ] || continue
    echo "##### $(basename "$f")"
    tail -n 40 "$f" | cut -c1-600
  done > "$2"
}
