"""Worker: JAX's persistent compilation cache through jrl.train.compile_cache. Compiles a program, enables the cache
in ``argv[1]``, compiles and runs another, asks for a second directory (``argv[2]``; kept out), and prints one JSON
line: what the cache did (:class:`CacheUse`), the program's result, JAX's cache directory after the second call,
the warning."""

from __future__ import annotations

import json
import logging
import sys

import jax
import jax.numpy as jnp

from jrl.train import compile_cache


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main() -> None:
    warned = Warnings()
    logging.getLogger("jrl.train.compile_cache").addHandler(warned)
    # Every compilation is cached here (JAX's default skips those under a second, as this small program's is).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.jit(jnp.sin)(1.0)  # something compiled before the cache is enabled: no obstacle
    use = compile_cache.enable(sys.argv[1])
    value = jax.jit(lambda x: jnp.sum(jnp.tanh(x @ x.T) ** 2))(jnp.arange(64.0).reshape(8, 8) / 64)
    again = compile_cache.enable(sys.argv[2])
    print(json.dumps(dict(loaded=use.loaded, written=use.written, saved_s=use.saved_s, value=float(value),
                          same=again is use, jax_dir=jax.config.jax_compilation_cache_dir,
                          warnings=warned.messages)))


if __name__ == "__main__":
    main()
