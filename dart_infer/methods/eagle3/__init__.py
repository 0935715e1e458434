"""EAGLE-3 in the DART framework: the head, its dynamic draft tree, and its drafter for the shared loop.

The head (EAGLE-3, arXiv 2503.01840) reads the same three target hidden states as DART's and runs
ONE decoder layer per draft token, feeding its own output back:

    step 0 (prefix position t):  hidden = fc(aux_t)                     [3·Ht → H]
    every step:                  attn_in = cat(input_layernorm(embed(token)), hidden_norm(hidden))  [2H]
                                 h = hidden + attn(attn_in);  h = h + mlp(post_attention_layernorm(h))
                                 logits = lm_head(norm(h))   (draft vocabulary; d2t maps to target ids)
    step k+1 (position t+k+1):   hidden = h of step k (pre-norm), token = the token step k drafted.

Split as DART is: `model` (config + head: the layer without `mask_rep` and the sequential step),
`tree` (EAGLE-2's dynamic tree `expand_tree`, its settings and defaults), `drafter` (`Eagle3Drafter`
for the shared loop). The method itself (how `DartModel` and dart-train find these pieces) is
`dart_infer.methods.eagle3`. Embedding sharing and the draft vocabulary (`dart_infer.methods.draft_head`), the
target adapter, verification, acceptance and the decoding loop are shared with DART (`.target`,
`.sampling`, `.decoding`).

Checkpoint layout (what published EAGLE-3 heads use and SpecForge, EAGLE and vLLM load, checked
against SpecForge `specforge/modeling/draft/llama3_eagle.py`, vLLM `llama_eagle3.py`):
state-dict keys `fc.weight`, `midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2H), `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` (int64 offsets: target = draft + d2t[draft])
and `t2d` (bool [vocab]); `embed_tokens.weight` is accepted on load and never saved (the target's is
used, as vLLM does when it is absent). `config.json`: a Llama config with `architectures:
["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`, `draft_vocab_size`, `target_hidden_size` and
`eagle_aux_hidden_state_layer_ids` (vLLM's name; the INPUTS of those target layers, i.e.
`hidden_states[i]` of a transformers forward, (2, L//2, L-3) by default as vLLM picks them) and
vLLM's `norm_before_residual` (default false); `ttt_length` (training-time-test steps) is ours and
ignored by other loaders.
"""

from __future__ import annotations

from typing import Any

import torch

from dart_infer.methods.base import DraftMethod
from dart_infer.methods.eagle3.drafter import Eagle3Drafter, anchor_trees, chain_logits
from dart_infer.methods.eagle3.model import (
    EAGLE3_ARCHITECTURE,
    Eagle3DraftConfig,
    Eagle3DraftModel,
    load_eagle3_model,
)
from dart_infer.methods.eagle3.tree import (
    CPU_EAGLE3_TREE,
    Eagle3TreeSettings,
    TreeDraftCache,
    default_eagle3_tree,
    expand_tree,
)

__all__ = [
    "METHOD",
    "CPU_EAGLE3_TREE",
    "EAGLE3_ARCHITECTURE",
    "Eagle3DraftConfig",
    "Eagle3DraftModel",
    "Eagle3Drafter",
    "Eagle3Method",
    "Eagle3TreeSettings",
    "TreeDraftCache",
    "anchor_trees",
    "chain_logits",
    "default_eagle3_tree",
    "expand_tree",
    "load_eagle3_model",
]


class Eagle3Method(DraftMethod):
    name = "eagle3"
    display_name = "EAGLE-3"
    architectures = (EAGLE3_ARCHITECTURE,)
    config_class = Eagle3DraftConfig
    head_class = Eagle3DraftModel
    tree_settings_class = Eagle3TreeSettings
    tree_size_field = "total_tokens"
    uses_trie = False

    def default_tree(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Eagle3TreeSettings:
        return default_eagle3_tree(device)

    def drafter(self, model: Any, settings: Eagle3TreeSettings) -> Eagle3Drafter:
        return Eagle3Drafter(model.draft_model, settings)

    def max_depth(self, head: Any, settings: Eagle3TreeSettings) -> int:
        return int(settings.depth)


METHOD = Eagle3Method()
