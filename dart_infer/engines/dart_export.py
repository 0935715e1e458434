"""A DART head for vLLM: the files `dart_infer.engines.vllm.plugin` loads (`dart_vllm_files`) and, with a
trie, the chain search the plugin runs inside vLLM (`chain_config`). `dart_infer.engines.export` calls both.

DART heads (`--format vllm` only): the layout `dart_infer.engines.vllm.plugin` loads. config.json is a
one-layer Llama config with `architectures: [DartDraftModelEagle3]` (the plugin's registered name),
`draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (our `aux_layer_ids`,
ascending: vLLM concatenates the captured layers in layer order, so fc's column blocks follow),
`norm_before_residual: false`, `mask_token_id` = vocab_size (the plugin finds vLLM's mask slots by
that id, which no real token has), `dart_draft_rows` (d) and `dart_double_final_norm`. Weights: ours
with `midlayer.` renamed `layers.0.` (so `layers.0.mask_rep`), d2t kept when the draft vocabulary is
smaller, plus `mask_hidden` (zeros, 3·H_target: vLLM's parallel drafting requires the tensor; DART
does not use it). `vllm_speculative_config.json` adds `"parallel_drafting": true`; k defaults to d.

Trie-chosen chains (`dart-export --ngram-model <trie>`): config.json gains `dart_chain` (the key
`CHAIN_CONFIG_KEY`): the trie's absolute path (not copied: tries run to gigabytes; each vLLM worker
maps it once), the chain search's settings from configs/tree/chain.yaml (what `tree=chain` uses in our
loop: top-k per row, beam width, n-gram weight, level and logit weights) and the target's first EOS id
(the search ranks paths ending there last, as ours does). Without it the plugin drafts the argmax
chain and says so in one log line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dart_infer.common.errors import InputError

__all__ = ["chain_config", "dart_vllm_files"]

# Keys of a DART head's config that the exported Llama layer config does not carry (they are renamed or
# replaced below; the file's `draft_length` counts masks, the authors' meaning).
_DART_ONLY = ("draft_length", "aux_layer_ids", "double_final_norm", "architectures", "transformers_version",
              "base_model", "_name_or_path", "dtype", "torch_dtype")


def _target_num_layers(verifier: str) -> int | None:
    config = Path(verifier) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    data = data.get("text_config") or data
    return data.get("num_hidden_layers")


def dart_vllm_files(head_dir: Path, verifier: str, tokens: int | None) -> tuple[dict, dict, int]:
    """(config.json, tensors, k) of a DART head for `dart_infer.engines.vllm.plugin` (module docstring)."""
    import torch

    from dart_infer.engines.vllm.plugin import ARCHITECTURE
    from dart_infer.methods.dart.model import CHECKPOINT_KEYS
    from dart_infer.methods.loading import load_draft_model
    from dart_infer.target.adapter import aux_layer_ids as default_aux_layer_ids

    try:
        model = load_draft_model(str(head_dir))
    except (ValueError, FileNotFoundError) as err:
        raise InputError(f"head={head_dir}: {err}") from err
    config = model.config
    rows = int(config.draft_length)  # d: the last prefix position + d - 1 masks
    if tokens is not None and not 1 <= tokens <= rows:
        raise InputError(f"--num-speculative-tokens {tokens}: a DART head drafts at most its {rows} rows "
                         f"(draft_length) in one forward; choose 1..{rows}")
    ids = config.aux_layer_ids
    if ids is None:
        layers = _target_num_layers(verifier)
        if layers is None:
            raise InputError(f"head={head_dir}: no aux_layer_ids in its config and no readable config.json at "
                             f"the target {verifier} to derive them from; pass --target <local model dir>")
        ids = default_aux_layer_ids(int(layers))
    ids = [int(i) for i in ids]
    if len(set(ids)) != len(ids):
        raise InputError(f"head={head_dir}: its aux layer ids {ids} repeat a layer, which vLLM captures only once "
                         "(fc would get fewer than 3 states); a target with 7 or more layers avoids it")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if k in CHECKPOINT_KEYS}
    # vLLM concatenates the captured layers in layer order: fc's column blocks must follow it.
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    width = int(config.target_hidden_size)
    state["fc.weight"] = torch.cat([state["fc.weight"][:, i * width:(i + 1) * width] for i in order], dim=1)
    ids = [ids[i] for i in order]
    dtype = state["fc.weight"].dtype
    tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    if config.draft_vocab_size == config.vocab_size:
        if bool(tensors["d2t"].any()):  # vLLM has no mapping for a full draft vocabulary
            raise InputError(f"head={head_dir}: its draft vocabulary is the full vocabulary but reordered (d2t "
                             "is not zero), which vLLM cannot map")
        del tensors["d2t"]
    tensors["mask_hidden"] = torch.zeros(3 * width, dtype=dtype)
    out_config = {k: v for k, v in config.to_diff_dict().items() if k not in _DART_ONLY}
    out_config.update(
        architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
        draft_vocab_size=int(config.draft_vocab_size), target_hidden_size=width,
        eagle_aux_hidden_state_layer_ids=ids, norm_before_residual=False,
        mask_token_id=int(config.vocab_size), dart_draft_rows=rows,
        dart_double_final_norm=bool(config.double_final_norm), base_model=verifier,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    return out_config, tensors, tokens or rows


# The chain search's fields the plugin reads (dart_infer.engines.vllm.plugin.chain builds its settings from them).
_CHAIN_FIELDS = ("draft_top_k", "beam_width", "ngram_weight", "level_weight", "logit_weight", "ngram_on_first_level")


def chain_config(ngram_model: str, verifier: str) -> dict[str, Any] | None:
    """config.json's `dart_chain` for the trie `ngram_model` (a file, or "auto": the default trie when it is
    built): None when auto finds none (said in one log line); a missing, corrupt or mismatched trie is one
    error naming --ngram-model, before anything is written."""
    import logging
    from types import SimpleNamespace

    import yaml
    from transformers import AutoConfig, GenerationConfig

    from dart_infer.common.configs import configs_dir
    from dart_infer.data.loaders import eos_token_ids
    from dart_infer.data.resolve import default_trie_path, model_vocabulary, resolve_trie
    from dart_infer.tree.settings import TreeSearchSettings

    vocabulary = model_vocabulary(verifier)
    choice = resolve_trie(ngram_model, vocabulary=vocabulary, default=default_trie_path(), key="--ngram-model")
    if choice.notice:
        logging.getLogger(__name__).warning(choice.notice)
    if choice.trie is None:
        return None
    settings = TreeSearchSettings.coerce(yaml.safe_load((configs_dir() / "tree" / "chain.yaml").read_text()))
    if settings.ngram_on_first_level:  # the plugin sees only the root of each chain, not the tokens before it
        raise InputError("configs/tree/chain.yaml: ngram_on_first_level must be false for vLLM (the plugin's "
                         "search sees only each chain's root)")
    try:
        generation = GenerationConfig.from_pretrained(verifier)
    except OSError:  # no generation_config.json: the model config's EOS
        generation = None
    holder = SimpleNamespace(generation_config=generation, config=AutoConfig.from_pretrained(verifier))
    eos = eos_token_ids(holder, vocabulary[0])
    chain = {name: getattr(settings, name) for name in _CHAIN_FIELDS}
    chain = {k: list(v) if isinstance(v, tuple) else v for k, v in chain.items()}
    return {"ngram_model": str(Path(str(choice.path)).resolve()), **chain, "eos_token_id": eos[0] if eos else None}
