"""EBFT strided mode: raw documents, many short generated blocks per document
(docs/algorithms/ebft.md §9).

Per step:

1. the batch of ``data.prompts_per_batch`` records becomes documents (:func:`build_documents`): with a
   ``ebft.gt_column`` column (the built-in arithmetic task's ``solution``) a document is the rendered prompt
   followed by that text and EOS, and its anchors start in the completion
   (``a_0 = max(c, prompt_len + min_completion_prefix)``); without one it is the prompt column's text alone
   (``a_0 = c``), e.g. ``DataConfig(prompt_column="text", use_chat_template=False)`` on a file. Documents are
   right-padded to a multiple of :data:`DOC_PAD_MULTIPLE` tokens;
2. the embedded engine (``rollout.backend='jax'``) samples ``n_samples_per_prompt`` rows per document, each
   with all ``J`` blocks (block-parallel, :func:`jrl.rollout.strided_sampler.generate_blocks`) at the
   ``rollout`` section's temperature, top-p and top-k;
3. the frozen feature network (the base weights with LoRA, a copy of the initial weights otherwise) runs
   over the generated rows and over one ground-truth row per document (the blocks filled with
   ``x[a_j, a_j + g)``), all under the strided mask; each block's tokens are pooled into its embedding;
4. over the valid blocks, :func:`jrl.losses.feature_rewards` on groups ``[docs·blocks, n, E]``, then
   :func:`jrl.losses.ebft_advantages` (default ``rloo``), broadcast to the block's tokens;
5. one optimizer step on ``rl_coef · REINFORCE + ce_coef · CE`` (CE: next-token loss on the documents'
   ground-truth tokens, the completion only for structured documents), by micro-batches of rows whose
   gradients are summed with step-global normalisers (the update does not depend on the split).

``sampling/logp_diff`` logs the mean |trainer − sampler| log-prob of the sampled tokens (≈0: the sampler
uses the training mask's rule).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl.losses.ebft import cross_entropy_loss, ebft_advantages, embed_layers, feature_rewards, reinforce_loss
from jrl.models import strided as st
from jrl.models.features import feature_layer_indices, feature_layers
from jrl.rollout.base import SamplingParams
from jrl.train.algorithms.base import ALGORITHMS
from jrl.train.algorithms.ebft_structured import ebft_progress_postfix
from jrl.train.ebft_config import EBFTConfig
from jrl.train.learner import LossTerm, reduce_metrics

logger = logging.getLogger(__name__)

#: Documents are right-padded to a multiple of this many tokens, bounding recompiles.
DOC_PAD_MULTIPLE = 16

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


# ------------------------------------------------------------------------------------------ loss
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
class StridedGeometry:
    """Block geometry of the strided mask: context window and block length."""

    context_length: int
    generate_len: int

    def packed_inputs(self, model, ids, anchors):
        """(seq_len S, positions, strided mask) of packed rows ``ids`` [N, S + J·g]."""
        seq_len = ids.shape[1] - anchors.shape[1] * self.generate_len
        _, _, positions, _ = st.packed_roles(seq_len, anchors, self.generate_len)
        mask = st.strided_mask(seq_len, anchors, self.context_length, self.generate_len,
                               sliding_window=model.config.sliding_window)
        return seq_len, positions, mask


def block_logprobs(model, ids, anchors, geometry: StridedGeometry, *, temperature: float, impl: str):
    """log π [N, J·g] of the block tokens of packed rows at the sampling temperature (and the final hidden
    states [N, S + J·g, H] they came from)."""
    seq_len, positions, mask = geometry.packed_inputs(model, ids, anchors)
    hidden = model.hidden_states(ids, positions=positions, mask=mask)
    n = ids.shape[0]
    pred = st.prediction_indices(seq_len, anchors, geometry.generate_len).reshape(n, -1)
    h = jnp.take_along_axis(hidden, pred[..., None], axis=1)
    lp, _ = model.token_logprobs(h, ids[:, seq_len:], temperature=temperature, impl=impl)
    return lp, hidden


@dataclasses.dataclass(frozen=True)
class StridedLoss:
    """``rl_coef · REINFORCE + ce_coef · CE`` of a micro-batch and its metrics; ``aux`` = (valid block
    tokens, CE tokens) of the whole step, so the micro-batch losses sum to the step's loss."""

    geometry: StridedGeometry
    temperature: float
    rl_coef: float
    ce_coef: float
    impl: str

    def __call__(self, model, batch: StridedBatch, normalizers):
        lp, hidden = block_logprobs(model, batch.input_ids, batch.anchors, self.geometry,
                                    temperature=self.temperature, impl=self.impl)
        seq_len = batch.ce_mask.shape[1]
        m = batch.block_mask
        share = jnp.sum(m) / jnp.maximum(1.0, normalizers[0])
        rl = reinforce_loss(lp, batch.advantages, m) * share
        doc_hidden = hidden[:, :seq_len - 1]
        if self.ce_coef == 0.0:
            doc_hidden = jax.lax.stop_gradient(doc_hidden)  # logged only: no backward pass through it
        lp_doc, _ = model.token_logprobs(doc_hidden, batch.input_ids[:, 1:seq_len], impl=self.impl)
        cm = batch.ce_mask[:, 1:]
        ce = cross_entropy_loss(lp_doc, cm) * jnp.sum(cm) / jnp.maximum(1.0, normalizers[1])
        loss = self.rl_coef * rl + (self.ce_coef * ce if self.ce_coef else 0.0)
        diff = jnp.sum(jnp.abs(jax.lax.stop_gradient(lp) - batch.sampler_logprobs) * m) / jnp.maximum(1.0, normalizers[0])
        return loss, {"ebft/rl_loss": rl, "ebft/ce_loss": ce, "sampling/logp_diff": diff}


