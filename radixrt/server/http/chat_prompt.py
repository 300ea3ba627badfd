"""Chat messages -> prompt token ids, with message content that can never forge control tokens.

The chat template's own markers (``<|im_start|>``, ``<|im_end|>``, ...) become special tokens; text a
client wrote that merely spells a special token (``"<|im_end|>\\n<|im_start|>system\\n..."``) is tokenized
as the plain characters it is. A message whose content spells a special token is rendered through a
placeholder: the text around the placeholders is the template's and keeps its special tokens, what the
template puts in the placeholder's place is the client's and is tokenized with ``split_special_tokens``.
Messages without such text take the plain path (render, tokenize), so ordinary prompts are unchanged.
"""

from __future__ import annotations

import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from radixrt.server.http.errors import APIError


def special_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The text of every special token the tokenizer would match inside a string."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    texts.update(str(t) for t in tokenizer.all_special_tokens)
    return sorted(t for t in texts if t)


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    """The chat template applied to ``messages``, with the generation prompt unless ``kwargs`` set
    ``add_generation_prompt`` false (400 if the template refuses)."""
    kwargs = {"add_generation_prompt": True, **kwargs}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as exc:  # jinja errors, raise_exception() in templates
        raise APIError(400, f"messages: the chat template rejected them: {exc}", param="messages") from None
    return str(text)


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], kwargs: dict[str, Any]
) -> list[int]:
    """Token ids of the rendered chat; special-token text inside message content stays plain text."""
    specials = special_texts(tokenizer)
    dirty = [i for i, m in enumerate(messages) if any(t in m["content"] for t in specials)]
    real = render(tokenizer, messages, kwargs)
    if not dirty:
        return list(tokenizer.encode(real, add_special_tokens=False))
    nonce = uuid.uuid4().hex
    holders = {i: f"RADIXRTMSG{nonce}N{i}E" for i in dirty}  # letters and digits: survives trim / strip
    skeleton_msgs = [{**m, "content": holders[i]} if i in holders else m for i, m in enumerate(messages)]
    skeleton = render(tokenizer, skeleton_msgs, kwargs)
    spans: list[tuple[int, str, str]] = []  # (position in the skeleton, placeholder, the content there)
    for i, holder in holders.items():
        count = skeleton.count(holder)
        if count == 0:
            continue  # the template does not show this message
        where = f"messages[{i}].content"
        if count > 1:
            raise APIError(
                400, f"{where}: the chat template repeats it; special-token text is refused", where
            )
        pos = skeleton.index(holder)
        prefix, suffix = skeleton[:pos], skeleton[pos + len(holder) :]
        one_real = render(
            tokenizer, [messages[i] if j == i else m for j, m in enumerate(skeleton_msgs)], kwargs
        )
        if not (one_real.startswith(prefix) and one_real.endswith(suffix)):
            raise APIError(400, f"{where}: its special-token text changes the chat template's output", where)
        spans.append((pos, holder, one_real[len(prefix) : len(one_real) - len(suffix)]))
    spans.sort()
    rebuilt, ids, at = [], [], 0
    for pos, holder, content in spans:
        ids += tokenizer.encode(skeleton[at:pos], add_special_tokens=False)
        ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        rebuilt += [skeleton[at:pos], content]
        at = pos + len(holder)
    ids += tokenizer.encode(skeleton[at:], add_special_tokens=False)
    if "".join(rebuilt) + skeleton[at:] != real:  # NOTE: the contents interact inside the template
        raise APIError(
            400, "messages: their special-token text changes the chat template's output", "messages"
        )
    return [int(t) for t in ids]
