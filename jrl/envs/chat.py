"""Observations as chat-template messages: what a tokenizer's chat template writes between the end of an assistant
turn and the start of the next one, around a message of a given role (``env.observation_role``).

The model's turn ends with the token it stops at (the template's end-of-turn token, the tokenizer's EOS); the
observation then has to read exactly as the template would render the conversation, so a model trained with its
template sees, and is trained on, the same text it is served with: for a ChatML template and role ``tool``,
``"\\n<|im_start|>tool\\n" + text + "<|im_end|>\\n<|im_start|>assistant\\n"``. The two pieces are read off the template
once (:func:`observation_format`) by rendering a conversation with and without a marked message.
"""

from __future__ import annotations

from collections.abc import Callable

_MARK = "\u2063jrl-observation\u2063"
_ANSWER = "\u2063jrl-answer\u2063"


def observation_format(tokenizer, role: str) -> tuple[str, str]:
    """(before, after): the text the chat template of ``tokenizer`` puts before and after the content of a ``role``
    message that follows an assistant turn, from the end of that turn's end-of-turn token to the next assistant
    turn's generation prompt; a ``ValueError`` naming ``env.observation_role`` when the template cannot."""
    base = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _ANSWER}]
    try:
        without = tokenizer.apply_chat_template(base, tokenize=False)
        with_obs = tokenizer.apply_chat_template(base + [{"role": role, "content": _MARK}], tokenize=False,
                                                 add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the template's own error, named for the config field
        raise ValueError(f"EnvConfig.observation_role={role!r}: the tokenizer's chat template cannot render a "
                         f"{role!r} message after an assistant turn ({type(e).__name__}: {e}); use a role it "
                         "accepts, or None for the observation's text as is") from e
    if not with_obs.startswith(without) or _MARK not in with_obs or _ANSWER not in without:
        raise ValueError(f"EnvConfig.observation_role={role!r}: the tokenizer's chat template renders a conversation "
                         "differently once a message follows the assistant turn, so an observation cannot be appended "
                         "to the tokens generated; use None for the observation's text as is")
    tail = without[without.rindex(_ANSWER) + len(_ANSWER):]
    eos = tokenizer.eos_token or ""
    if eos and tail.startswith(eos):  # the model writes its end-of-turn token itself
        tail = tail[len(eos):]
    before, after = with_obs[len(without):].split(_MARK)
    return tail + before, after


def observation_encoder(tokenizer, role: str | None) -> Callable[[str], list[int]]:
    """``text -> token ids`` of an observation: as is (``role`` None) or as a ``role`` message of the tokenizer's chat
    template (:func:`observation_format`)."""
    if role is None:
        return lambda text: tokenizer.encode(text, add_special_tokens=False)
    before, after = observation_format(tokenizer, role)
    return lambda text: tokenizer.encode(before + text + after, add_special_tokens=False)
