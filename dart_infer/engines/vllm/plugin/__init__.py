"""vLLM plugin that serves DART heads: ONE draft forward proposes k tokens (vLLM's parallel drafting).

vLLM finds it through the `vllm.general_plugins` entry point `dart` (declared by this project's
pyproject.toml, and by `scripts/vllm_plugin/pyproject.toml`, the small distribution `make vllm`
installs into `.venv-vllm` with the tree search and trie the chain needs and their C++ extensions).
`register` adds the architecture `ARCHITECTURE` to vLLM's model registry; `dart-export <DART head>
--out <dir>` writes heads with it; `chain` drafts the trie-chosen chain when the export names a trie.

Serving: `speculative_config = {"model": <export>, "method": "eagle3", "num_speculative_tokens": k,
"parallel_drafting": true}` (the export's `vllm_speculative_config.json`). vLLM's EAGLE-3 proposer
then captures the three `aux_layer_ids` hidden states of the target, projects them with the head's
`fc`, appends k - 1 mask slots (their input id is `mask_token_id`) and runs the head once; the model
here (`dart_infer.engines.vllm.plugin.model`) gives those slots DART's `mask_rep` inputs.

This module imports nothing from vLLM or from the rest of `dart_infer` at import time: `dart_infer`
does not import it either, and the vLLM venv has other pins than ours (docs/vllm.md).
"""

from __future__ import annotations

__all__ = ["ARCHITECTURE", "CHAIN_CONFIG_KEY", "MODEL_CLASS", "register"]

# The name in an exported head's config.json. vLLM's EAGLE-3 config wrapper keeps an architecture
# name as it is only when it starts or ends with "Eagle3" (otherwise it prefixes "Eagle3").
ARCHITECTURE = "DartDraftModelEagle3"
# The export's config.json key of the trie-chosen chain (`dart_infer.engines.dart_export`; read by `chain`).
CHAIN_CONFIG_KEY = "dart_chain"
# Lazy "<module>:<class>": vLLM imports it only in the processes that build the model.
MODEL_CLASS = "dart_infer.engines.vllm.plugin.model:DartDraftModelEagle3"


def register() -> None:
    """Entry point (`vllm.general_plugins`): vLLM calls it once per process; registering twice is harmless."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
