"""One request's arguments, checked before anything runs: the prompt as ids, and the new-token budget."""

from __future__ import annotations

import numbers

import torch

__all__ = ["as_prompt", "checked_request"]


def checked_request(
    input_ids: torch.Tensor | list[int], max_new_token_num: int, max_length: int, vocab_size: int
) -> tuple[torch.Tensor, int]:
    """(prompt [T] long, new-token budget) of one generation, or a ValueError/TypeError naming the bad
    argument: batch size 1, integer ids inside the vocabulary, token counts as ints."""
    prompt = as_prompt(input_ids)
    _check_count("max_new_token_num", max_new_token_num)
    _check_count("max_length", max_length)
    if max_new_token_num < 1:
        raise ValueError(f"max_new_token_num must be >= 1, got {max_new_token_num}")
    if max_length <= prompt.numel():
        raise ValueError(f"max_length ({max_length}) must exceed the prompt length ({prompt.numel()} tokens)")
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab_size:
        raise ValueError(f"input_ids hold ids outside the vocabulary [0, {vocab_size})")
    return prompt, int(min(max_new_token_num, max_length - prompt.numel()))


def _check_count(name: str, value: object) -> None:
    """A token count is an int (not a bool, not a float such as 2.5 or 8.0), or a TypeError naming it."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int (a number of tokens), got {value!r} ({type(value).__name__})")


def as_prompt(input_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """One prompt's ids as a 1-D long tensor ([1,T] or [T] given), or an error naming what is wrong."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"batch size 1 only: input_ids has batch {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be [1,T] or [T], got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("empty prompt: input_ids has no tokens")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {ids.dtype}")
    return ids.to(torch.long)
