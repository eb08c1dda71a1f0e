"""Expert parallelism with a capacity (``ModelConfig.expert_capacity``): routing spread over the devices fits the
buffer and gives what one device gives; routing that overflows it gives what one device gives without the rows the
buffer drops (each device's last rows in expert order); without a capacity every row runs, also in chunks
(``ModelConfig.expert_chunks``). Float32, forward and every gradient (workers/expert_capacity.py, 8 fake CPU
devices)."""

from __future__ import annotations

import pytest

RTOL = 1e-5  # float32


@pytest.fixture(scope="module")
def result(helpers):
    return helpers.run_worker("expert_capacity.py", num_devices=8)


def test_the_buffer_is_smaller_than_every_row_slot_and_only_the_skewed_routing_overflows_it(result):
    rows = result["rows"]
    assert rows is not None and rows < result["slots"], result
    assert result["max_device_rows"]["spread"] <= rows < result["max_device_rows"]["skewed"], result


@pytest.mark.parametrize("case", ["spread/2.0", "spread/0.0", "skewed/2.0", "skewed/0.0", "spread/chunks4",
                                  "skewed/chunks4"])
def test_expert_parallel_block_matches_one_device(result, case):
    errs = result["cases"][case]
    assert errs["finite"], errs
    assert max(errs["y"], errs["loss"], errs["dx"], errs["dweights"], errs["dparams"]) <= RTOL, errs


def test_chunks_that_do_not_divide_a_devices_tokens_are_refused_with_the_field(result):
    assert "ModelConfig.expert_chunks=3 does not divide a device's 16 tokens" in result.get("chunks_error", ""), result


def test_only_the_overflowing_routing_drops_rows_and_the_block_reports_their_share(result):
    # skewed/2.0: 32 rows of each of the two token groups
    assert result["dropped"] == {"spread/2.0": 0, "spread/0.0": 0, "skewed/2.0": 64, "skewed/0.0": 0}, result
    slots = result["slots"] * 2  # the two token groups' rows
    want = {case: pytest.approx(count / slots, rel=1e-6) for case, count in result["dropped"].items()}
    assert result["dropped_share"] == want, result  # float32


def test_only_a_capacity_builds_the_capped_program(result):
    assert result["capped_buffer"] == {"2.0": True, "0.0": False}, result


def test_a_moe_block_reports_the_dropped_share_in_its_router_statistics(result):
    """A block whose router sends every token to the first experts (as the skewed routing): ``moe/dropped_rows`` is
    the share the buffer drops, 0 without a capacity."""
    assert result["block_dropped"] == {"2.0": pytest.approx(1 / 6, rel=1e-6), "0.0": 0.0}, result


def test_a_step_that_drops_more_than_a_percent_of_the_rows_warns_with_the_fix(caplog):
    import logging

    from jrl.train.trainer import DROPPED_ROWS_WARNING, warn_dropped_rows

    with caplog.at_level(logging.WARNING, logger="jrl.train.trainer"):
        assert not warn_dropped_rows({"loss": 1.0}, 3, 0.0)  # a dense model: no such metric
        assert not warn_dropped_rows({"moe/dropped_rows": DROPPED_ROWS_WARNING}, 4, 1.25)
        assert warn_dropped_rows({"moe/dropped_rows": 0.032}, 5, 1.25)
    [message] = [r.getMessage() for r in caplog.records]
    assert "at step 5" in message and "model.expert_capacity=1.25 dropped 3.2%" in message
    assert "set it to 0 (dropless" in message
