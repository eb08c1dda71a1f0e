"""The loss-fused LM head against the matmuls it cannot avoid, and against the naive full-logits path.

For N tokens (R rows of T), hidden H and vocab V, one forward + backward of a token-level clipped loss:

- ``matmuls``: logits = h·W, dh = g·Wᵀ, dW = hᵀ·g alone (three bf16 matmuls, f32 accumulation): the floor;
- ``fused``: :func:`jrl.kernels.logprobs.fused_head_loss` (logits once per chunk, loss and gradients in that pass);
- ``fused_split``: the same with every row split along its tokens (what a row past ``max_row_tokens`` takes: its
  log-probs, then the logits again for the gradients);
- ``logprobs``: :func:`jrl.kernels.logprobs.token_logprobs` (``auto``) and the loss on top (recomputes logits);
- ``naive``: full float32 logits, log-softmax, gather, autodiff.

Time is the median of jitted calls; memory is XLA's temporary-buffer size of the compiled program.

    python benchmarks/fused_head.py --rows 16 --row-len 1024 --hidden 4096 --vocab 151936
    python benchmarks/fused_head.py --rows 1 --row-len 16384 --hidden 2048 --vocab 128256 \
        --variants matmuls,fused,fused_split,logprobs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import bench, report  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TokenClip:
    def __call__(self, lp, ent, rows, num_tokens):
        import jax.numpy as jnp

        ratio = jnp.exp(lp - rows["old"])
        a = rows["adv"][:, None]
        return jnp.sum(-jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.28) * a)) / num_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--row-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--variants", default="matmuls,fused,logprobs,naive")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jrl.kernels.logprobs import fused_head_loss, token_logprobs

    r, t, h, v = args.rows, args.row_len, args.hidden, args.vocab
    key = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(key[0], (r, t, h), jnp.bfloat16)
    w = (jax.random.normal(key[1], (h, v), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
    y = jax.random.randint(key[2], (r, t), 0, v)
    rows = {"old": jnp.full((r, t), -np.log(v), jnp.float32), "adv": jax.random.normal(key[3], (r,), jnp.float32)}
    n_tok = jnp.asarray(r * t, jnp.float32)
    loss_fn = TokenClip()

    def matmuls(hidden, w):
        hf = hidden.reshape(r * t, h)
        logits = jnp.dot(hf, w, preferred_element_type=jnp.float32)
        g = logits.astype(jnp.bfloat16)
        return jnp.dot(g, w.T, preferred_element_type=jnp.float32), jnp.dot(hf.T, g, preferred_element_type=jnp.float32)

    def fused(hidden, w):
        return jax.grad(lambda a, b: fused_head_loss(a, b, y, loss_fn, rows, n_tok)[0], argnums=(0, 1))(hidden, w)

    def fused_split(hidden, w):
        return jax.grad(lambda a, b: fused_head_loss(a, b, y, loss_fn, rows, n_tok, max_row_tokens=0)[0],
                        argnums=(0, 1))(hidden, w)

    def logprobs(hidden, w):
        def f(a, b):
            lp, _ = token_logprobs(a.reshape(r * t, h), b, y.reshape(r * t))
            return loss_fn(lp.reshape(r, t), None, rows, n_tok)

        return jax.grad(f, argnums=(0, 1))(hidden, w)

    def naive(hidden, w):
        def f(a, b):
            logits = jnp.einsum("rth,hv->rtv", a, b, preferred_element_type=jnp.float32)
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), y[..., None], -1)[..., 0]
            return loss_fn(lp, None, rows, n_tok)

        return jax.grad(f, argnums=(0, 1))(hidden, w)

    fns = {"matmuls": matmuls, "fused": fused, "fused_split": fused_split, "logprobs": logprobs, "naive": naive}
    results = []
    for name in args.variants.split(","):
        fn = jax.jit(fns[name])
        try:
            compiled = fn.lower(hidden, w).compile()
            mem = compiled.memory_analysis()
            temp = getattr(mem, "temp_size_in_bytes", None)
            t_ms = bench(fn, hidden, w)["ms"]
        except Exception as e:  # noqa: BLE001 (out of memory for the naive path at large sizes)
            results.append(dict(variant=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(json.dumps(results[-1]), flush=True)
            continue
        results.append(dict(variant=name, ms=round(t_ms, 3), temp_gib=None if temp is None else round(temp / 2**30, 2)))
        print(json.dumps(results[-1]), flush=True)
    base = next((x["ms"] for x in results if x["variant"] == "matmuls" and "ms" in x), None)
    summary = dict(rows=r, row_len=t, hidden=h, vocab=v, device=jax.devices()[0].device_kind,
                   jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                   ratios={x["variant"]: round(x["ms"] / base, 3) for x in results if base and "ms" in x},
                   results=results)
    report(summary, args.out)


if __name__ == "__main__":
    main()