@dataclasses.dataclass(frozen=True)
class BlockFeatures:
    """``model, (ids, anchors) -> [N, J, E]``: block embeddings of packed rows under the strided mask, each
    block's g tokens pooled by ``embed_method``."""

    geometry: StridedGeometry
    layers: tuple[int, ...]
    embed_method: str
    per_layer_norm: bool
    concat_span: str

    def __call__(self, model, rows, aux=None):
        ids, anchors = rows
        seq_len, positions, mask = self.geometry.packed_inputs(model, ids, anchors)
        layers = feature_layers(model, ids, layers=self.layers, disable_lora=False, positions=positions, mask=mask)
        n, num, g = ids.shape[0], anchors.shape[1], self.geometry.generate_len
        blocks = [h[:, seq_len:].reshape(n * num, g, h.shape[-1]) for h in layers]
        emb = embed_layers(blocks, jnp.ones((n * num, g), jnp.int32), self.embed_method,
                           per_layer_norm=self.per_layer_norm, prompt_lengths=jnp.zeros((n * num,), jnp.int32),
                           concat_span=self.concat_span)
        return emb.reshape(n, num, -1)


class BlockRollout(NamedTuple):
    """The documents of a step and their sampled blocks."""

    docs: Documents
    layout: Layout
    tokens: np.ndarray
    """[B·n, J, g] int32 sampled block tokens."""
    logprobs: np.ndarray
    """[B·n, J, g] float32 sampler log-probs."""
    policy_version: int


# ------------------------------------------------------------------------------------------ algorithm
def block_rewards(gen_emb: np.ndarray, gt_emb: np.ndarray, valid: np.ndarray, ebft: EBFTConfig):
    """(advantages [B, n, J] (0 on invalid blocks), metrics) from block embeddings ``gen_emb`` [B, n, J, E]
    and ``gt_emb`` [B, J, E]: rewards on the groups of valid blocks ``[G, n, E]``, then advantages."""
    docs, blocks = np.nonzero(valid)
    gen = np.transpose(gen_emb, (0, 2, 1, 3))[docs, blocks]  # [G, n, E]
    rewards, metrics = feature_rewards(gen, gt_emb[docs, blocks], alignment_coef=ebft.alignment_coef,
                                       diversity_coef=ebft.diversity_coef, use_whitening=ebft.use_whitening,
                                       whitening_scope=ebft.whitening_scope, whitening_ridge=ebft.whitening_ridge)
    adv = np.asarray(ebft_advantages(rewards, ebft.estimator("rloo")))
    full = np.zeros(gen_emb.shape[:3], np.float32)
    full[docs, :, blocks] = adv
    out = {k: float(v) for k, v in metrics.items()}
    out["ebft/advantages_std"] = float(np.std(adv))
    out["ebft/num_blocks"] = float(len(docs)) / valid.shape[0]
    return full, out



#: The metrics a step's log line names (the progress bar's: :func:`ebft_structured.ebft_progress_postfix`).
PROGRESS = (("align", "ebft/alignment"), ("cfm", "ebft/cfm_loss"), ("reward", "ebft/reward"))


