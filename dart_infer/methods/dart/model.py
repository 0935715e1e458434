"""The DART draft model: ONE decoder layer that drafts `draft_length` tokens in ONE forward.

Shape of the computation (dart-method.md §1). For every prefix position t the input is the target's
hidden states at three depths (concatenated, 3·Ht wide) and the embedding of the *next* token:

    residual_t = fc(aux_hidden_t)                                   [H]
    attn_in_t  = cat(input_layernorm(embed(x_{t+1})), hidden_norm(residual_t))   [2H]

After the prefix come `draft_length - 1` mask positions whose attention input is the trainable
`mask_rep` (2H; its first H entries are their residual). One causal attention over prefix + masks,
o_proj + residual, then only the last prefix position and the masks go through the post-attention
norm, the MLP (+ residual), the final norm and `lm_head` (over the draft vocabulary; `d2t` maps a
draft id i to the target id i + d2t[i]).

The same building blocks (`prefix_inputs`, `mask_inputs`, `decode`) serve inference (`draft_step`,
with a KV cache of prefix positions) and training (dart_train builds the prefix-shared mask), so
what is trained is exactly what is served.

State-dict keys and config fields follow the authors' released heads: `fc`, `midlayer.*`, `norm`,
`lm_head`, `t2d`, `d2t`; the embedding is the target's, frozen, never saved (and ignored on load).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

# The shared head parts live in draft_head; DraftKVCache and causal_mask are importable from here too.
from dart_infer.methods.draft_head import DraftHeadParts, DraftKVCache, causal_mask
from dart_infer.target.adapter import aux_layer_ids as default_aux_layer_ids

__all__ = [
    "AUTHORS_ARCHITECTURE",
    "CHECKPOINT_KEYS",
    "DartAttention",
    "DartDecoderLayer",
    "DartDraftConfig",
    "DartDraftModel",
    "DraftKVCache",
    "causal_mask",
    "use_compiled_flex_attention",
]

try:  # flex_attention is only needed for BlockMask inputs (training on GPU)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch without flex attention
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]

_compiled_flex: Any = None


def use_compiled_flex_attention(enabled: bool = True) -> None:
    """Run BlockMask attention through `torch.compile(flex_attention)` (a fused kernel; the eager
    fallback materialises the full score matrix). Training on GPU turns this on once."""
    global _compiled_flex
    _compiled_flex = torch.compile(flex_attention, dynamic=False) if enabled and flex_attention else None


# Keys of the authors' released checkpoints (dart-method.md §1); `embed_tokens.weight` may also appear.
CHECKPOINT_KEYS = (
    "fc.weight",
    "midlayer.mask_rep",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "t2d",
    "d2t",
)


# The class name in the authors' released `config.json` files (`architectures`).
AUTHORS_ARCHITECTURE = "LlamaForCausalLMDart"


def _head_rope_parameters(text_config: Any) -> dict[str, Any] | None:
    """The target's RoPE settings for the head's one layer. Hybrid targets (Gemma 3) keep one set per
    layer type; the head attends over the whole prefix, so it takes the full-attention layers' set."""
    rope = getattr(text_config, "rope_parameters", None)
    if not rope:
        return None
    if all(isinstance(value, dict) for value in rope.values()):
        return dict(rope.get("full_attention") or next(iter(rope.values())))
    return dict(rope)


