"""The strided EBFT trainer (ebft.md §9): raw documents, many short generated blocks per document.

Per step:

1. the next batch of ``data.prompts_per_batch`` records becomes documents (:func:`build_documents`):
   with a ``ebft.gt_column`` column (the built-in arithmetic task's ``solution``) a document is the
   rendered prompt followed by that text and EOS, and its anchors start in the completion
   (``a_0 = max(c, prompt_len + min_completion_prefix)``); without one it is the prompt column's text
   alone (``a_0 = c``), e.g. ``DataConfig(prompt_column="text", use_chat_template=False)`` on a file.
   Documents are right-padded to a multiple of :data:`DOC_PAD_MULTIPLE` tokens;
2. :func:`jrl.rollout.strided_sampler.generate_blocks` samples ``n_samples_per_prompt`` rows per
   document, each with all ``J`` blocks (block-parallel, seed derived from ``(seed, step)``);
3. the frozen feature network (:func:`jrl.models.features.feature_layers`; the base weights with LoRA,
   a copy of the initial weights otherwise) runs over the generated rows and over one ground-truth row
   per document (the blocks filled with ``x[a_j, a_j + g)``), all under the strided mask; each block's
   tokens are pooled into its embedding (``last_token`` = the block's last token);
4. over the valid blocks, :func:`jrl.losses.ebft.feature_rewards` on groups ``[docs·blocks, n, E]``, then
   :func:`jrl.losses.ebft.ebft_advantages` (default ``rloo``), broadcast to the block's tokens;
5. one optimizer step on ``rl_coef · REINFORCE + ce_coef · CE`` (CE: next-token loss on the documents'
   ground-truth tokens, the completion only for structured documents), by micro-batches of rows whose
   gradients are summed with step-global normalisers (the update does not depend on the split);
6. ``metrics.jsonl`` / TensorBoard, the progress bar (``align ↑ cfm ↓ reward ↑``), checkpoints and resume
   as in the GRPO trainer.

Blocks are sampled at ``ebft.temperature`` / ``ebft.top_p`` and ``rollout.top_k``, and the REINFORCE
log-probs are taken at ``ebft.temperature``; the GRPO-only fields of the config (``algo``, ``rewards``,
the rest of ``rollout``, ``num_iterations``) are not used. ``sampling/logp_diff`` logs the mean
|trainer − sampler| log-prob of the sampled tokens (≈0: the sampler uses the training mask's rule).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.kernels.logprobs import token_logprobs
from jrl.losses.ebft import cross_entropy_loss, ebft_advantages, embed_layers, feature_rewards, reinforce_loss
from jrl.models import strided as st
from jrl.models.features import feature_layer_indices, feature_layers
from jrl.rollout.base import SamplingParams
from jrl.rollout.strided_sampler import generate_blocks
from jrl.train.config import OptimConfig, TrainConfig
from jrl.train.ebft_config import EBFTConfig
from jrl.train.grpo import step_seed
from jrl.train.loop import TrainLoop
from jrl.train.step import TrainableState

logger = logging.getLogger(__name__)

#: Documents are right-padded to a multiple of this many tokens, bounding recompiles.
DOC_PAD_MULTIPLE = 16

#: Metrics shown on the progress bar, with the direction they should move.
PROGRESS = (("align↑", "ebft/alignment"), ("cfm↓", "ebft/cfm_loss"), ("reward↑", "ebft/reward"))


# ------------------------------------------------------------------------------------------ documents
class Documents(NamedTuple):
    """A batch of right-padded documents."""

    ids: np.ndarray
    """[B, S] int32 token ids, padding after each document."""
    lengths: np.ndarray
    """[B] int32 real tokens per document (``S_valid``)."""
    prompt_lengths: np.ndarray | None
    """[B] int32 prompt tokens of structured documents (None for plain documents)."""


def build_documents(prompt_ids: list[list[int]], completions: list[list[int]] | None, *, pad_id: int,
                    multiple_of: int = DOC_PAD_MULTIPLE) -> Documents:
    """Documents ``prompt + completion`` (structured) or ``prompt`` alone (``completions`` None),
    right-padded to a multiple of ``multiple_of``."""
    docs = [list(p) + list(c) for p, c in zip(prompt_ids, completions)] if completions is not None \
        else [list(p) for p in prompt_ids]
    lengths = np.array([len(d) for d in docs], np.int32)
    seq_len = -(-int(lengths.max()) // multiple_of) * multiple_of
    ids = np.full((len(docs), seq_len), pad_id, np.int32)
    for r, d in enumerate(docs):
        ids[r, :len(d)] = d
    prompt_lengths = None if completions is None else np.array([len(p) for p in prompt_ids], np.int32)
    return Documents(ids, lengths, prompt_lengths)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Anchors of a document batch (host arrays)."""

    anchors: np.ndarray
    """[B, J] int32 anchor of every block."""
    valid: np.ndarray
    """[B, J] bool, ``a_j + g <= S_valid``."""


