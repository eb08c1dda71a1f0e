"""How many layers' weights the per-device FSDP path gathers at once when ``ModelSpec.fsdp_layers_per_gather`` is
left to ``None`` (:attr:`jrl.models.config.ModelConfig.fsdp_layers_per_gather` says what the value does).

Two layers at a time keeps the whole weights on every device for the backward (no gather there; one gather and one
reduce-scatter per group, all but the first and last beside compute). On 2 H200s (Llama-3.2-1B, 8 x 1024 tokens per
GPU, one micro-batch) it kept 0.935-0.948 of one GPU's speed per GPU against 0.888-0.918 for each layer gathered in
its checkpoint and for the whole weights gathered once per update, and one layer at a time measured as fast; four
layers at a time left the first group's gather and the last group's reduce-scatter exposed (slower than per
layer). Its costs are memory (the whole weights in the compute dtype on every device) and compile time, the groups
being unrolled: 9.7 s against 7.6 s on one GPU for 16 layers, 19.5 s against 7.1 s per layer for 32, where it
gained 1.7% (``benchmarks/RESULTS.md``, twenty-first and twenty-second sessions; the scanned forms tried compile
faster and run 5-18% slower). ``None`` takes it on a GPU where the whole weights in the compute
dtype take at most :data:`jrl.train.grad_sync.AUTO_MEMORY_SHARE` of a device's memory; elsewhere (a CPU, a TPU, where
it was not measured, or a model too large) each layer is gathered in its checkpoint.
"""

from __future__ import annotations

from jrl.train.grad_sync import AUTO_MEMORY_SHARE

#: Layers gathered at once under ``fsdp_layers_per_gather=None`` where the whole weights fit (module docstring).
AUTO_LAYERS_PER_GATHER = 2


def layers_per_gather(setting: int | None, *, devices: int, platform: str, weight_bytes: int,
                      device_bytes: int | None) -> int:
    """``setting`` (``ModelSpec.fsdp_layers_per_gather``), or for None the automatic choice for a learner of
    ``devices`` devices of ``platform`` (``jax.Device.platform``) with ``device_bytes`` of memory each (None: not
    known), whose whole weights take ``weight_bytes`` in the compute dtype (module docstring)."""
    if setting is not None:
        return setting
    if devices < 2 or platform != "gpu" or device_bytes is None:
        return 0
    return AUTO_LAYERS_PER_GATHER if weight_bytes <= AUTO_MEMORY_SHARE * device_bytes else 0
