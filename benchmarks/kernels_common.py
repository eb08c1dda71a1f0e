"""Timing and environment helpers shared by the kernel benchmarks (benchmarks/kernels_*.py)."""

from __future__ import annotations

import collections
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def bench(fn, *args, warmup: int = 2, reps: int = 7, target_s: float = 0.05, max_inner: int = 50,
          wait=None) -> dict:
    """Median device time of ``fn(*args)`` in milliseconds.

    Compiles and warms up first; then each rep dispatches ``inner`` calls back to back (asynchronous
    dispatch keeps the GPU queue full, so host overhead is hidden for short kernels) and blocks on the
    last. ``inner`` is sized so that a rep takes about ``target_s``. Returns median, min and max per call.
    ``wait(out)`` blocks until ``out`` is computed: ``jax.block_until_ready`` unless given (a PyTorch side passes
    one that synchronises CUDA).
    """
    if wait is None:
        import jax

        wait = jax.block_until_ready
    wait(fn(*args))  # compile
    for _ in range(warmup):
        wait(fn(*args))
    t0 = time.perf_counter()
    wait(fn(*args))
    one = time.perf_counter() - t0
    inner = max(1, min(max_inner, int(target_s / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        wait(out)
        times.append((time.perf_counter() - t0) / inner)
    return {"ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times),
            "inner": inner, "reps": reps}


def report(row: dict, out: str | None) -> None:
    """Print ``row`` as one JSON line, and append it to the file ``out`` when given."""
    import json

    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def env_line() -> str:
    import jax

    parts = [f"date {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"python {platform.python_version()}", f"jax {jax.__version__}"]
    try:
        import jaxlib

        parts.append(f"jaxlib {jaxlib.__version__}")
    except Exception:
        pass
    for mod in ("triton", "jax_triton"):
        try:
            m = __import__(mod)
            parts.append(f"{mod} {getattr(m, '__version__', '?')}")
        except Exception as e:  # noqa: BLE001
            parts.append(f"{mod} unavailable ({type(e).__name__})")
    d = jax.devices()[0]
    parts.append(f"device {d.platform}:{getattr(d, 'device_kind', '?')} x{len(jax.devices())}")
    return ", ".join(parts)


def peak_bytes() -> int | None:
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def gib(x) -> str:
    return "n/a" if x is None else f"{x / 2**30:.2f}"


#: Kernel-name patterns of :func:`kernel_profile`'s categories, first match wins.
KERNEL_CATEGORIES = (
    ("collective", ("nccl", "allgather", "reducescatter", "allreduce", "all_gather", "reduce_scatter", "all_reduce",
                    "alltoall", "sendrecv")),
    ("matmul", ("gemm", "nvjet", "cublas", "cutlass", "sm90_xmma", "gemv", "triton_tem")),
    ("attention", ("cudnn", "flash", "fmha", "attention", "sdpa")),
    ("copy", ("memcpy", "memset", "copy")),
    ("reduction", ("reduce", "triton_red", "triton_per")),
    ("elementwise", ("loop_", "fusion", "transpose", "concatenate", "dynamic_update_slice", "slice", "pad",
                     "triton_poi", "elementwise", "vectorized")),
)


def kernel_profile(fn, *args, trace_dir: str, top: int = 40) -> dict:
    """GPU kernel time of one ``fn(*args)`` call from a profiler trace (after two warm-up calls): the total,
    per category (:data:`KERNEL_CATEGORIES`) and the ``top`` kernels by time, as a dict for :func:`report`.

    The trace is JAX's Perfetto export; kernels are the events on the streams of the first GPU in it (with several
    GPUs, each runs the same program: one is the step's timeline)."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
    return summarize_kernels(trace_kernels(trace_dir), top=top)


def trace_kernels(trace_dir: str) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of the kernels on the streams of the first GPU in the newest Perfetto trace
    JAX wrote under ``trace_dir``."""
    import glob
    import gzip
    import json

    path = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in names if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in names if e.get("name") == "thread_name"}
    gpus = sorted((name, pid) for pid, name in processes.items() if "GPU" in name)
    first = gpus[0][1] if gpus else None
    kernels = []
    for e in events:
        if e.get("ph") != "X" or e["pid"] != first:
            continue
        if "Stream" not in threads.get((e["pid"], e["tid"]), ""):
            continue
        kernels.append((float(e["ts"]), float(e["dur"]), e["name"]))
    return kernels


def summarize_kernels(kernels: list[tuple[float, float, str]], *, top: int = 40) -> dict:
    """Kernel time from (start us, duration us, name) of one step's kernels: the total, per category
    (:data:`KERNEL_CATEGORIES`), the ``top`` kernels by time and the idle gaps (:func:`idle_gaps`)."""
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    for _, dur, name in kernels:
        entry = per_kernel[name[:80]]
        entry[0] += dur
        entry[1] += 1
    by_category = collections.Counter()
    for name, (us, _) in per_kernel.items():
        low = name.lower()
        category = next((c for c, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")
        by_category[category] += us
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(kernel_ms=round(sum(us for us, _ in per_kernel.values()) / 1e3, 2),
                category_ms={c: round(us / 1e3, 2) for c, us in by_category.most_common()},
                **exposed_collectives(kernels),
                top_kernels=[dict(name=n, ms=round(us / 1e3, 3), calls=c) for n, (us, c) in ranked],
                **idle_gaps([(ts, dur, name[:60]) for ts, dur, name in kernels], top=top))


def _is_collective(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in KERNEL_CATEGORIES[0][1])


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def exposed_collectives(kernels: list[tuple[float, float, str]], *, top: int = 12) -> dict:
    """How much of the collective kernels' time (NCCL) no compute kernel runs beside, from one device's kernels
    (start us, duration us, name): the collectives' busy time (their union), the part of it not covered by any
    other kernel, i.e. what the step waits for communication, the exposed time in each tenth of the span, and the
    ``top`` longest exposed stretches with their offset from the first kernel and the collectives running in them."""
    comm_kernels = sorted((ts, ts + dur, name) for ts, dur, name in kernels if _is_collective(name))
    comm = _union([(a, b) for a, b, _ in comm_kernels])
    compute = _union([(ts, ts + dur) for ts, dur, name in kernels if not _is_collective(name)])
    if not comm:
        return {}
    start = min(ts for ts, _, _ in kernels)
    span = max(ts + dur for ts, dur, _ in kernels) - start
    busy = sum(b - a for a, b in comm)
    exposed, j = [], 0
    for a, b in comm:
        while j < len(compute) and compute[j][1] <= a:
            j += 1
        at, k = a, j
        while k < len(compute) and compute[k][0] < b:
            if compute[k][0] > at:
                exposed.append((at, compute[k][0]))
            at = max(at, compute[k][1])
            k += 1
        if at < b:
            exposed.append((at, b))
    total = sum(b - a for a, b in exposed)
    longest = sorted(exposed, key=lambda ab: ab[0] - ab[1])[:top]
    tenths = [0.0] * 10
    for a, b in exposed:
        for i in range(10):
            lo, hi = start + span * i / 10, start + span * (i + 1) / 10
            tenths[i] += max(0.0, min(b, hi) - max(a, lo))
    return dict(collective_busy_ms=round(busy / 1e3, 2), collective_exposed_ms=round(total / 1e3, 2),
                exposed_by_tenth_ms=[round(t / 1e3, 2) for t in tenths],
                top_exposed=[dict(us=round(b - a, 1), at_ms=round((a - start) / 1e3, 2),
                                  collectives=sorted({n[:50] for s, e, n in comm_kernels if s < b and e > a}))
                             for a, b in longest])


def idle_gaps(kernels: list[tuple[float, float, str]], *, top: int, min_us: float = 10.0) -> dict:
    """Where the GPU runs no kernel between the first kernel's start and the last one's end, from the kernels'
    (start us, duration us, name): the span, the idle total, the idle in gaps of at least ``min_us``, the ``top``
    longest gaps with their offset in the span and the kernels on either side, and the ``top`` pairs of kernels
    either side of the gaps by their gaps' total (many short gaps at one place in a loop add up where no single
    one is long)."""
    if not kernels:
        return {}
    kernels = sorted(kernels)
    start, busy_until, prev = kernels[0][0], kernels[0][0], ""
    idle, gaps = 0.0, []
    for ts, dur, name in kernels:
        if ts > busy_until:
            idle += ts - busy_until
            gaps.append((ts - busy_until, busy_until - start, prev, name))
        if ts + dur >= busy_until:
            busy_until, prev = ts + dur, name
    long = sorted((g for g in gaps if g[0] >= min_us), reverse=True)
    pairs = collections.defaultdict(lambda: [0.0, 0])
    for us, _, a, b in long:
        pairs[a, b][0] += us
        pairs[a, b][1] += 1
    return dict(span_ms=round((busy_until - start) / 1e3, 2), idle_ms=round(idle / 1e3, 2),
                idle_in_long_gaps_ms=round(sum(g[0] for g in long) / 1e3, 2), long_gaps=len(long),
                top_gaps=[dict(us=round(g, 1), at_ms=round(at / 1e3, 2), after=a, before=b)
                          for g, at, a, b in long[:top]],
                gap_pairs=[dict(after=a, before=b, ms=round(us / 1e3, 2), gaps=n, mean_us=round(us / n, 1))
                           for (a, b), (us, n) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]])