def document_layout(docs: Documents, ebft: EBFTConfig) -> Layout:
    """Anchors and validity of every block; ``J`` is the most blocks any document of the batch fits."""
    c, s, g = ebft.context_length, ebft.stride, ebft.generate_max_len
    b, seq_len = docs.ids.shape
    if docs.prompt_lengths is None:
        first = st.first_anchors(c, batch=b)
    else:
        first = st.first_anchors(c, prompt_lengths=docs.prompt_lengths,
                                 min_completion_prefix=ebft.min_completion_prefix)
    first = np.asarray(first)
    num = max(st.num_blocks(seq_len, int(a), s, g) for a in first)
    anchors = np.asarray(st.anchors(first, num, s))
    valid = np.asarray(st.block_valid(anchors, docs.lengths, g))
    if not valid.any():
        raise ValueError(
            f"no document of this batch (longest {int(docs.lengths.max())} tokens) has room for one block: a block "
            f"needs a_0 + generate_max_len <= length, with a_0 = context_length={c} (plain documents) or "
            f"prompt_len + min_completion_prefix={ebft.min_completion_prefix} (structured); use longer documents "
            "or smaller EBFTConfig.context_length / generate_max_len / min_completion_prefix")
    return Layout(anchors, valid)


def ce_token_mask(docs: Documents) -> np.ndarray:
    """[B, S] float32: the document tokens the cross-entropy term predicts (index >= 1, before the
    padding, and for structured documents inside the completion)."""
    idx = np.arange(docs.ids.shape[1])[None]
    start = 1 if docs.prompt_lengths is None else np.maximum(docs.prompt_lengths, 1)[:, None]
    return ((idx >= start) & (idx < docs.lengths[:, None])).astype(np.float32)


