"""The trie-chosen chain inside vLLM: our C++ beam search picks the k tokens vLLM verifies.

vLLM 0.32's parallel-drafting proposer takes the drafts as `model.compute_logits(rows).argmax(-1)`
(`v1/spec_decode/llm_base_proposer.py`, `_greedy_sample` / `_sample_draft_tokens`), the rows
request-major: each request's bonus slot (the chain's root, the target's new token), then its k - 1
mask slots. The draft forward's input ids hold, per request, [accepted tokens, bonus, k - 1 masks,
rejected slots] (`v1/spec_decode/utils.py`, `copy_and_expand_eagle_inputs_kernel`), so each root is
the id just before its request's first mask slot (`roots_from_input_ids`). `ChainDrafter` runs
`dart_infer.tree.chain.best_chain` (what `tree=chain` runs in our loop) over each request's k rows'
top-k and turns the chains into logits whose argmax they are: 0 at the chain's token, -inf elsewhere.
A point mass: the draft's probability of its token is 1, so vLLM's rejection sampler stays lossless
at any temperature.

The search sees the root only, not the tokens before it: with an order-3 trie and no n-gram term on
the first level (the export checks both) that is all a chain's n-gram terms read, so the chain equals
our loop's on the same rows. No vLLM import here: tests run this in our own venv.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["SUPPORTED_VLLM", "ChainDrafter", "LayoutError", "chain_drafter", "chain_settings", "roots_from_input_ids"]

log = logging.getLogger(__name__)

# The vLLM versions whose proposer layout (module docstring) was read; another one is refused at start.
SUPPORTED_VLLM = ("0.32.",)
MAX_TRIE_ORDER = 3  # the search's context is the root alone (module docstring)


class LayoutError(RuntimeError):
    """vLLM's draft rows are not laid out as this module expects (another vLLM version?)."""


def roots_from_input_ids(input_ids: torch.Tensor, mask_token_id: int, requests: int) -> torch.Tensor:
    """[requests] root ids: for each request, in order, the input id just before its first mask slot."""
    is_mask = input_ids == mask_token_id
    first = is_mask & ~torch.cat([is_mask.new_zeros(1), is_mask[:-1]])
    starts = first.nonzero().squeeze(-1)[:requests]  # padding slots, if any, come after every request
    if starts.numel() != requests or bool((starts == 0).any()):
        raise LayoutError(f"expected {requests} runs of mask slots, each after its request's bonus token, in the "
                          f"draft forward's input ids; found {int(first.sum())}. vLLM's parallel-drafting layout "
                          f"changed: the DART plugin supports vLLM {', '.join(SUPPORTED_VLLM)}x")
    return input_ids[starts - 1]


def chain_settings(chain: Mapping[str, Any]) -> Any:
    """The `TreeSearchSettings(shape="chain")` of an export's `dart_chain` (JSON lists back to tuples)."""
    from dart_infer.tree.settings import TreeSearchSettings

    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in chain.items()
              if k not in ("ngram_model", "eos_token_id")}
    return TreeSearchSettings(shape="chain", **fields)


class ChainDrafter:
    """The trie (memory-mapped, loaded once per worker) and the chain search's settings of an export's
    `dart_chain` (`dart_infer.engines.dart_export.chain_config`)."""

    def __init__(self, chain: Mapping[str, Any]) -> None:
        from ngram_builder import NgramTrie

        self.path = str(chain["ngram_model"])
        self.trie = NgramTrie.open(self.path, mmap=True)
        if self.trie.order > MAX_TRIE_ORDER:
            raise ValueError(f"dart_chain: the trie {self.path} has order {self.trie.order}; inside vLLM the search "
                             f"sees only each chain's root, enough for order <= {MAX_TRIE_ORDER} (build one with "
                             "dart-ngram order=3)")
        self.settings = chain_settings(chain)
        if self.settings.ngram_on_first_level:
            raise ValueError("dart_chain: ngram_on_first_level needs the tokens before the root, which vLLM's draft "
                             "model does not see; export with it false")
        eos = chain.get("eos_token_id")
        self.eos_token_id = None if eos is None else int(eos)

    def chains(self, logits: torch.Tensor, roots: torch.Tensor) -> list[list[int]]:
        """Each request's chain (k target ids at most) from its k logit rows ([requests * k, vocab])."""
        from dart_infer.tree.chain import best_chain

        requests = int(roots.numel())
        k = logits.shape[0] // requests
        top = torch.topk(logits.float().view(requests, k, -1), min(self.settings.draft_top_k, logits.shape[-1]), dim=-1)
        tokens, probs = top.indices.cpu(), torch.softmax(top.values, dim=-1).cpu()
        settings = dataclasses.replace(self.settings, remain_total=k)
        return [best_chain(tokens[i], probs[i], self.trie, [int(root)], settings=settings,
                           eos_token_id=self.eos_token_id) for i, root in enumerate(roots.tolist())]

    def point_mass_logits(self, logits: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        """Logits like `logits` whose per-row argmax is the chain (rows past a short chain keep their argmax)."""
        requests = int(roots.numel())
        k = logits.shape[0] // requests
        if logits.shape[0] != requests * k:
            raise LayoutError(f"{logits.shape[0]} draft rows for {requests} requests: not k rows per request")
        ids = logits.argmax(dim=-1).view(requests, k)
        for i, chain in enumerate(self.chains(logits, roots)):
            if chain:
                ids[i, : len(chain)] = torch.tensor(chain, dtype=ids.dtype, device=ids.device)
        out = torch.full_like(logits, float("-inf"))
        out.scatter_(1, ids.view(-1, 1), 0.0)
        return out


def chain_drafter(config: Any, key: str, vllm_version: str, logger: logging.Logger = log) -> ChainDrafter | None:
    """The drafter of an exported head's config (its `key` entry), or None (the argmax chain); one line on
    `logger` says which, as vLLM builds the draft model in each worker."""
    chain = getattr(config, key, None)
    if not chain:
        logger.info("DART plugin: no trie in this export (dart-export --ngram-model adds one): drafting the argmax "
                 "chain, each row's most likely token")
        return None
    if not vllm_version.startswith(SUPPORTED_VLLM):
        raise ValueError(f"DART plugin: the trie-chosen chain reads vLLM's draft-row layout, checked in vLLM "
                         f"{', '.join(SUPPORTED_VLLM)}x; this is vLLM {vllm_version} (export without --ngram-model)")
    drafter = ChainDrafter(dict(chain))
    logger.info("DART plugin: drafting the trie-chosen chain (trie %s, order %d; top-%d per row, beam %d)",
             drafter.path, drafter.trie.order, drafter.settings.draft_top_k, drafter.settings.beam_width)
    return drafter
