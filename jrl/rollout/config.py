"""The ``rollout`` section of a training config: which engine generates, how weights reach it, how
completions are sampled and how far generation may run ahead of training."""

from __future__ import annotations

import dataclasses

from jrl.rollout.base import ROLLOUT_ENGINES, SamplingParams
from jrl.rollout.kv_config import KVCacheConfig
from jrl.rollout.vllm_config import VLLMConfig
from jrl.rollout.weight_sync import AUTO, WEIGHT_TRANSPORTS
from jrl.sharding.mesh import MeshConfig
from jrl.validation import check_int, invalid


#: What partial rollouts' carried rows continue from (``RolloutConfig.partial_kv``).
PARTIAL_KV = ("keep", "recompute")

#: Share of a device's memory the sampler's whole-model copy may take: above it the default layout shards the copy.
SAMPLER_COPY_FRACTION = 0.4


def _default_sampler_mesh() -> MeshConfig:
    return MeshConfig(data=-1, fsdp=1)


def sampler_mesh(mesh: MeshConfig, *, weight_bytes: int, device_bytes: int | None, devices: int) -> MeshConfig:
    """The layout the sampler decodes with on ``devices`` devices: ``mesh`` as configured, except that the default
    layout (whole weights on every device) becomes tensor-parallel over the fewest devices, a power of two dividing
    ``devices``, whose share of the ``weight_bytes`` (in the compute dtype) takes at most
    :data:`SAMPLER_COPY_FRACTION` of ``device_bytes`` (data-parallel over the rest). Without a memory size (CPU
    devices report none) the default stays."""
    if mesh != _default_sampler_mesh() or not device_bytes:
        return mesh
    tensor = 1
    while weight_bytes / tensor > SAMPLER_COPY_FRACTION * device_bytes and devices % (2 * tensor) == 0:
        tensor *= 2
    return mesh if tensor == 1 else dataclasses.replace(mesh, tensor=tensor)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How completions are generated."""

    backend: str = "jax"
    """Rollout engine (a ``ROLLOUT_ENGINES`` name): ``jax`` (the embedded sampler with a KV cache) or
    ``vllm`` (an external vLLM server, configured by ``vllm``)."""
    sync: str = "auto"
    """How trained weights reach a ``vllm`` server (a ``WEIGHT_TRANSPORTS`` name): ``lora`` (export the PEFT
    adapter and hot-load it), ``filesystem`` (write the whole checkpoint and reload it in place),
    ``shared_memory`` (the same through ``/dev/shm``), ``async_filesystem`` (the write and reload run in the
    background while training goes on), ``auto`` (``lora`` for a LoRA run, else ``filesystem``). The
    ``jax`` backend shares the weights in memory and takes only ``auto``."""
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)
    """Server address, timeouts, retries and launch flags of the ``vllm`` backend."""
    devices: int = 0
    """Devices that only generate (``jax`` backend): 0 = the sampler runs on the learner's devices and the two take
    turns; N > 0 = the last N / process_count devices of every process generate, the learner keeps the rest (the
    top-level ``mesh`` lays them out), and with ``prefetch_depth > 0`` generation runs while the learner trains."""
    mesh: MeshConfig = dataclasses.field(default_factory=_default_sampler_mesh)
    """How the sampler lays out its devices (the learner's with ``devices = 0``, its own otherwise); the weights are
    copied into this layout (a reshard on the learner's devices when a generation starts, a device-to-device copy
    to devices of its own at each sync) unless it is the learner's own. Default: every device holds the whole model
    in the compute dtype and decodes its share of the rows (``data = -1``), the fastest while the weights take a
    small part of a device's memory; where they would take more than 40% of it the default becomes
    tensor-parallel over the fewest devices that hold them so (:func:`sampler_mesh`). Set ``tensor`` yourself
    (e.g. ``data=-1, fsdp=1, tensor=4``), or the learner's own layout to decode from its FSDP shards without a copy
    (every layer's weights gathered at every token: slowest)."""
    kv: KVCacheConfig = dataclasses.field(default_factory=KVCacheConfig)
    """The ``jax`` sampler's KV cache: ``dense`` (default) or ``paged`` with continuous batching (page size, decode
    slots, pool size)."""
    partial: bool = False
    """Partial rollouts (``backend='jax'`` with ``kv.layout='paged'``, GRPO): a step's generation ends once
    ``data.prompts_per_batch`` groups are finished; the rows still running keep their tokens and go on in the next
    step's generation under the newer weights (each token keeps the log-prob and version it was sampled with; a row
    with tokens more than ``max_staleness`` versions old starts again). Saves the wait for a step's longest rows
    (:mod:`jrl.sources.partial`)."""
    partial_kv: str = "keep"
    """What a carried row of partial rollouts continues from: ``keep`` (default), the keys and values (and the
    next-token logits) its earlier generations computed, copied out of the pool when a generation ends and placed in
    the next one's; ``recompute``, its prompt and tokens prefilled again under the newest weights. Keeping saves the
    prefill of every carried row each step; the earlier tokens' keys and values then come from the weights that
    sampled them, and the recorded log-probs stay those of the distribution each token was drawn from, so the
    importance correction is unchanged. The generation after a checkpoint step recomputes (a resumed run has no
    kept pages), so resuming from a scheduled checkpoint stays exact."""
    max_new_tokens: int = 16
    """Most tokens per completion; also the padded completion length of the train step."""
    temperature: float = 1.0
    """Sampling temperature; the loss scores tokens at the same temperature (the only place it is set)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens; the tokenizer's EOS always stops."""
    sync_interval: int = 1
    """Training steps between weight syncs to the rollout engine (1 = after every step); checkpoint
    steps always sync, so a resumed run samples like the uninterrupted one."""
    prefetch_depth: int = 0
    """Rollout batches generated in a background thread ahead of the trainer (0 = synchronous:
    generate, then train). 1 overlaps generating step k + 1 with training step k."""
    max_staleness: int = 1
    """Largest lag, in policy versions (training steps), between the weights that generated a batch
    and the weights it trains; generation waits when it would be exceeded. Must be >=
    ``sync_interval - 1``; the background thread runs ``min(prefetch_depth, max_staleness -
    sync_interval + 1)`` steps ahead (0 makes a prefetching run exactly the synchronous one)."""

    @property
    def run_ahead(self) -> int:
        """Training steps by which generation runs ahead of the trainer (0 when synchronous)."""
        return min(self.prefetch_depth, self.max_staleness - self.sync_interval + 1)

    def sampling_params(self, eos_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The sampling parameters of this section, stopping at ``eos_ids`` and ``stop_token_ids``."""
        stops = tuple(dict.fromkeys(tuple(eos_ids) + tuple(self.stop_token_ids)))
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, stop_token_ids=stops)

    def __post_init__(self):
        self.sampling_params()  # validates the sampling fields
        if self.backend not in ROLLOUT_ENGINES:
            raise invalid("RolloutConfig", "backend", self.backend, f"use one of {ROLLOUT_ENGINES.names()}")
        if self.sync != AUTO and self.sync not in WEIGHT_TRANSPORTS:
            raise invalid("RolloutConfig", "sync", self.sync,
                          f"use one of {(AUTO,) + WEIGHT_TRANSPORTS.names()} ('full' is now 'filesystem')")
        check_int(self, "sync_interval", lo=1, fix="use an int >= 1 (1 = sync after every step)")
        check_int(self, "prefetch_depth", lo=0)
        check_int(self, "devices", lo=0, fix="use 0 (sample on the learner's devices) or a device count")
        check_int(self, "max_staleness", lo=0)
        if self.partial_kv not in PARTIAL_KV:
            raise invalid("RolloutConfig", "partial_kv", self.partial_kv, f"use one of {PARTIAL_KV}")
        if self.max_staleness < self.sync_interval - 1:
            raise invalid("RolloutConfig", "max_staleness", self.max_staleness,
                          f"with sync_interval={self.sync_interval} the sampler's weights are up to "
                          f"{self.sync_interval - 1} steps old between syncs; use max_staleness >= "
                          f"{self.sync_interval - 1} or a smaller sync_interval")
