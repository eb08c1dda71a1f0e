"""Reward functions: loading by import path or file path, running on a batch, and clear errors that
name the function and the batch."""

import functools
import textwrap

import numpy as np
import pytest

from jrl.rewards.functions import (
    RewardError,
    RewardFunction,
    RewardLoadError,
    RewardSpec,
    compute_rewards,
    load_reward_function,
    load_reward_functions,
    resolve_weights,
)

ARITH = "jrl.data.tasks.arithmetic"

REWARD_FILE = textwrap.dedent(
    """
    import math
    import os

    def pid(prompts, completions, completion_ids, **kwargs):
        return [float(os.getpid())] * len(completions)

    def length(prompts, completions, completion_ids, **kwargs):
        return [float(len(c)) for c in completions]

    def sometimes_none(prompts, completions, completion_ids, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    def echo_kwargs(prompts, completions, completion_ids, **kwargs):
        # checks what is passed: columns as keywords, never the prompt column
        assert "prompt" not in kwargs and "completions" not in kwargs
        return [float(k + len(ids)) for k, ids in zip(kwargs["k"], completion_ids)]

    def boom(prompts, completions, completion_ids, **kwargs):
        raise ZeroDivisionError("bad verifier")

    def short(prompts, completions, completion_ids, **kwargs):
        return [0.0] * (len(completions) - 1)

    def text(prompts, completions, completion_ids, **kwargs):
        return ["1.0"] * len(completions)

    def infinite(prompts, completions, completion_ids, **kwargs):
        return [math.inf] * len(completions)

    def scalar(prompts, completions, completion_ids, **kwargs):
        return 1.0

    class Holder:
        @staticmethod
        def method(prompts, completions, completion_ids, **kwargs):
            return [2.0] * len(completions)

    NOT_CALLABLE = 3
    """
)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return path


def _batch(n=4):
    completions = ["<answer>3</answer>", "<answer> 3 </answer>", "nope", "<answer>5</answer>"][:n]
    return dict(
        prompts=["What is 1+2?"] * n,
        completions=completions,
        completion_ids=[list(c.encode()) for c in completions],
        columns={"prompt": ["What is 1+2?"] * n, "answer": [3] * n, "k": list(range(n))},
    )


# ---------------------------------------------------------------------------------------------
# Loading


def test_load_by_module_and_file(reward_file):
    fns = load_reward_functions(
        [
            f"{ARITH}:exact_match",
            RewardSpec(f"{ARITH}:format_reward", weight=0.5),
            RewardSpec(f"{reward_file}:length", weight=-1.0, name="len"),
            f"{reward_file}:Holder.method",
        ]
    )
    assert [f.name for f in fns] == ["exact_match", "format_reward", "len", "method"]
    assert [f.weight for f in fns] == [1.0, 0.5, -1.0, 1.0]
    from jrl.data.tasks import arithmetic

    assert fns[0].fn is arithmetic.exact_match
    assert fns[2](prompts=["p"], completions=["abc"], completion_ids=[[1]]) == [3.0]
    # the same file loaded twice is one module
    assert load_reward_function(f"{reward_file}:length") is fns[2].fn
    np.testing.assert_array_equal(resolve_weights(fns, None), [1.0, 0.5, -1.0, 1.0])


def test_unknown_module_names_path():
    with pytest.raises(
        RewardLoadError, match=r"reward module 'no_such_pkg.rewards' \(from 'no_such_pkg.rewards:fn'\) not found"
    ):
        load_reward_functions(["no_such_pkg.rewards:fn"])
    with pytest.raises(RewardLoadError, match=r"'jrl.data.tasks.nope' \(from 'jrl.data.tasks.nope:f'\) not found"):
        load_reward_functions(["jrl.data.tasks.nope:f"])


def test_unknown_attribute_lists_callables():
    with pytest.raises(
        RewardLoadError, match=r"'exact' not found in 'jrl.data.tasks.arithmetic' .*exact_match.*format_reward"
    ):
        load_reward_functions([f"{ARITH}:exact"])


def test_file_errors(tmp_path, reward_file):
    with pytest.raises(RewardLoadError, match="reward file .*missing.py.* does not exist"):
        load_reward_functions([f"{tmp_path}/missing.py:f"])
    broken = tmp_path / "broken.py"
    broken.write_text("import definitely_not_installed_pkg\n")
    with pytest.raises(RewardLoadError, match="importing reward file .*broken.py.* failed: ModuleNotFoundError"):
        load_reward_functions([f"{broken}:f"])
    with pytest.raises(RewardLoadError, match="is a int, not a callable"):
        load_reward_functions([f"{reward_file}:NOT_CALLABLE"])


def test_spec_validation():
    with pytest.raises(ValueError, match="RewardSpec.path='jrl.data.tasks.arithmetic' is invalid"):
        RewardSpec(ARITH)
    with pytest.raises(ValueError, match="RewardSpec.weight=nan"):
        RewardSpec(f"{ARITH}:exact_match", weight=float("nan"))
    with pytest.raises(RewardLoadError, match="must look like"):
        load_reward_function("no_colon")
    with pytest.raises(TypeError, match="expected a RewardSpec"):
        load_reward_functions([42])


# ---------------------------------------------------------------------------------------------
# Computing


