"""The frozen feature network of EBFT (docs/algorithms/ebft.md §2, §3): hidden states of a few layers, no gradient.

With LoRA the feature network is the policy's own base weights with the adapters switched off
(:func:`jrl.models.lora.lora_disabled`; no copy). With full fine-tuning the caller passes a model
holding a frozen copy of the initial weights. Either way the outputs are wrapped in
``stop_gradient``, so nothing differentiates through the feature forward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import jax

from jrl.models.lora import lora_disabled


def feature_layer_indices(fractions: Sequence[float], num_layers: int) -> tuple[int, ...]:
    """⌊f · num_layers⌋ for each depth fraction f: an index into the L + 1 hidden-state tuple (0 = the
    embedding output, num_layers = the final, normed hidden state). 32 layers and (0.25, 0.5, 0.75)
    give (8, 16, 24)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} is invalid: use the model's num_hidden_layers (an int >= 1)")
    out = []
    for f in fractions:
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"feature layer fraction {f!r} is invalid: use a number in [0, 1] "
                             "(0 = embeddings, 1 = final hidden state)")
        out.append(int(math.floor(f * num_layers)))
    if not out:
        raise ValueError("feature layer fractions are empty: give at least one, e.g. (0.25, 0.5, 0.75)")
    return tuple(out)


def feature_layers(model, input_ids: jax.Array, *, layers: Sequence[int], disable_lora: bool = True,
                   **forward_kwargs) -> tuple[jax.Array, ...]:
    """Hidden states [B, S, D] of ``model`` at the hidden-state indices ``layers``, without gradient.

    ``forward_kwargs`` go to ``model.hidden_states`` (``attention_mask``, ``positions``, ``segment_ids``,
    or an explicit ``mask``). With ``disable_lora`` and adapters on the model, they are switched off
    for this forward (the base weights are the feature network).
    """
    with lora_disabled(model) if disable_lora else contextlib.nullcontext():
        _, selected = model.hidden_states(input_ids, return_layers=tuple(int(i) for i in layers), **forward_kwargs)
    return tuple(jax.lax.stop_gradient(h) for h in selected)
