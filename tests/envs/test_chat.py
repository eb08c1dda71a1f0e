"""Observations as chat-template messages (jrl.envs.chat): the text put around an observation is what the template
renders between the model's end-of-turn token and the next assistant turn, so a whole episode (prompt, model
turns ending in their stop token, wrapped observations) reads exactly as the template renders the conversation;
a role the template refuses is an error naming env.observation_role."""

from __future__ import annotations

import pytest

from jrl.data.tokenizer import load_byte_tokenizer
from jrl.envs.chat import observation_encoder, observation_format

#: A ChatML template as Qwen's instruct models use (system/user/assistant/tool), with the byte tokenizer's EOS as
#: <|im_end|>'s stand-in: the end-of-turn token the model writes.
CHATML = ("{%- for m in messages -%}{{- '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ eos_token ~ '\\n' -}}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def _episode_text(tokenizer, role: str, turns: list[str], observations: list[str]) -> str:
    """The text of an episode as the runner builds it: the rendered prompt, then each model turn (ending in the
    stop token) and each wrapped observation."""
    before, after = observation_format(tokenizer, role)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7+5?"}], tokenize=False,
                                           add_generation_prompt=True)
    text = prompt
    for k, turn in enumerate(turns):
        text += turn + tokenizer.eos_token
        if k < len(observations):
            text += before + observations[k] + after
    return text


@pytest.mark.parametrize("template, role", [(None, "user"), (CHATML, "tool"), (CHATML, "user")])
def test_an_episode_reads_as_the_template_renders_the_conversation(template, role):
    tokenizer = load_byte_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    turns, observations = ["<answer>11</answer>", "<answer>13</answer>", "<answer>12</answer>"], [" higher", " lower"]
    messages = [{"role": "user", "content": "What is 7+5?"}]
    for k, turn in enumerate(turns):
        messages.append({"role": "assistant", "content": turn})
        if k < len(observations):
            messages.append({"role": role, "content": observations[k]})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    episode = _episode_text(tokenizer, role, turns, observations)
    assert rendered.startswith(episode) and rendered[len(episode):] in ("", "\n")  # up to the last turn's own tail
    encode = observation_encoder(tokenizer, role)
    before, after = observation_format(tokenizer, role)
    assert tokenizer.decode(encode(" higher")) == before + " higher" + after


def test_the_chatml_pieces_and_the_plain_text():
    tokenizer = load_byte_tokenizer()
    tokenizer.chat_template = CHATML
    after = f"{tokenizer.eos_token}\n<|im_start|>assistant\n"
    assert observation_format(tokenizer, "tool") == ("\n<|im_start|>tool\n", after)
    assert observation_encoder(tokenizer, None)(" higher") == tokenizer.encode(" higher", add_special_tokens=False)


def test_a_role_the_template_refuses_is_named():
    with pytest.raises(ValueError, match=r"EnvConfig\.observation_role='tool'.*unknown role tool"):
        observation_format(load_byte_tokenizer(), "tool")
