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
faster and run 5-18% slower).

``None`` takes it on a GPU where a device's share of the training state and the whole weights together take at most
:data:`AUTO_GROUPS_SHARE` of its memory (the allocator's limit), leaving the rest to activations and temporaries: the
8B step on 2 H200s at 8 x 1024 tokens per GPU peaked at 58.0 GiB per layer and 70.5 GiB in groups, of which its state
took 44.9 GiB and the whole weights ~12.5 GiB more. Elsewhere (a CPU, a TPU, where it was not measured, or a model
too large) each layer is gathered in its checkpoint. The first form of this rule looked at the whole weights alone
(at most a quarter of the memory): it picked the groups for a 7.6B model trained in full on two 80 GB GPUs (15.2 GB
of bf16 weights under a quarter of the ~64 GB limit), whose state (45.7 GB per device) and whole weights leave ~3 GB
for activations (arithmetic, not run).
"""

from __future__ import annotations

#: Layers gathered at once under ``fsdp_layers_per_gather=None`` where they fit (module docstring).
AUTO_LAYERS_PER_GATHER = 2
#: Share of a device's memory that its share of the training state and the whole weights may take for
#: ``fsdp_layers_per_gather=None`` to gather layers in groups (module docstring).
AUTO_GROUPS_SHARE = 0.5


def training_state_bytes(params: int, param_itemsize: int, *, full: bool) -> int:
    """Bytes of a model's training state for ``params`` parameters stored ``param_itemsize`` bytes each: the weights,
    and when trained in ``full`` their gradients and two float32 optimizer moments (LoRA's own are left out)."""
    return params * (2 * param_itemsize + 8 if full else param_itemsize)


def layers_per_gather(setting: int | None, *, devices: int, platform: str, weight_bytes: int, state_bytes: int,
                      device_bytes: int | None) -> int:
    """``setting`` (``ModelSpec.fsdp_layers_per_gather``), or for None the automatic choice for a learner of
    ``devices`` devices of ``platform`` (``jax.Device.platform``) with ``device_bytes`` of memory each (None: not
    known), whose whole weights take ``weight_bytes`` in the compute dtype and whose training state
    (:func:`training_state_bytes`), split over the devices, ``state_bytes`` (module docstring)."""
    if setting is not None:
        return setting
    if devices < 2 or platform != "gpu" or device_bytes is None:
        return 0
    fits = state_bytes / devices + weight_bytes <= AUTO_GROUPS_SHARE * device_bytes
    return AUTO_LAYERS_PER_GATHER if fits else 0