# ------------------------------------------------------------------------------------------ learner
class StridedBatch(NamedTuple):
    """The arrays of one step's policy update: ``N = B·n`` packed rows (document | J blocks of g tokens)."""

    input_ids: np.ndarray
    """[N, S + J·g] int32 packed rows."""
    anchors: np.ndarray
    """[N, J] int32."""
    block_mask: np.ndarray
    """[N, J·g] float32, 1 on the tokens of valid blocks."""
    advantages: np.ndarray
    """[N, J·g] float32, each block's advantage broadcast to its tokens."""
    ce_mask: np.ndarray
    """[N, S] float32 ground-truth document tokens of the cross-entropy term (:func:`ce_token_mask`)."""
    sampler_logprobs: np.ndarray
    """[N, J·g] float32 log-probs the sampler reported."""

    def rows(self, sl: slice) -> StridedBatch:
        return StridedBatch(*(x[sl] for x in self))


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static settings of the jitted feature and loss functions."""

    context_length: int
    generate_len: int
    temperature: float
    rl_coef: float
    ce_coef: float
    impl: str
    layers: tuple[int, ...]
    embed_method: str
    per_layer_norm: bool
    concat_span: str


def _packed_inputs(model, ids, anchors, spec: _Spec):
    """(seq_len S, positions, strided mask) of packed rows ``ids`` [N, S + J·g]."""
    seq_len = ids.shape[1] - anchors.shape[1] * spec.generate_len
    _, _, positions, _ = st.packed_roles(seq_len, anchors, spec.generate_len)
    mask = st.strided_mask(seq_len, anchors, spec.context_length, spec.generate_len,
                           sliding_window=model.config.sliding_window)
    return seq_len, positions, mask


def block_logprobs(model, ids, anchors, spec: _Spec):
    """log π [N, J·g] of the block tokens of packed rows at the sampling temperature (and the final hidden
    states [N, S + J·g, H] they came from)."""
    seq_len, positions, mask = _packed_inputs(model, ids, anchors, spec)
    hidden = model.hidden_states(ids, positions=positions, mask=mask)
    n = ids.shape[0]
    pred = st.prediction_indices(seq_len, anchors, spec.generate_len).reshape(n, -1)
    h = jnp.take_along_axis(hidden, pred[..., None], axis=1)
    lp, _ = token_logprobs(h.reshape(-1, h.shape[-1]), model.lm_head_weight(), ids[:, seq_len:].reshape(-1),
                           temperature=spec.temperature, impl=spec.impl)
    return lp.reshape(n, -1), hidden


def strided_loss(model, batch: StridedBatch, normalizers, spec: _Spec):
    """(``rl_coef · REINFORCE + ce_coef · CE``, metrics) of a micro-batch; ``normalizers`` = (valid block
    tokens, CE tokens) of the whole step, so the micro-batch losses sum to the step's loss."""
    lp, hidden = block_logprobs(model, batch.input_ids, batch.anchors, spec)
    seq_len = batch.ce_mask.shape[1]
    m = batch.block_mask
    share = jnp.sum(m) / jnp.maximum(1.0, normalizers[0])
    rl = reinforce_loss(lp, batch.advantages, m) * share
    n = batch.input_ids.shape[0]
    doc_hidden = hidden[:, :seq_len - 1]
    if spec.ce_coef == 0.0:
        doc_hidden = jax.lax.stop_gradient(doc_hidden)  # logged only: no backward pass through it
    lp_doc, _ = token_logprobs(doc_hidden.reshape(-1, doc_hidden.shape[-1]), model.lm_head_weight(),
                               batch.input_ids[:, 1:seq_len].reshape(-1), impl=spec.impl)
    cm = batch.ce_mask[:, 1:]
    ce = cross_entropy_loss(lp_doc.reshape(n, seq_len - 1), cm) * jnp.sum(cm) / jnp.maximum(1.0, normalizers[1])
    loss = spec.rl_coef * rl + (spec.ce_coef * ce if spec.ce_coef else 0.0)
    diff = jnp.sum(jnp.abs(jax.lax.stop_gradient(lp) - batch.sampler_logprobs) * m) / jnp.maximum(1.0, normalizers[0])
    return loss, {"ebft/rl_loss": rl, "ebft/ce_loss": ce, "sampling/logp_diff": diff}


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnums=0)
def _micro(acc, params, frozen, batch, normalizers, *, graphdef, spec):
    def loss_fn(p):
        return strided_loss(nnx.merge(graphdef, p, frozen), batch, normalizers, spec)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(jnp.add, acc, grads), loss, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _block_features(params, frozen, ids, anchors, *, graphdef, spec: _Spec):
    """Block embeddings [N, J, E] of packed rows under the strided mask, from the feature network (LoRA
    adapters off). Each block's g tokens are pooled by ``spec.embed_method``."""
    model = nnx.merge(graphdef, params, frozen)
    seq_len, positions, mask = _packed_inputs(model, ids, anchors, spec)
    layers = feature_layers(model, ids, layers=spec.layers, positions=positions, mask=mask)
    n, num, g = ids.shape[0], anchors.shape[1], spec.generate_len
    blocks = [h[:, seq_len:].reshape(n * num, g, h.shape[-1]) for h in layers]
    emb = embed_layers(blocks, jnp.ones((n * num, g), jnp.int32), spec.embed_method, per_layer_norm=spec.per_layer_norm,
                       prompt_lengths=jnp.zeros((n * num,), jnp.int32), concat_span=spec.concat_span)
    return emb.reshape(n, num, -1)