class DartDraftConfig(LlamaConfig):
    """Llama-style config of a DART head plus `draft_length`, `draft_vocab_size`, `target_hidden_size`.

    `model_type` stays "llama", as in the authors' released `config.json`, so their loaders (which
    read a Llama config with extra fields) and ours read each other's files. `aux_layer_ids` (the
    three target layers whose inputs feed `fc`) is ours; when absent it is derived from the target's
    depth as (2, L//2, L-3).

    `draft_length` here is d, the number of logit rows one forward gives (8 in the paper: the last
    prefix position + 7 masks). The authors' `config.json` stores the number of MASK positions under
    the same key (their layer appends `draft_length` masks), so files hold d - 1: `to_dict` and
    `from_dict` convert, and heads move between the two code bases unchanged.

    `double_final_norm`: apply the final RMSNorm twice before `lm_head`, as the authors' inference
    does (`LlamaForCausalLMDart.forward` returns `norm(h)` and `compute_logits` norms again), so
    their released heads were measured, and presumably trained, that way. A config without the field
    whose `architectures` names their class (`LlamaForCausalLMDart`) gets True; ours write False.
    """

    model_type = "llama"

    num_hidden_layers: int = 1
    draft_length: int = 8
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    aux_layer_ids: list[int] | None = None
    double_final_norm: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        super().__post_init__(**kwargs)
        if self.draft_length < 1:
            raise ValueError(f"draft_length must be >= 1, got {self.draft_length}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) must be in [1, vocab_size={self.vocab_size}]"
            )
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must name 3 target layers, got {self.aux_layer_ids}")

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        config_dict = dict(config_dict)
        if "draft_length" in config_dict:
            config_dict["draft_length"] = int(config_dict["draft_length"]) + 1  # masks → logit rows
        if "double_final_norm" not in config_dict:
            config_dict["double_final_norm"] = AUTHORS_ARCHITECTURE in (config_dict.get("architectures") or [])
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["draft_length"] = self.draft_length - 1  # the authors' meaning: mask positions
        # Loaders written for transformers 4.x (the authors') read the legacy top-level rope fields.
        rope = self.rope_parameters or {}
        if "rope_theta" in rope:
            out.setdefault("rope_theta", rope["rope_theta"])
        return out

    @classmethod
    def from_target_config(
        cls, target_config: Any, draft_length: int = 8, draft_vocab_size: int | None = None, **overrides: Any
    ) -> DartDraftConfig:
        """Derive a head's config from the target's: width, heads, GQA, head_dim, RoPE, eps, MLP, vocab."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_layers = int(text.num_hidden_layers)
        num_heads = int(text.num_attention_heads)
        fields: dict[str, Any] = dict(
            hidden_size=int(text.hidden_size),
            intermediate_size=int(text.intermediate_size),
            num_attention_heads=num_heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or num_heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // num_heads),
            hidden_act=getattr(text, "hidden_act", "silu"),
            rms_norm_eps=float(text.rms_norm_eps),
            rope_parameters=_head_rope_parameters(text),
            max_position_embeddings=int(text.max_position_embeddings),
            vocab_size=int(text.vocab_size),
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
            tie_word_embeddings=False,
            num_hidden_layers=1,
            draft_length=int(draft_length),
            draft_vocab_size=int(draft_vocab_size) if draft_vocab_size is not None else int(text.vocab_size),
            target_hidden_size=int(text.hidden_size),
            aux_layer_ids=list(default_aux_layer_ids(num_layers)),
        )
        fields.update(overrides)
        return cls(**fields)


class DartAttention(nn.Module):
    """Causal self-attention whose q/k/v read the 2H-wide input; GQA and RoPE as in the target."""

    def __init__(self, config: DartDraftConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        attn_in: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: Any,
        kv_cache: DraftKVCache | None,
    ) -> torch.Tensor:
        batch, seq, _ = attn_in.shape
        q = self.q_proj(attn_in).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(attn_in).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(attn_in).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.extend(k, v)
        gqa = self.num_heads != self.num_kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        if BlockMask is not None and isinstance(attention_mask, BlockMask):
            attend = _compiled_flex or flex_attention
            out = attend(q, k, v, block_mask=attention_mask, scale=scale, enable_gqa=gqa)
        else:
            if attention_mask is None:
                attention_mask = causal_mask(seq, k.shape[-2], device=q.device)
            elif attention_mask.dtype != torch.bool:
                raise TypeError("attention_mask must be a bool tensor (True = may attend) or a BlockMask")
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, scale=scale, enable_gqa=gqa
            )
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out)


class DartDecoderLayer(nn.Module):
    """The single draft layer (`midlayer` in the checkpoints)."""

    def __init__(self, config: DartDraftConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.hidden_size = hidden
        self.mask_rep = nn.Parameter(torch.empty(2 * hidden))
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = DartAttention(config)
        self.mlp = LlamaMLP(config)


class DartDraftModel(DraftHeadParts, PreTrainedModel):
    """The DART head. Batch size 1 at inference (`draft_step`); any batch in training (`decode`)."""

    config_class = DartDraftConfig
    config: DartDraftConfig
    base_model_prefix = "dart"

    def external_parameters(self) -> list[nn.Parameter]:
        return [self.midlayer.mask_rep]  # every mask position's input, read by `mask_inputs`
    main_input_name = "aux_hidden"
    _supports_sdpa = True
    _supports_flex_attn = True
    # Released heads may carry the target's embedding: we always take it from the target instead.
    _keys_to_ignore_on_load_unexpected = [r"embed_tokens\.weight"]

    def __init__(self, config: DartDraftConfig) -> None:
        super().__init__(config)
        self._build(config, DartDecoderLayer(config))  # fc, midlayer, norm, lm_head, rotary, t2d/d2t
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, DartDecoderLayer):
            hf_init.normal_(module.mask_rep, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, DartDraftModel):
            self._reset_vocab_mapping(module)

    # ----------------------------------------------------------------------------- building blocks
    def prefix_inputs(
        self, aux_hidden: torch.Tensor, next_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual [B,T,H], attn_in [B,T,2H]) of prefix positions from aux hidden states and next tokens."""
        embedding = self.embed_tokens
        if embedding is None:
            raise RuntimeError("no target embedding attached: call set_target_embedding(weight) first")
        if aux_hidden.shape[-1] != 3 * self.config.target_hidden_size:
            raise ValueError(
                f"aux_hidden is {aux_hidden.shape[-1]} wide, expected 3 x target_hidden_size = "
                f"{3 * self.config.target_hidden_size}"
            )
        if aux_hidden.shape[:2] != next_ids.shape[:2]:
            raise ValueError(
                f"aux_hidden {tuple(aux_hidden.shape)} and next_ids {tuple(next_ids.shape)} disagree"
            )
        weight = self.fc.weight
        residual = self.fc(aux_hidden.to(device=weight.device, dtype=weight.dtype))
        embeds = embedding(next_ids.to(embedding.weight.device)).to(device=weight.device, dtype=weight.dtype)
        layer = self.midlayer
        # Embedding first, then the hidden stream: the authors' released layer concatenates in this
        # order, so their heads and ours share weights' meaning (q/k/v columns, mask_rep halves).
        attn_in = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(residual)], dim=-1)
        return residual, attn_in

    def mask_inputs(self, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual [B,n,H], attn_in [B,n,2H]) of n mask positions (all equal to mask_rep)."""
        rep = self.midlayer.mask_rep
        attn_in = rep.view(1, 1, -1).expand(batch, n, rep.shape[0])
        return attn_in[..., : self.config.hidden_size], attn_in

    def decode(
        self,
        residual: torch.Tensor,
        attn_in: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Any,
        *,
        keep: torch.Tensor | None = None,
        kv_cache: DraftKVCache | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Draft-layer forward → logits [B,K,draft_vocab] over the kept positions.

        `attention_mask`: bool [B or 1, 1, S, S_kv] (True = may attend) run through SDPA, a flex
        `BlockMask`, or None for plain causal attention. With `kv_cache`, keys/values of the cached
        prefix come first (S_kv = cached + S); the call's own K/V are staged in the cache and kept
        only by a later `kv_cache.commit(n)`. `keep`: LongTensor [B,K] of indices into S, or None.
        `return_hidden` also returns the final-normed hidden states [B,K,H].
        """
        position_embeddings = self.rotary_emb(attn_in, position_ids)
        layer = self.midlayer
        hidden = residual + layer.self_attn(attn_in, position_embeddings, attention_mask, kv_cache)
        if keep is not None:
            hidden = hidden.gather(1, keep.to(hidden.device)[..., None].expand(-1, -1, hidden.shape[-1]))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.norm(hidden)
        if self.config.double_final_norm:
            hidden = self.norm(hidden)  # an authors' head: their forward and compute_logits both norm
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    # ----------------------------------------------------------------------------------- inference
    @torch.no_grad()
    def draft_step(
        self, aux_hidden_new: torch.Tensor, next_ids_new: torch.Tensor, cache: DraftKVCache
    ) -> torch.Tensor:
        """Append n new prefix positions to `cache` and return the d draft logit rows [d, draft_vocab].

        Batch size 1. Row 0 (last prefix position) predicts the token after the root; row j predicts
        the token j places further.
        """
        if aux_hidden_new.dim() != 3 or aux_hidden_new.shape[0] != 1:
            raise ValueError(
                f"draft_step takes batch size 1: aux_hidden_new [1,n,3Ht], got {tuple(aux_hidden_new.shape)}"
            )
        n = aux_hidden_new.shape[1]
        if n < 1:
            raise ValueError("draft_step needs at least one new prefix position")
        num_masks = self.config.draft_length - 1
        res_p, in_p = self.prefix_inputs(aux_hidden_new, next_ids_new)
        res_m, in_m = self.mask_inputs(1, num_masks)
        residual = torch.cat([res_p, res_m], dim=1)
        attn_in = torch.cat([in_p, in_m], dim=1)
        seq = n + num_masks
        device = residual.device
        past = cache.length
        position_ids = torch.arange(past, past + seq, device=device)[None]
        keep = torch.arange(n - 1, seq, device=device)[None]
        logits = self.decode(
            residual, attn_in, position_ids, causal_mask(seq, past + seq, device), keep=keep, kv_cache=cache
        )
        cache.commit(n)
        return logits[0]
