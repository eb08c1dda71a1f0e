"""Grouped-query attention under a structured mask: see :mod:`jrl.kernels.attention.api`."""

from jrl.kernels.attention.api import (DENSE_MAX_SCORES, attention, available_impls, decode_attention,
                                      decode_attention_append, paged_decode_attention,
                                      paged_decode_attention_append)
from jrl.kernels.attention.mask import AttentionMask
from jrl.kernels.attention.paged_reference import stored_as

__all__ = ["DENSE_MAX_SCORES", "AttentionMask", "attention", "available_impls", "decode_attention",
           "decode_attention_append", "paged_decode_attention", "paged_decode_attention_append", "stored_as"]
