"""Chat template rendering and the assistant loss mask: the target's own template, any model.

API (used by `dart_train.data.dataset` and `dart_train.data.regenerate`):

- `tokenize_conversation(tokenizer, conversation, max_length, *, template_kwargs=None)
  -> list[{"input_ids": LongTensor[T], "loss_mask": BoolTensor[T]}]`
  The tokenizer's own chat template renders the conversation; `loss_mask` is True exactly on the
  tokens the assistant produced (its content and its end-of-turn token, e.g. `<|im_end|>`; never
  role headers, the generation prompt, nor the newline the template writes after the turn).
  Usually ONE sequence; several when the template rewrites history (see "Loss-mask rule").
- `check_chat_template(tokenizer)`: raises `ChatTemplateError` unless the tokenizer has a chat
  template and is fast (the loss mask needs token character offsets). Base models without a template
  get one from `model.chat_template` (`dart_infer.data.loaders.load_tokenizer`: a built-in such as
  `gemma-turns` or `plain`, a .jinja file, a Jinja string), the same setting serving loads.

Loss-mask rule (works for any template, no per-model registry):
for assistant turn i, P_i = template(messages[:i], add_generation_prompt=True) and
A_i = template(messages[:i+1]); A_i must start with P_i, and the turn's trained text is
A_i[len(P_i):] without trailing whitespace. Turn i joins the current sequence when A_i starts with
that sequence's text (the history is rendered exactly as the model saw it when it produced turn i);
otherwise a new sequence A_i starts. Templates that keep history (SmolLM2, Llama 3, ChatML) give one
sequence per conversation. Qwen3-style templates drop the `<think>` block of earlier turns (and, with
`enable_thinking=False`, render the empty think block only in the generation prompt), so a later turn
rewrites history: such a conversation yields one sequence per rewritten turn, and every assistant
token is trained in the context in which the model actually generated it. Pass template options
(`{"enable_thinking": False}`) through `template_kwargs`. A turn whose generation prompt is not a
prefix of its rendering cannot be located: it is left out of the mask and counted. An assistant
turn before any user message (ShareGPT has chunks that start mid-conversation) answers nothing the
model would ever be asked: it stays as context, untrained, and is counted.

Truncation keeps the first `max_length` tokens; a sequence with no assistant token left is dropped
and counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


class ChatTemplateError(ValueError):
    """The tokenizer cannot render conversations in a way the loss mask can be computed from."""


def _messages_of(conversation: Any) -> list[dict[str, str]]:
    messages = conversation.messages if hasattr(conversation, "messages") else conversation.get("messages")
    if not isinstance(messages, list):
        raise TypeError(f"expected a Conversation or a dict with 'messages', got {type(conversation).__name__}")
    return messages


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool, kwargs: Mapping) -> str:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )
    if not isinstance(text, str):  # batched input is never passed here; guard against API drift
        raise ChatTemplateError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def check_chat_template(tokenizer: Any) -> None:
    """Raise `ChatTemplateError` unless the tokenizer has a chat template and fast offsets."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; training data "
            "and its loss mask are rendered with the target's chat template. For a base model without one, "
            "set model.chat_template=gemma-turns|plain|<file.jinja> (a built-in name, a .jinja file or a "
            "Jinja string; serving takes the same setting), or use the instruct/chat variant of the model."
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError("The loss mask needs a fast (Rust) tokenizer: token character offsets are used.")


@dataclass
class _Segment:
    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)  # character spans of trained text


@dataclass
class TemplateStats:
    """Counters of what rendering left out (summed over a dataset)."""

    turns: int = 0
    turns_without_prompt: int = 0  # assistant speaks before any user message: nothing it answers
    unlocatable_turns: int = 0  # generation prompt is not a prefix of the rendered turn
    rewritten_histories: int = 0  # extra sequences because a later turn re-rendered the history

    def add(self, other: TemplateStats) -> None:
        self.turns += other.turns
        self.turns_without_prompt += other.turns_without_prompt
        self.unlocatable_turns += other.unlocatable_turns
        self.rewritten_histories += other.rewritten_histories


def render_segments(
    tokenizer: Any,
    conversation: Any,
    *,
    template_kwargs: Mapping | None = None,
    stats: TemplateStats | None = None,
) -> list[_Segment]:
    """Texts to train on and the character spans of assistant output in them (see module doc)."""
    check_chat_template(tokenizer)
    kwargs = dict(template_kwargs or {})
    messages = _messages_of(conversation)
    stats = stats if stats is not None else TemplateStats()
    segments: list[_Segment] = []
    current: _Segment | None = None
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        stats.turns += 1
        if not any(m.get("role") == "user" for m in messages[:i]):
            stats.turns_without_prompt += 1
            continue
        prompt = _render(tokenizer, messages[:i], True, kwargs)
        rendered = _render(tokenizer, messages[: i + 1], False, kwargs)
        if not rendered.startswith(prompt):
            stats.unlocatable_turns += 1
            continue
        body = rendered[len(prompt) :].rstrip()
        if not body:
            continue
        span = (len(prompt), len(prompt) + len(body))
        if current is not None and rendered.startswith(current.text):
            current.text = rendered
            current.spans.append(span)
        else:
            if current is not None:
                stats.rewritten_histories += 1
                segments.append(current)
            current = _Segment(rendered, [span])
    if current is not None:
        segments.append(current)
    return segments


def tokenize_conversation(
    tokenizer: Any,
    conversation: Any,
    max_length: int,
    *,
    template_kwargs: Mapping | None = None,
    stats: TemplateStats | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Token ids + assistant loss mask of a conversation; usually one sequence (see module doc).

    Sequences are truncated to `max_length` tokens; those left without any assistant token are dropped.
    An empty list means the conversation has nothing to train on (no assistant turn).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    out = []
    for segment in render_segments(tokenizer, conversation, template_kwargs=template_kwargs, stats=stats):
        encoded = tokenizer(segment.text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        offsets = encoded["offset_mapping"]
        mask = [False] * len(ids)
        span_index = 0
        spans = segment.spans
        for t, (start, end) in enumerate(offsets):
            while span_index < len(spans) and spans[span_index][1] <= start:
                span_index += 1
            if span_index == len(spans):
                break
            # A token is trained when it starts inside an assistant span (spans never split a token:
            # they end at a special end-of-turn token or at the end of the text).
            span_start, span_end = spans[span_index]
            mask[t] = span_start <= start < span_end and end > start
        input_ids = torch.tensor(ids[:max_length], dtype=torch.long)
        loss_mask = torch.tensor(mask[:max_length], dtype=torch.bool)
        if loss_mask.any():
            out.append({"input_ids": input_ids, "loss_mask": loss_mask})
    return out
