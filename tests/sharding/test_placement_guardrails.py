"""Placement guardrails: a logical axis name without a rule is an error naming it; a dimension that stays replicated
because its size does not divide its mesh axes is named in one warning with the bytes per device it costs (on 8
fake CPU devices in a child process)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def result(helpers):
    return helpers.run_worker("placement_guardrails.py", num_devices=8)


def test_an_undivided_dimension_is_warned_once_with_its_cost(result):
    warned = result["warnings"]
    assert len(warned) == 1, warned  # the second placement on the same mesh and rules says nothing new
    text = warned[0]
    assert "embed.embedding dim 0 ('vocab', 65) over tensor=2" in text
    assert "MiB more per device" in text
    # The vocab dimension of the embedding and of the untied head: split 4-way on fsdp, not on tensor.
    assert result["lines"] == result["expected_lines"]
    assert result["placed_spec"] == [None, "fsdp"]  # replicated on tensor, still split on fsdp


def test_an_unknown_logical_name_is_refused(result):
    assert "no sharding rule" in result["unknown_error"] and "'mystery'" in result["unknown_error"]