@ALGORITHMS.register("ebft_strided")
class EBFTStrided:
    """Strided EBFT (see the module docstring)."""

    config_type = None
    sections = ("ebft",)

    ignores = ("rewards", "env", "scoring", "replay", "reroll", "eval_every", "eval", "num_iterations",
               "docs_per_step", "loss_head", "rollout.backend", "rollout.sync", "rollout.vllm", "rollout.max_new_tokens",
               "rollout.stop_token_ids",
               "rollout.sync_interval", "rollout.prefetch_depth", "rollout.max_staleness", "ebft.adaptive_max_tokens",
               "ebft.gt_length_multiplier", "ebft.adaptive_min_tokens")
    progress_desc = "ebft-strided"
    plot_keys = tuple(key for _, key in PROGRESS) + ("loss",)
    summary_keys = tuple(key for _, key in PROGRESS)
    capabilities = frozenset()
    engine_needs = frozenset({"blocks"})  # block-parallel sampling: engine.generate_blocks
    samples_field = "ebft.n_samples_per_prompt"

    @staticmethod
    def check_config(cfg) -> None:
        """Nothing beyond the ``ebft`` section's own checks: strided EBFT has no ``algo`` section."""

    def __init__(self, cfg, policy, learner):
        e = self.ebft = cfg.ebft
        self.tokenizer, self.pad_id = policy.tokenizer, policy.pad_id
        r = cfg.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        geometry = StridedGeometry(e.context_length, e.generate_max_len)
        self.loss = StridedLoss(geometry, float(r.temperature), float(e.rl_coef), float(e.ce_coef), cfg.logprobs_impl)
        self.features = BlockFeatures(
            geometry, feature_layer_indices(e.feature_layers, learner.model.config.num_hidden_layers),
            e.embed_method, e.per_layer_norm, e.concat_span)
        # Full fine-tune: the feature network is a frozen copy of the initial weights; with LoRA it is the
        # base weights with the adapters switched off (no copy).
        self.feature_params = None if learner.lora else learner.snapshot()
        self._structured: bool | None = None

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

    def generate(self, engine, prompt_batch, *, step: int, seed: int) -> BlockRollout:
        e = self.ebft
        docs = self.documents(prompt_batch)
        layout = document_layout(docs, e)
        samples, version = engine.generate_blocks(docs.ids, layout.anchors, context_length=e.context_length,
                                                  generate_len=e.generate_max_len,
                                                  num_samples=e.n_samples_per_prompt, params=self.sampling, seed=seed)
        return BlockRollout(docs, layout, samples.tokens, samples.logprobs, version)

    def make_experience(self, rollout: BlockRollout, prompt_batch, learner, step: int):
        e, n, g = self.ebft, self.ebft.n_samples_per_prompt, self.ebft.generate_max_len
        docs, layout = rollout.docs, rollout.layout
        b, num = layout.anchors.shape
        rows = np.repeat(docs.ids, n, axis=0)
        row_anchors = np.repeat(layout.anchors, n, axis=0)
        gen_ids = np.asarray(st.pack(rows, rollout.tokens.reshape(b * n, num, g)))
        gt_ids = np.asarray(st.pack(docs.ids, st.ground_truth_blocks(docs.ids, layout.anchors, g)))
        emb = learner.evaluate(self.features, (np.concatenate([gen_ids, gt_ids]),
                                               np.concatenate([row_anchors, layout.anchors])),
                               params=self.feature_params, disable_lora=learner.lora)
        adv, metrics = block_rewards(emb[:b * n].reshape(b, n, num, -1), emb[b * n:], layout.valid, e)
        tokens = np.repeat(layout.valid[:, None, :, None], n, axis=1) * np.ones((1, 1, 1, g), bool)
        batch = StridedBatch(
            input_ids=gen_ids, anchors=row_anchors,
            block_mask=tokens.reshape(b * n, num * g).astype(np.float32),
            advantages=np.repeat(adv[..., None], g, axis=-1).reshape(b * n, num * g).astype(np.float32),
            ce_mask=np.repeat(ce_token_mask(docs), n, axis=0),
            sampler_logprobs=rollout.logprobs.reshape(b * n, num * g))
        return batch, metrics

    def loss_term(self, learner, batch: StridedBatch) -> LossTerm:
        """The step's loss term with its global normalisers (valid block tokens, CE tokens)."""
        learner.micro_slices(batch.input_ids.shape[0])  # the rows must split evenly
        norms = np.asarray([np.sum(batch.block_mask), np.sum(batch.ce_mask[:, 1:])], np.float32)
        return LossTerm(self.loss, batch, norms)

    def update(self, learner, batch: StridedBatch) -> dict[str, float]:
        collected, _ = learner.step([self.loss_term(learner, batch)])
        return reduce_metrics([collected], lambda name: "sum")

    def generated_tokens(self, rollout: BlockRollout) -> int:
        n, g = self.ebft.n_samples_per_prompt, self.ebft.generate_max_len
        return int(rollout.layout.valid.sum()) * n * g

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return ebft_progress_postfix(metrics)

    def log_summary(self, metrics: dict[str, float]) -> str:
        return " ".join(f"{label} {metrics[key]:+.4f}" for label, key in PROGRESS)

    def close(self) -> None:
        """Nothing to release: the feature-matching reward runs in the train step's process."""
