"""The built-in arithmetic task: deterministic generation, correct answers, and its two rewards
checked against logic written independently here."""

import operator
import re

import pytest

from jrl.data.tasks import arithmetic as ar

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
EXPR = re.compile(r"^(-?\d+)([+\-*])\(?(-?\d+)\)?$")


def _evaluate(expr: str) -> int:
    a, op, b = EXPR.match(expr).groups()
    return OPS[op](int(a), int(b))


def test_deterministic_and_seeded():
    cfg = ar.ArithmeticConfig(num_examples=300, seed=3)
    a, b = ar.generate_arithmetic(cfg), ar.generate_arithmetic(cfg)
    assert a == b
    assert [ar.make_example(cfg, i) for i in (0, 17, 299)] == [a[0], a[17], a[299]]
    other = ar.generate_arithmetic(ar.ArithmeticConfig(num_examples=300, seed=4))
    assert other != a
    # pinned first examples: a change of the generator must be deliberate
    first = [r["expression"] for r in ar.generate_arithmetic(ar.ArithmeticConfig(num_examples=5))]
    assert first == ["3+6", "0-0", "8-7", "9-5", "7-0"]


@pytest.mark.parametrize(
    "cfg",
    [
        ar.ArithmeticConfig(num_examples=500),
        ar.ArithmeticConfig(num_examples=500, ops=("+", "-", "*"), min_operand=-5, max_operand=12, seed=9),
        ar.ArithmeticConfig(num_examples=500, ops=("-",), allow_negative=True, seed=1),
    ],
)
def test_answers_and_columns_correct(cfg):
    rows = ar.generate_arithmetic(cfg)
    assert len(rows) == cfg.num_examples
    ops_seen = set()
    for r in rows:
        assert set(r) == {"prompt", "answer", "solution", "expression"}
        a, op, b = EXPR.match(r["expression"]).groups()
        ops_seen.add(op)
        assert cfg.min_operand <= int(a) <= cfg.max_operand and cfg.min_operand <= int(b) <= cfg.max_operand
        assert r["answer"] == _evaluate(r["expression"])
        assert r["prompt"] == f"What is {r['expression']}?"
        assert r["solution"] == f"<answer>{r['answer']}</answer>"
        if op == "-" and not cfg.allow_negative:
            assert r["answer"] >= 0
    assert ops_seen == set(cfg.ops)  # every operator is drawn with 500 examples
    if cfg.allow_negative:
        assert any(r["answer"] < 0 for r in rows)


def test_prompt_template():
    rows = ar.generate_arithmetic(ar.ArithmeticConfig(num_examples=5, prompt_template="{expr}="))
    assert all(r["prompt"] == r["expression"] + "=" for r in rows)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_examples": 0}, "num_examples"),
        ({"min_operand": 5, "max_operand": 2}, "max_operand"),
        ({"ops": ("/",)}, "ops"),
        ({"ops": ()}, "ops"),
        ({"prompt_template": "What?"}, "prompt_template"),
    ],
)
def test_config_errors(kwargs, field):
    with pytest.raises(ValueError, match=f"ArithmeticConfig.{field}"):
        ar.ArithmeticConfig(**kwargs)


# completion, answer, expected exact_match, expected format (written by hand)
CASES = [
    ("<answer>12</answer>", 12, 1.0, 1.0),
    ("  <answer>12</answer>\n", 12, 1.0, 1.0),
    ("<answer> 12 </answer>", 12, 1.0, 0.0),
    ("<answer>13</answer>", 12, 0.0, 1.0),
    ("12", 12, 0.0, 0.0),
    ("", 12, 0.0, 0.0),
    ("<answer>12</answer> and more", 12, 1.0, 0.0),
    ("<answer>-3</answer>", -3, 1.0, 1.0),
    ("<answer>3</answer>", -3, 0.0, 1.0),
    ("<answer>12</answer><answer>13</answer>", 13, 0.0, 0.0),
    ("<answer>1 2</answer>", 12, 0.0, 0.0),
    ("<answer>12.0</answer>", 12, 0.0, 0.0),
    ("<answer>12", 12, 0.0, 0.0),
    ("<ANSWER>12</ANSWER>", 12, 0.0, 0.0),
    ("<answer>012</answer>", 12, 1.0, 1.0),
    ("<answer>12</answer>", "12", 1.0, 1.0),
    ("<answer>12</answer>", " 12 ", 1.0, 1.0),
]


def test_rewards_table():
    completions = [c for c, *_ in CASES]
    answers = [a for _, a, *_ in CASES]
    em = ar.exact_match(prompts=["p"] * len(CASES), completions=completions, completion_ids=None, answer=answers)
    fmt = ar.format_reward(prompts=["p"] * len(CASES), completions=completions, completion_ids=None, answer=answers)
    assert em == [e for *_, e, _ in CASES]
    assert fmt == [f for *_, f in CASES]


def test_rewards_on_chat_completions_and_solutions():
    rows = ar.generate_arithmetic(ar.ArithmeticConfig(num_examples=50, ops=("+", "-", "*")))
    chat = [[{"role": "assistant", "content": r["solution"]}] for r in rows]
    answers = [r["answer"] for r in rows]
    assert ar.exact_match([r["prompt"] for r in rows], chat, None, answer=answers) == [1.0] * 50
    assert ar.format_reward([r["prompt"] for r in rows], chat, None) == [1.0] * 50
    wrong = [f"<answer>{a + 1}</answer>" for a in answers]
    assert ar.exact_match(None, wrong, None, answer=answers) == [0.0] * 50


def test_reward_input_errors():
    with pytest.raises(ValueError, match="not an integer"):
        ar.exact_match(["p"], ["<answer>1</answer>"], None, answer=["one"])
    with pytest.raises(ValueError, match="2 answers for 1 completions"):
        ar.exact_match(["p"], ["x"], None, answer=[1, 2])
    with pytest.raises(TypeError, match="completion must be"):
        ar.format_reward(["p"], [42], None)
