# Sourced by the device-call scripts (grpo_e2e_gpu.sh, paged_gpu.sh, kernels_gpu_run.sh): install the carried wheels
# (.whl, built for the device image's Python; WHEELS=0 skips), the environment every call wants, and fold_logs.
if [ "${WHEELS:-1}" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>/dev/null || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
fi
# PYTHONFAULTHANDLER: a crashing process prints every thread's Python stack (a 4-GPU paged run once died of SIGSEGV
# with nothing in its log).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1

fold_logs() {  # DIR FILE: the last 40 lines of every DIR/*.log appended to FILE (a device call returns only a few
  # files, and may run several scripts into one), after the earlier lines that report a step ("step N: ..."); of a
  # log with a fault handler's dump, everything from the dump on (up to 400 lines)
  for f in "$1"/*.log; do
    [ -f "$f" ] || continue
    echo "##### $(basename "$f")"
    if grep -q "^Fatal Python error" "$f"; then
      sed -n '/^Fatal Python error/,$p' "$f" | head -n 400 | cut -c1-600
    else
      head -n -40 "$f" | grep "^step [0-9]*:" | cut -c1-600
      tail -n 40 "$f" | cut -c1-600
    fi
  done >> "$2"
}