class StridedLearner(TrainableState):
    """The trainable state of a strided EBFT run, its frozen feature network and the update."""

    rows_phrase = "the step has {n} rows (documents x n_samples_per_prompt)"

    def __init__(self, model: nnx.Module, ebft: EBFTConfig, optim: OptimConfig, *, total_updates: int,
                 logprobs_impl: str = "auto", mesh=None, rules=None):
        super().__init__(model, optim, total_updates=total_updates, mesh=mesh, rules=rules)
        self.ebft = ebft
        self.spec = _Spec(context_length=ebft.context_length, generate_len=ebft.generate_max_len,
                          temperature=float(ebft.temperature), rl_coef=float(ebft.rl_coef),
                          ce_coef=float(ebft.ce_coef), impl=logprobs_impl,
                          layers=feature_layer_indices(ebft.feature_layers, model.config.num_hidden_layers),
                          embed_method=ebft.embed_method, per_layer_norm=ebft.per_layer_norm,
                          concat_span=ebft.concat_span)
        # Full fine-tune: the feature network is a frozen copy of the initial weights; with LoRA it is the
        # base weights with the adapters switched off (no copy).
        self.feature_params = None if self.lora else jax.tree.map(jnp.copy, self.params)

    def features(self, ids: np.ndarray, anchors: np.ndarray) -> np.ndarray:
        """Block embeddings [N, J, E] of packed rows (no gradient)."""
        params = self.params if self.feature_params is None else self.feature_params
        return np.asarray(_block_features(params, self.frozen, self._put(ids), self._put(anchors),
                                          graphdef=self.graphdef, spec=self.spec))

    def accumulate_gradients(self, batch: StridedBatch):
        """(summed gradient of the step loss over the micro-batches, summed metrics: loss, the loss terms
        and ``sampling/logp_diff``, the mean |trainer − sampler| log-prob over the valid block tokens)."""
        norms = jnp.asarray([np.sum(batch.block_mask), np.sum(batch.ce_mask[:, 1:])], jnp.float32)
        acc = self.zero_gradients()
        totals: dict[str, float] = {"loss": 0.0}
        for sl in self._micro_slices(batch.input_ids.shape[0]):
            part = StridedBatch(*(self._put(x) for x in batch.rows(sl)))
            acc, loss, metrics = _micro(acc, self.params, self.frozen, part, norms, graphdef=self.graphdef,
                                        spec=self.spec)
            totals["loss"] += float(loss)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return acc, totals

    def update(self, batch: StridedBatch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns the metrics of :meth:`accumulate_gradients` plus
        ``grad_norm`` and ``learning_rate``."""
        acc, totals = self.accumulate_gradients(batch)
        totals["learning_rate"] = float(self.schedule(self.num_updates))
        totals["grad_norm"] = float(self.apply_gradients(acc))
        return totals


# ------------------------------------------------------------------------------------------ trainer
def block_rewards(gen_emb: np.ndarray, gt_emb: np.ndarray, valid: np.ndarray, ebft: EBFTConfig):
    """(advantages [B, n, J] (0 on invalid blocks), metrics) from block embeddings ``gen_emb`` [B, n, J, E]
    and ``gt_emb`` [B, J, E]: rewards on the groups of valid blocks ``[G, n, E]``, then advantages."""
    docs, blocks = np.nonzero(valid)
    gen = np.transpose(gen_emb, (0, 2, 1, 3))[docs, blocks]  # [G, n, E]
    rewards, metrics = feature_rewards(gen, gt_emb[docs, blocks], alignment_coef=ebft.alignment_coef,
                                       diversity_coef=ebft.diversity_coef, use_whitening=ebft.use_whitening,
                                       whitening_scope=ebft.whitening_scope, whitening_ridge=ebft.whitening_ridge)
    adv = np.asarray(ebft_advantages(rewards, ebft.estimator))
    full = np.zeros(gen_emb.shape[:3], np.float32)
    full[docs, :, blocks] = adv
    out = {k: float(v) for k, v in metrics.items()}
    out["ebft/advantages_std"] = float(np.std(adv))
    out["ebft/num_blocks"] = float(len(docs)) / valid.shape[0]
    return full, out


class EBFTStridedTrainer(TrainLoop):
    """Builds everything a :class:`TrainConfig` with ``ebft.mode == "strided"`` names and runs the loop."""

    progress_desc = "ebft-strided"
    plot_keys = tuple(key for _, key in PROGRESS) + ("loss",)

    def __init__(self, cfg: TrainConfig, *, progress: bool = True):
        if cfg.ebft is None or cfg.ebft.mode != "strided":
            raise ValueError("EBFTStridedTrainer needs TrainConfig.ebft with mode='strided'")
        self.ebft = cfg.ebft
        super().__init__(cfg, progress=progress)
        self.sampling = SamplingParams(temperature=self.ebft.temperature, top_p=self.ebft.top_p,
                                       top_k=cfg.rollout.top_k)
        self._structured: bool | None = None

    def build_learner(self, model) -> StridedLearner:
        cfg = self.cfg
        return StridedLearner(model, self.ebft, cfg.optim, total_updates=cfg.max_steps,
                              logprobs_impl=cfg.logprobs_impl, mesh=self.mesh, rules=self.rules)

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {label: f"{metrics[key]:+.3f}" for label, key in PROGRESS}

    def log_summary(self, metrics: dict[str, float]) -> str:
        return " ".join(f"{label} {metrics[key]:+.4f}" for label, key in PROGRESS)

    # ------------------------------------------------------------------ pieces
    def documents(self, prompt_batch) -> Documents:
        """The batch's documents: prompt + ``gt_column`` text + EOS when the data has that column, else
        the prompt alone."""
        column = self.ebft.gt_column
        structured = column in prompt_batch.columns
        if self._structured is None:
            self._structured = structured
            logger.info("strided EBFT on %s documents", f"structured (prompt + {column!r})" if structured else
                        f"plain (no {column!r} column: the prompt column's text)")
        completions = None
        if structured:
            eos = [] if self.tokenizer.eos_token_id is None else [int(self.tokenizer.eos_token_id)]
            texts = [str(t) for t in prompt_batch.columns[column]]
            completions = [list(ids) + eos for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return build_documents(prompt_batch.prompt_ids, completions, pad_id=self.pad_id)

    def train_step(self) -> dict[str, float]:
        """One batch of documents: sample, score, update; returns the step's metrics."""
        e, n, g = self.ebft, self.ebft.n_samples_per_prompt, self.ebft.generate_max_len
        docs = self.documents(next(self.loader))
        layout = document_layout(docs, e)
        b, num = layout.anchors.shape
        t0 = time.perf_counter()
        samples = generate_blocks(self.learner.model, docs.ids, layout.anchors, context_length=e.context_length,
                                  generate_len=g, num_samples=n, params=self.sampling,
                                  seed=step_seed(self.cfg.seed, self.step))
        t1 = time.perf_counter()
        rows = np.repeat(docs.ids, n, axis=0)
        row_anchors = np.repeat(layout.anchors, n, axis=0)
        gen_ids = np.asarray(st.pack(rows, samples.tokens.reshape(b * n, num, g)))
        gt_ids = np.asarray(st.pack(docs.ids, st.ground_truth_blocks(docs.ids, layout.anchors, g)))
        emb = self.learner.features(np.concatenate([gen_ids, gt_ids]), np.concatenate([row_anchors, layout.anchors]))
        adv, metrics = block_rewards(emb[:b * n].reshape(b, n, num, -1), emb[b * n:], layout.valid, e)
        t2 = time.perf_counter()
        tokens = np.repeat(layout.valid[:, None, :, None], n, axis=1) * np.ones((1, 1, 1, g), bool)
        batch = StridedBatch(
            input_ids=gen_ids, anchors=row_anchors,
            block_mask=tokens.reshape(b * n, num * g).astype(np.float32),
            advantages=np.repeat(adv[..., None], g, axis=-1).reshape(b * n, num * g).astype(np.float32),
            ce_mask=np.repeat(ce_token_mask(docs), n, axis=0),
            sampler_logprobs=samples.logprobs.reshape(b * n, num * g))
        metrics.update(self.learner.update(batch))
        t3 = time.perf_counter()
        self.step += 1
        metrics["time/rollout"] = t1 - t0
        metrics["time/reward"] = t2 - t1
        metrics["time/train"] = t3 - t2
        metrics["tokens_per_second"] = float(batch.block_mask.sum()) / max(t3 - t0, 1e-9)
        return metrics
