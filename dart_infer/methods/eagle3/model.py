"""The EAGLE-3 head (arXiv 2503.01840) and its config, in the published checkpoint layout.

ONE decoder layer per draft token, fed its own output (`dart_infer.methods.eagle3` shows a step).
The parts around the layer (fc, norm, lm_head, rotary, the draft vocabulary and the target's
embedding) are every head's (`dart_infer.methods.draft_head`); the attention is DART's (`DartAttention`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from dart_infer.methods.dart.model import DartAttention, DartDraftConfig
from dart_infer.methods.draft_head import DraftHeadParts, DraftKVCache

__all__ = ["EAGLE3_ARCHITECTURE", "Eagle3DecoderLayer", "Eagle3DraftConfig", "Eagle3DraftModel", "load_eagle3_model"]

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


class Eagle3DraftConfig(LlamaConfig):
    """Llama config of an EAGLE-3 head (`model_type` "llama", one layer) plus `draft_vocab_size`,
    `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` and `ttt_length`.

    `aux_layer_ids` and `draft_length` (= `ttt_length`: logit rows per anchor in training) are the
    names the DART code reads (`TargetModel`, the engine, the objective), aliases here."""

    model_type = "llama"

    num_hidden_layers: int = 1
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    ttt_length: int = 7
    # vLLM's option for heads trained that way: the residual stream starts from hidden_norm(hidden).
    norm_before_residual: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.eagle_aux_hidden_state_layer_ids is not None:
            self.eagle_aux_hidden_state_layer_ids = [int(i) for i in self.eagle_aux_hidden_state_layer_ids]
        super().__post_init__(**kwargs)
        self.architectures = [EAGLE3_ARCHITECTURE]
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) must be in [1, vocab_size={self.vocab_size}]"
            )
        ids = self.eagle_aux_hidden_state_layer_ids
        if ids is not None and len(ids) != 3:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids must name 3 target layers, got {ids}")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        # save_pretrained writes the class name; loaders dispatch on the published architecture name.
        out["architectures"] = [EAGLE3_ARCHITECTURE]
        rope = self.rope_parameters or {}
        if "rope_theta" in rope:  # loaders written for transformers 4.x read the legacy top-level field
            out.setdefault("rope_theta", rope["rope_theta"])
        return out

    @property
    def aux_layer_ids(self) -> list[int] | None:
        return self.eagle_aux_hidden_state_layer_ids

    @property
    def draft_length(self) -> int:
        return self.ttt_length

    @classmethod
    def from_target_config(
        cls, target_config: Any, draft_vocab_size: int | None = None, ttt_length: int = 7, **overrides: Any
    ) -> Eagle3DraftConfig:
        """Derive a head's config from the target's, the same way as DART's (width, heads, RoPE, ...)."""
        fields = DartDraftConfig.from_target_config(target_config, draft_vocab_size=draft_vocab_size).to_dict()
        fields.pop("draft_length")
        fields["eagle_aux_hidden_state_layer_ids"] = fields.pop("aux_layer_ids")
        fields.update(ttt_length=int(ttt_length), **overrides)
        return cls.from_dict(fields)


class Eagle3DecoderLayer(nn.Module):
    """The single draft layer (`midlayer`): DART's layer without `mask_rep`."""

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = DartAttention(config)
        self.mlp = LlamaMLP(config)


class Eagle3DraftModel(DraftHeadParts, PreTrainedModel):
    """The EAGLE-3 head. `step` is one sequential draft step for any batch and attention mask;
    inference (`expand_tree`, `Eagle3Drafter`) and training (`dart_train.objectives.eagle3`) build on it."""

    config_class = Eagle3DraftConfig
    config: Eagle3DraftConfig
    base_model_prefix = "eagle3"
    main_input_name = "aux_hidden"
    _supports_sdpa = True
    _keys_to_ignore_on_load_unexpected = [r"embed_tokens\.weight"]

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__(config)
        self._build(config, Eagle3DecoderLayer(config))  # fc, midlayer, norm, lm_head, rotary, t2d/d2t
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, Eagle3DraftModel):
            self._reset_vocab_mapping(module)

    # ----------------------------------------------------------------------------- building blocks
    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc over the three aux hidden states [.., 3·Ht] → the step-0 hidden stream [.., H]."""
        if aux_hidden.shape[-1] != 3 * self.config.target_hidden_size:
            raise ValueError(
                f"aux_hidden is {aux_hidden.shape[-1]} wide, expected 3 x target_hidden_size = "
                f"{3 * self.config.target_hidden_size}"
            )
        weight = self.fc.weight
        return self.fc(aux_hidden.to(device=weight.device, dtype=weight.dtype))

    def layer_input(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """attn_in [.., 2H] = cat(input_layernorm(embed(token)), hidden_norm(hidden)): embedding first,
        as EAGLE-3's released layer (and DART's) concatenates."""
        embedding = self.embed_tokens
        if embedding is None:
            raise RuntimeError("no target embedding attached: call set_target_embedding(weight) first")
        embeds = embedding(token_ids.to(embedding.weight.device)).to(device=hidden.device, dtype=hidden.dtype)
        layer = self.midlayer
        return torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)

    def layer_output(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm output h [.., H] — the next step's hidden —, logits [.., draft_vocab])."""
        layer = self.midlayer
        residual = layer.hidden_norm(hidden) if self.config.norm_before_residual else hidden
        out = residual + attn_out
        out = out + layer.mlp(layer.post_attention_layernorm(out))
        return out, self.lm_head(self.norm(out))

    def step(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kv_cache: DraftKVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over [B,S] inputs: hidden [B,S,H] (fc output or a previous step's h), the
        tokens paired with it, positions [B,S], a bool mask [B|1,1,S,S_kv] (None = causal). With
        `kv_cache` the cached keys come first and the call's K/V are staged in it."""
        attn_in = self.layer_input(hidden, token_ids)
        position_embeddings = self.rotary_emb(attn_in, position_ids)
        attn_out = self.midlayer.self_attn(attn_in, position_embeddings, attention_mask, kv_cache)
        return self.layer_output(hidden, attn_out)

    def attention_qkv(
        self, attn_in: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [B,h,S,D] and k, v [B,hkv,S,D] of the draft layer (training's own attention)."""
        attn = self.midlayer.self_attn
        batch, seq, _ = attn_in.shape
        q = attn.q_proj(attn_in).view(batch, seq, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(attn_in).view(batch, seq, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(attn_in).view(batch, seq, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(attn_in, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.midlayer.self_attn.head_dim)


def load_eagle3_model(path: str, *, dtype: torch.dtype | None = None) -> Eagle3DraftModel:
    """Load an EAGLE-3 head (ours, or one in the published layout); missing or mis-shaped tensors fail."""
    from dart_infer.methods.loading import load_draft_model

    return load_draft_model(path, dtype=dtype, model_class=Eagle3DraftModel, kind="EAGLE-3")  # type: ignore[no-any-return]

