"""The optimizer's config (:class:`OptimConfig`): a leaf module, so the learner that reads it and the run config
that holds it both import it without importing each other."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jrl.validation import check_choice, check_int, check_real, invalid


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup + schedule, global-norm clipping and gradient accumulation."""

    learning_rate: float = 1e-5
    """Peak learning rate."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``learning_rate`` over this many optimizer steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate shape after warmup, decaying to 0 at ``max_steps`` for cosine/linear."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None = no clipping)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward pass; the step's ``prompts_per_batch x num_generations``
    sequences are split into micro-batches whose gradients are summed (None = one micro-batch)."""
    length_bucket: int = 0
    """GRPO-family updates: rows sorted by completion length, micro-batches taken in that order and each trimmed to
    a multiple of this many completion tokens that covers its longest row (e.g. 128), so the update computes little
    padding of short completions (one compiled program per width, at most ``max_new_tokens / length_bucket``); the
    loss and gradient are those of the padded rows. 0 = off (every row padded to ``max_new_tokens``). Not for the
    ``bnpo`` loss, whose value depends on which rows share a micro-batch; per-micro-batch metrics (clip ratios...)
    are averaged over micro-batches of other rows than without it."""
    packing: bool = False
    """GRPO-family updates: whole sequences (prompt and completion up to its last loss token) packed end to end into
    rows of the padded width with segment ids (attention stays inside a sequence, positions restart), so the update
    computes no padding; ``micro_batch_size`` then counts packed rows, each holding several sequences (rows of thousands
    of tokens want few: one needs the least memory, a few run a little faster). The LM head runs over the columns
    that predict a completion token only: the loss reaches it as ``loss_head`` says (on a GPU the loss-fused head, a
    packed row's sequences its chunk, split along its tokens past 8,192 scored columns), old and reference
    log-probs through the ``logprobs_impl`` kernel; the loss and gradient are the padded rows'. On Hopper or later
    GPUs the attention of packed rows runs on cuDNN's packed layout. Not with ``length_bucket``; not for the ``bnpo``
    loss (its value depends on which rows share a micro-batch: it runs padded); per-micro-batch metrics are averaged
    over other micro-batches than without it."""
    share_prompts: bool = False
    """With ``packing``: the sequences of one prompt (a GRPO group) in a packed row hold that prompt once (all but its
    last token), so the projections, MLPs and norms run over each prompt once instead of ``num_generations`` times;
    the attention still runs over every sequence whole (its prompt's keys and values gathered in front of it). The
    loss and gradient are the padded rows'. MoE router statistics (and the balance losses) count a shared prompt's
    tokens once."""
    grad_sync: Literal["auto", "micro_batch", "update"] = "auto"
    """On a mesh, when an update of several micro-batches combines the devices' gradients. ``micro_batch``: every
    micro-batch's gradient is reduced over the devices (with FSDP each micro-batch gathers every layer's weights,
    forward and backward, and reduce-scatters its gradient). ``update``: the weights are gathered whole once per
    update, each device sums its own rows' gradients over the micro-batches, and they are reduced once before the
    optimizer (no collective between micro-batches; a whole copy of the weights and a whole gradient per device,
    like ZeRO-2); it needs a mesh of ``data``/``fsdp`` axes, a dense model, a loss that sums over rows (not
    ``bnpo``, not ``top_entropy_quantile`` < 1) and micro-batches that split evenly over the devices. ``auto``:
    ``update`` for an update of several micro-batches on GPUs where the update can take it and the whole weights
    and gradient fit in a quarter of a device's memory, else ``micro_batch``. Per-micro-batch metrics are then per
    device and micro-batch. An update of one micro-batch runs as one program either way: ``update`` gathers the
    whole weights at its start and reduce-scatters at its end, none of it beside compute, so ``auto`` leaves it to
    the FSDP layers' own gathers (``ModelSpec.fsdp_layers_per_gather``; measured 0.948 of one GPU's speed per GPU
    against 0.894-0.918 on 2 H200s, ``benchmarks/RESULTS.md``)."""
    router_aux_loss_coef: float = 0.0
    """MoE models: weight of the load-balancing loss ``E · Σ_e load_e · prob_e`` (mean over the MoE layers; 1 when
    balanced) added to every update's loss; 0 = off (Qwen-MoE and Mixtral were pretrained with 0.001-0.02)."""
    router_z_loss_coef: float = 0.0
    """MoE models: weight of the router z-loss (mean ``logsumexp(router logits)²``) added to every update's loss;
    0 = off."""

    def __post_init__(self):
        check_real(self, "learning_rate", gt=0, fix="use a finite number > 0")
        check_real(self, "eps", gt=0, fix="use a finite number > 0")
        check_real(self, "b1", ge=0, lt=1, fix="use a number in [0, 1)")
        check_real(self, "b2", ge=0, lt=1, fix="use a number in [0, 1)")
        check_real(self, "weight_decay", ge=0, fix="use a number >= 0")
        check_int(self, "warmup_steps", lo=0)
        check_choice(self, "schedule", ("constant", "cosine", "linear"))
        check_real(self, "max_grad_norm", gt=0, optional=True, fix="use a number > 0, or None for no clipping")
        check_int(self, "micro_batch_size", lo=1, optional=True)
        check_int(self, "length_bucket", lo=0, fix="use 0 (off) or a token count such as 128")
        check_choice(self, "grad_sync", ("auto", "micro_batch", "update"))
        if self.packing and self.length_bucket:
            raise invalid("OptimConfig", "packing", self.packing, "packed rows hold no padding to trim; set "
                          "length_bucket=0 or packing=False")
        if self.share_prompts and not self.packing:
            raise invalid("OptimConfig", "share_prompts", self.share_prompts, "prompts are shared inside packed rows; "
                          "set packing=True or share_prompts=False")
        check_real(self, "router_aux_loss_coef", ge=0, fix="use a number >= 0 (0 = off)")
        check_real(self, "router_z_loss_coef", ge=0, fix="use a number >= 0 (0 = off)")
