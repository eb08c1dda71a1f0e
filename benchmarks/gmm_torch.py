"""PyTorch's grouped matmul (``torch._grouped_mm``, the kernel transformers' ``grouped_mm`` experts call) on the
shapes of benchmarks/kernels_gmm.py, as % of a dense PyTorch matmul of the same FLOPs: what the grouped-matmul
goal (>= 70% of dense) looks like for the library a PyTorch user would run, on the same GPU.

    python benchmarks/gmm_torch.py [--T 32768] [--K 2048] [--N 1024] [--E 8,64,128] [--dists uniform,skewed]

Weights are stored [E, N, K] and passed transposed, as transformers does; group sizes are kernels_gmm's
(uniform, or skewed with the last quarter of the experts empty). The backward takes the gradients of the input
and of the weights. Times are kernels_common.bench's (medians of repetitions of back-to-back calls, each
repetition synchronised at its end); TFLOP/s counts 2*T*K*N per matmul (x3 for forward+backward). Prints a
markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

from kernels_common import bench
from kernels_gmm import group_sizes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=1024)
    ap.add_argument("--E", default="8,64,128")
    ap.add_argument("--dists", default="uniform,skewed")
    args = ap.parse_args()

    import torch

    print(f"# torch._grouped_mm benchmark\n\ndate {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
          f"python {platform.python_version()}, torch {torch.__version__}, device {torch.cuda.get_device_name()}\n\n"
          f"command: python {' '.join(sys.argv)}\n", flush=True)
    t, k, n = args.T, args.K, args.N
    flops = 2.0 * t * k * n
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dout = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    w2 = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5).requires_grad_()

    def cuda_ms(fn) -> float:
        return bench(fn, wait=lambda _: torch.cuda.synchronize())["ms"]

    def backward_of(out_fn, weight):
        """Forward and the gradients of the input and ``weight`` (returned, not accumulated into ``.grad``)."""
        return lambda: torch.autograd.grad(out_fn(), (x, weight), dout)

    with torch.no_grad():
        d_f = cuda_ms(lambda: x @ w2.t())
    d_fb = cuda_ms(backward_of(lambda: x @ w2.t(), w2))
    print(f"dense [{t},{k}]x[{k},{n}] bf16: fwd {d_f:.3f} ms ({flops / d_f / 1e9:.1f} TFLOP/s), fwd+bwd {d_fb:.3f} ms "
          f"({3 * flops / d_fb / 1e9:.1f} TFLOP/s)\n", flush=True)
    print("| E | groups | fwd ms | fwd TFLOP/s | fwd % dense | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd % dense |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for e in [int(v) for v in args.E.split(",")]:
        w = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5).requires_grad_()
        for dist in args.dists.split(","):
            offs = torch.as_tensor(group_sizes(t, e, dist), device="cuda").cumsum(0).to(torch.int32)

            def forward():
                return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

            try:
                with torch.no_grad():
                    tf = cuda_ms(forward)
                tfb = cuda_ms(backward_of(forward, w))
            except Exception as ex:  # noqa: BLE001  (a shape the kernel refuses is reported, not fatal)
                print(f"| {e} | {dist} | failed: {type(ex).__name__}: {str(ex)[:300]} |", flush=True)
                continue
            row = dict(E=e, dist=dist, fwd_ms=tf, fwd_tflops=flops / tf / 1e9, fb_ms=tfb,
                       fb_tflops=3 * flops / tfb / 1e9, dense_fwd_ms=d_f, dense_fb_ms=d_fb)
            rows.append(row)
            print(f"| {e} | {dist} | {tf:.3f} | {row['fwd_tflops']:.1f} | {100 * d_f / tf:.0f}% | {tfb:.3f} | "
                  f"{row['fb_tflops']:.1f} | {100 * d_fb / tfb:.0f}% |", flush=True)
    print("\n" + json.dumps({"dense_fwd_ms": d_f, "dense_fb_ms": d_fb, "rows": rows}))


if __name__ == "__main__":
    main()
