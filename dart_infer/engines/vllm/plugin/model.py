"""The DART head as a vLLM draft model (imported only inside vLLM, through `dart_infer.engines.vllm.plugin`).

vLLM's parallel-drafting EAGLE-3 proposer (`v1/spec_decode/llm_base_proposer.py`, P-EAGLE) calls
the draft model ONCE per step with, per request: the accepted prefix positions (input id x_{t+1},
hidden state `fc(aux_t)`, position t), then the bonus slot (the target's new token), then k - 1
slots whose input id is the config's `mask_token_id` and whose hidden state is `fc(mask_hidden)`,
at the positions that follow. It samples the bonus slot and the k - 1 mask slots: k tokens, a chain.

DART's mask positions are not vLLM's: their whole 2H attention input is the learned `mask_rep` and
its first H entries are their residual (`DartDraftModel.mask_inputs`); the token embedding and
`fc(mask_hidden)` play no part. So the forward here finds the mask slots by their input id (the
export sets `mask_token_id` = vocab_size, an id no real token has) and swaps in `mask_rep`; every
other step is `DartDraftModel.decode` on vLLM's layers: attention over the draft KV cache (prefix
positions of earlier steps, as our `DraftKVCache`), o_proj + residual, post-attention norm, MLP +
residual, final norm (twice for the authors' heads), `lm_head` over the draft vocabulary, d2t.

With a trie in the export (`dart-export --ngram-model`), `compute_logits` returns the trie-chosen
chain as point-mass logits (`dart_infer.engines.vllm.plugin.chain`); the forward keeps its input ids,
where each chain's root is.

Built on vLLM's EAGLE-3 Llama classes because the proposer accepts only those (it checks the
class) and for their weight loading, `fc`, `lm_head` and d2t handling; `forward` is ours.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import LlamaModel as Eagle3LlamaModel
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix

from dart_infer.engines.vllm.plugin import ARCHITECTURE, CHAIN_CONFIG_KEY
from dart_infer.engines.vllm.plugin.chain import chain_drafter, roots_from_input_ids

# Under vLLM's "vllm" logger, so its handler prints our lines with its own (INFO and up).
LOG = logging.getLogger("vllm.dart_plugin")
MASK_REP = "layers.0.mask_rep"  # the exported name of DART's mask_rep (ours: midlayer.mask_rep)


class DartLlamaModel(Eagle3LlamaModel):
    """vLLM's one-layer EAGLE-3 Llama body (fc, the 2H-input layer, norm) plus `mask_rep` and
    DART's forward. Inherits vLLM's torch.compile wrapper: `forward` keeps its argument names."""

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id, prefix=prefix)
        config = self.config
        if len(self.layers) != 1:
            raise ValueError(f"{ARCHITECTURE}: a DART head has one layer, the config says {len(self.layers)}")
        # On the layer, so the exported name is layers.0.mask_rep (midlayer.mask_rep maps there too).
        self.layers[0].mask_rep = nn.Parameter(torch.empty(2 * config.hidden_size), requires_grad=False)
        self.mask_token_id = int(config.mask_token_id)
        self.double_final_norm = bool(getattr(config, "dart_double_final_norm", False))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if input_ids is None:  # multimodal inputs come as embeddings: the mask slots cannot be told apart
            raise ValueError(f"{ARCHITECTURE} needs input ids (text-only targets)")
        layer = self.layers[0]
        is_mask = (input_ids == self.mask_token_id).unsqueeze(-1)
        if input_embeds is None:
            # The mask id lies outside the vocabulary: embed a real id there (its result is replaced).
            input_embeds = self.embed_input_ids(torch.where(is_mask.squeeze(-1), 0, input_ids))
        # Prefix slots: residual fc(aux_t) (= hidden_states), attention input
        # [input_layernorm(embed(x_{t+1})), hidden_norm(residual)] (prefix_inputs; embedding first).
        prefix_in = torch.cat([layer.input_layernorm(input_embeds), layer.hidden_norm(hidden_states)], dim=-1)
        rep = layer.mask_rep.to(prefix_in.dtype)
        attn_in = torch.where(is_mask, rep, prefix_in)
        residual = torch.where(is_mask, rep[: hidden_states.shape[-1]], hidden_states)
        hidden = residual + layer.self_attn(positions=positions, hidden_states=attn_in)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        out = self.norm(hidden)
        if self.double_final_norm:  # an authors' head: their forward and compute_logits both norm
            out = self.norm(out)
        return out, hidden


class DartDraftModelEagle3(Eagle3LlamaForCausalLM):
    """The DART draft head for vLLM's parallel drafting (method "eagle3", parallel_drafting true)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        # Eagle3LlamaForCausalLM.__init__ builds its own body; ours differs, so the set-up is redone
        # here (calling it would register the draft attention layer twice).
        nn.Module.__init__(self)
        spec = vllm_config.speculative_config
        assert spec is not None
        self.config = config = spec.draft_model_config.hf_config
        _check_config(config, spec)
        self.num_draft_rows = int(spec.num_speculative_tokens)  # k sampled rows per request
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        config.target_layer_count = target_layers
        self.model = DartLlamaModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                    start_layer_id=target_layers)
        self.lm_head = ParallelLMHead(config.draft_vocab_size, config.hidden_size,
                                      quant_config=get_draft_quant_config(vllm_config),
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.draft_vocab_size, scale=getattr(config, "logit_scale", 1.0))
        if config.draft_vocab_size != vllm_config.model_config.get_vocab_size():
            self.draft_id_to_target_id = nn.Parameter(torch.zeros(config.draft_vocab_size, dtype=torch.long),
                                                      requires_grad=False)
        else:
            self.draft_id_to_target_id = None
        self.use_parallel_drafting = True
        # vLLM fills the mask slots' hidden state with fc(mask_hidden); DART ignores it (forward).
        self.register_buffer("mask_hidden", torch.zeros(1, self.model.fc_input_size), persistent=False)
        from vllm import __version__ as vllm_version

        self.chain = chain_drafter(config, CHAIN_CONFIG_KEY, vllm_version, LOG)
        self._input_ids: torch.Tensor | None = None  # the last draft forward's (the chains' roots)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._input_ids = input_ids
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        k = self.num_draft_rows
        if self.chain is None or logits is None or k < 2 or self._input_ids is None:
            return logits
        roots = roots_from_input_ids(self._input_ids, self.model.mask_token_id, logits.shape[0] // k)
        return self.chain.point_mass_logits(logits, roots)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen: set[str] = set()

        def noting() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                seen.add(name)
                yield name, tensor

        super().load_weights(noting())
        if not seen & {MASK_REP, "midlayer.mask_rep"}:
            raise ValueError(f"{ARCHITECTURE}: the checkpoint has no {MASK_REP} (export the head with dart-export)")


def _check_config(config, spec) -> None:
    """What parallel drafting with a DART head needs; one error naming the fix otherwise."""
    if not spec.parallel_drafting:
        raise ValueError(f"{ARCHITECTURE}: DART drafts all tokens in one forward; set \"parallel_drafting\": true "
                         "in the speculative config (the export's vllm_speculative_config.json has it)")
    rows = getattr(config, "dart_draft_rows", None)
    if rows is not None and spec.num_speculative_tokens > rows:
        raise ValueError(f"{ARCHITECTURE}: num_speculative_tokens {spec.num_speculative_tokens} > the head's "
                         f"{rows} draft rows (the last prefix position + {rows - 1} masks)")
    mask_id = getattr(config, "mask_token_id", None)
    if mask_id is None or 0 <= int(mask_id) < config.vocab_size:
        raise ValueError(f"{ARCHITECTURE}: mask_token_id must lie outside the vocabulary [0, {config.vocab_size}) "
                         f"so mask slots are never a real token, got {mask_id}")