def test_compute_rewards_matrix(reward_file):
    fns = load_reward_functions(
        [
            f"{ARITH}:exact_match",
            f"{ARITH}:format_reward",
            f"{reward_file}:sometimes_none",
            f"{reward_file}:echo_kwargs",
        ]
    )
    b = _batch()
    rewards, names = compute_rewards(fns, [1.0, 0.5, 2.0, 0.0], **b, batch=3)
    assert names == ["exact_match", "format_reward", "sometimes_none", "echo_kwargs"]
    assert rewards.dtype == np.float32 and rewards.shape == (4, 4)
    expected = np.array(
        [
            [1, 1, 1, 0 + 18],
            [1, 0, np.nan, 1 + 20],
            [0, 0, 1, 2 + 4],
            [0, 1, np.nan, 3 + 18],
        ],
        dtype=np.float32,
    )
    np.testing.assert_array_equal(rewards, expected)


def test_plain_callables_arrays_and_duplicate_names():
    def r(prompts, completions, completion_ids, **kw):
        return np.arange(len(completions), dtype=np.float64)

    part = functools.partial(r)
    rewards, names = compute_rewards([r, part, lambda **kw: [True, False]], None, ["a", "b"], ["x", "y"], None, None)
    assert names == ["r", "r_1", "<lambda>"]
    np.testing.assert_array_equal(rewards, [[0, 0, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    "fn, match",
    [
        (
            "boom",
            r"reward function 'boom' \(.*my_rewards.py:boom\) raised ZeroDivisionError: bad verifier on batch 12 \(4 completions\)",
        ),
        ("short", r"reward function 'short' .* returned 3 values for 4 completions.* on batch 12"),
        ("text", r"reward function 'text' .* returned str \('1.0'\) at index 0; expected a number or None on batch 12"),
        ("infinite", r"reward function 'infinite' .* returned inf at index 0; rewards must be finite"),
        ("scalar", r"reward function 'scalar' .* returned float .*expected a list of 4 numbers"),
    ],
)
def test_function_errors_name_function_and_batch(reward_file, fn, match):
    fns = load_reward_functions([f"{ARITH}:format_reward", f"{reward_file}:{fn}"])
    with pytest.raises(RewardError, match=match) as info:
        compute_rewards(fns, None, **_batch(), batch=12)
    assert info.value.function == fn and info.value.batch == 12
    if fn == "boom":
        assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_error_without_batch_label(reward_file):
    fns = load_reward_functions([f"{reward_file}:short"])
    with pytest.raises(RewardError, match=r"on a batch of 4 completions"):
        compute_rewards(fns, None, **_batch())


def test_input_errors():
    fns = load_reward_functions([f"{ARITH}:exact_match"])
    b = _batch()
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 4 completions"):
        compute_rewards(fns, None, b["prompts"], b["completions"], b["completion_ids"], {"answer": [3]})
    with pytest.raises(ValueError, match="3 prompts for 4 completions"):
        compute_rewards(fns, None, b["prompts"][:3], b["completions"], None, b["columns"])
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        compute_rewards(fns, [1.0, 2.0], **b)
    with pytest.raises(ValueError, match="weight inf of reward function 'exact_match'"):
        compute_rewards(fns, [float("inf")], **b)
    with pytest.raises(ValueError, match="no reward functions"):
        compute_rewards([], None, **b)
    # a reward function's own complaint about its column is reported with its name
    with pytest.raises(
        RewardError, match="reward function 'exact_match' .* raised ValueError: answer column value 'x'"
    ):
        compute_rewards(fns, None, b["prompts"], b["completions"], None, {"answer": ["x"] * 4})


def test_reward_function_pickles_by_path(reward_file):
    import pickle

    (fn,) = load_reward_functions([RewardSpec(f"{reward_file}:length", weight=2.0, name="L")])
    back = pickle.loads(pickle.dumps(fn))
    assert (back.name, back.weight, back.path) == ("L", 2.0, fn.path)
    assert back(prompts=None, completions=["ab"], completion_ids=None) == [2.0]
    assert isinstance(back, RewardFunction)


def test_spec_from_the_command_line_form():
    assert RewardSpec.parse("my.py:fn=0.5") == RewardSpec("my.py:fn", 0.5)
    assert RewardSpec.parse("pkg.mod:fn") == RewardSpec("pkg.mod:fn", 1.0)
    assert RewardSpec.parse(RewardSpec("a.py:f", -2.0).format()) == RewardSpec("a.py:f", -2.0)
    with pytest.raises(ValueError, match=r"reward 'a.py:f=x': the weight after '=' must be a number"):
        RewardSpec.parse("a.py:f=x")
    with pytest.raises(ValueError, match="RewardSpec.path='nocolon' is invalid"):
        RewardSpec.parse("nocolon=1")


def test_end_to_end_with_prompt_batches():
    """The contract with jrl.data: a PromptBatch repeated per completion feeds the rewards."""
    from jrl.data import DataConfig, load_byte_tokenizer, make_prompt_loader
    from jrl.data.tasks.arithmetic import DEFAULT_REWARDS, ArithmeticConfig

    loader = make_prompt_loader(
        DataConfig(prompts_per_batch=3, arithmetic=ArithmeticConfig(num_examples=30)), load_byte_tokenizer()
    )
    g = 2
    batch = next(loader).repeat(g)
    # first completion of each group is the reference solution, the second is wrong and malformed
    completions = [
        s if i % g == 0 else f"{a + 1}"
        for i, (s, a) in enumerate(zip(batch.columns["solution"], batch.columns["answer"]))
    ]
    fns = load_reward_functions(DEFAULT_REWARDS)
    rewards, names = compute_rewards(
        fns, None, batch.prompts, completions, [list(c.encode()) for c in completions], batch.columns, batch=0
    )
    assert names == ["exact_match", "format_reward"]
    np.testing.assert_array_equal(rewards, [[1, 1], [0, 0]] * 3)
