"""EAGLE-3 in the DART framework: the head, its dynamic draft tree, and decoding through DART's loop.

The head (EAGLE-3, arXiv 2503.01840) reads the same three target hidden states as DART's and runs
ONE decoder layer per draft token, feeding its own output back:

    step 0 (prefix position t):  hidden = fc(aux_t)                     [3·Ht → H]
    every step:                  attn_in = cat(input_layernorm(embed(token)), hidden_norm(hidden))  [2H]
                                 h = hidden + attn(attn_in);  h = h + mlp(post_attention_layernorm(h))
                                 logits = lm_head(norm(h))   (draft vocabulary; d2t maps to target ids)
    step k+1 (position t+k+1):   hidden = h of step k (pre-norm), token = the token step k drafted.

Only the pieces that differ from DART are here: the layer (no `mask_rep`), the sequential step and
the EAGLE-2 dynamic tree (`expand_tree`). Embedding sharing, the draft vocabulary (`t2d`/`d2t`), the
target adapter, verification, acceptance and the decoding loop are DART's (`dart_infer.model`,
`.target`, `.sampling`, `.decoding`).

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

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from dart_infer.decoding import tree_steps
from dart_infer.generate import DartModel
from dart_infer.model import DartAttention, DartDraftConfig, DartDraftModel, DraftKVCache, causal_mask
from dart_infer.stats import GenerationStats, StepOutput
from dart_infer.tree import DraftTree, tree_from_parents, with_field_overrides

__all__ = [
    "EAGLE3_ARCHITECTURE",
    "Eagle3DraftConfig",
    "Eagle3DraftModel",
    "Eagle3Drafter",
    "Eagle3Model",
    "Eagle3TreeSettings",
    "TreeDraftCache",
    "anchor_trees",
    "chain_logits",
    "default_eagle3_tree",
    "expand_tree",
    "load_eagle3_model",
]

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


class Eagle3DraftModel(PreTrainedModel):
    """The EAGLE-3 head. `step` is one sequential draft step for any batch and attention mask;
    inference (`expand_tree`, `Eagle3Drafter`) and training (`dart_train.eagle3_objective`) build on it."""

    config_class = Eagle3DraftConfig
    config: Eagle3DraftConfig
    base_model_prefix = "eagle3"
    main_input_name = "aux_hidden"
    _supports_sdpa = True
    _keys_to_ignore_on_load_unexpected = [r"embed_tokens\.weight"]

    # One home for the shared parts: the target's embedding and the draft vocabulary work as in DART.
    embed_tokens = DartDraftModel.embed_tokens
    set_target_embedding = DartDraftModel.set_target_embedding
    set_vocab_mapping = DartDraftModel.set_vocab_mapping
    draft_to_target = DartDraftModel.draft_to_target
    _build = DartDraftModel._build
    _reset_vocab_mapping = DartDraftModel._reset_vocab_mapping

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
    from dart_infer.loading import load_draft_model

    return load_draft_model(path, dtype=dtype, model_class=Eagle3DraftModel, kind="EAGLE-3")  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------- the draft tree
@dataclass(frozen=True)
class Eagle3TreeSettings:
    """EAGLE-2's dynamic tree: every level expands the `top_k` nodes of highest cumulative
    probability (each proposing its `top_k` best children) for `depth` levels; the tree keeps the
    `total_tokens` nodes of highest cumulative probability. `depth` counts draft levels under the
    root (EAGLE's own `depth` argument is one less: its first level comes before its loop)."""

    top_k: int = 10
    depth: int = 8
    total_tokens: int = 60

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> Eagle3TreeSettings:
        return with_field_overrides(self, overrides, "EAGLE-3 tree")  # type: ignore[no-any-return]


# On a CPU a verification's cost grows with its nodes (docs/results/measured.md, "Verification cost"): a tree about the
# size of DART's CPU tree when the two were compared (12 nodes); on GPUs EAGLE-3's published setting (60 nodes, top-10, 8 levels).
CPU_EAGLE3_TREE = Eagle3TreeSettings(top_k=4, depth=5, total_tokens=12)


def default_eagle3_tree(device: torch.device | str) -> Eagle3TreeSettings:
    return CPU_EAGLE3_TREE if torch.device(device).type == "cpu" else Eagle3TreeSettings()


class TreeDraftCache(DraftKVCache):
    """The draft's K/V cache for EAGLE-3: committed prefix positions, then the tree nodes of the
    current expansion staged after them (each `extend` appends after the staged ones). `commit(n)`
    keeps the first n staged entries (prefix updates stage nothing else); `discard()` drops them."""

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        staged = self._pending
        self.length += staged  # write after the staged entries (the parent grows the storage)
        try:
            out = super().extend(keys, values)
        finally:
            self.length -= staged
        self._pending = staged + keys.shape[-2]
        return out

    def discard(self) -> None:
        self._pending = 0


def _tree_from_candidates(
    root: int, tokens: list[int], parents: list[int], depths: list[int], chosen: list[int]
) -> DraftTree:
    """A `DraftTree` (the layout `dart_infer.tree` produces) of the root + the chosen candidates."""
    node_of = {c: i + 1 for i, c in enumerate(chosen)}
    return tree_from_parents(
        [root] + [tokens[c] for c in chosen],
        [-1] + [node_of[parents[c]] if parents[c] >= 0 else 0 for c in chosen],
        [0] + [depths[c] for c in chosen],
    )


@torch.no_grad()
def expand_tree(
    model: Eagle3DraftModel,
    cache: TreeDraftCache,
    last_hidden: torch.Tensor,
    last_logits: torch.Tensor,
    root: int,
    settings: Eagle3TreeSettings,
) -> DraftTree:
    """EAGLE-2's dynamic draft tree after the prefix in `cache` (batch size 1).

    last_hidden [H] / last_logits [draft_vocab]: the step output at the last committed prefix
    position (whose paired token is the root). Nodes are scored by cumulative draft log-probability;
    a level's `top_k` best nodes are run through the head (attending to the prefix and their own
    ancestors) and propose their `top_k` best children. Staged tree K/V are discarded before
    returning. Node tokens are target ids.
    """
    k = settings.top_k
    device = last_hidden.device
    past = cache.length
    cache.discard()
    logp = torch.log_softmax(last_logits.float(), dim=-1)
    top = torch.topk(logp, min(k, logp.numel()))
    # Candidates (every proposed node): target token, cumulative score, parent candidate (-1 = root), depth.
    tokens: list[int] = model.draft_to_target(top.indices).tolist()
    scores: list[float] = top.values.tolist()
    parents: list[int] = [-1] * len(tokens)
    depths: list[int] = [1] * len(tokens)
    frontier = list(range(len(tokens)))
    frontier_hidden = last_hidden.reshape(1, 1, -1).expand(1, len(frontier), -1)
    slot_of: dict[int, int] = {}  # expanded candidate → its staged cache slot
    for level in range(1, settings.depth):
        m = len(frontier)
        for c in frontier:
            slot_of[c] = len(slot_of)
        staged = len(slot_of)
        # Each frontier node sees the prefix, its expanded ancestors and itself.
        mask = torch.zeros(m, past + staged, dtype=torch.bool, device=device)
        mask[:, :past] = True
        for i, c in enumerate(frontier):
            node = c
            while node >= 0:
                mask[i, past + slot_of[node]] = True
                node = parents[node]
        ids = torch.tensor([tokens[c] for c in frontier], device=device)[None]
        positions = torch.full((1, m), past - 1 + level, device=device)
        hidden, logits = model.step(frontier_hidden, ids, positions, mask[None, None], cache)
        child = torch.topk(torch.log_softmax(logits[0].float(), dim=-1), min(k, logits.shape[-1]))
        cumulative = child.values + torch.tensor([scores[c] for c in frontier], device=device)[:, None]
        first_new = len(tokens)
        child_tokens = model.draft_to_target(child.indices).tolist()
        for i, c in enumerate(frontier):
            tokens.extend(child_tokens[i])
            scores.extend(cumulative[i].tolist())
            parents.extend([c] * child.indices.shape[1])
            depths.extend([level + 1] * child.indices.shape[1])
        best = torch.topk(cumulative.flatten(), min(k, cumulative.numel())).indices
        rows = (best // child.indices.shape[1]).to(device)
        frontier = [first_new + int(b) for b in best.tolist()]
        frontier_hidden = hidden[:, rows]
    cache.discard()
    # A child never outscores its parent (log-probs <= 0) and ties keep the shallower node first,
    # so the best `total_tokens` candidates always form a tree.
    order = sorted(range(len(tokens)), key=lambda c: (-scores[c], depths[c], c))
    chosen = sorted(order[: settings.total_tokens])
    return _tree_from_candidates(root, tokens, parents, depths, chosen)


class Eagle3Drafter:
    """EAGLE-3's side of DART's decoding loop (`dart_infer.decoding.tree_steps`): `update` appends
    accepted prefix positions to the draft cache, `propose` grows the dynamic tree after them."""

    propose_phase = "draft"  # the tree's draft forwards dominate its cost

    def __init__(self, model: Eagle3DraftModel, settings: Eagle3TreeSettings) -> None:
        self.model = model
        self.settings = settings
        self.cache = TreeDraftCache()
        self.last_hidden: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None

    @torch.no_grad()
    def update(self, aux_hidden_new: torch.Tensor, next_ids_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """n new prefix positions [1,n,3Ht] with their next tokens [1,n] → their (h, logits) [1,n,·]."""
        n = aux_hidden_new.shape[1]
        cache = self.cache
        cache.discard()
        past = cache.length
        device = self.model.fc.weight.device
        positions = torch.arange(past, past + n, device=device)[None]
        hidden, logits = self.model.step(
            self.model.project(aux_hidden_new), next_ids_new, positions, causal_mask(n, past + n, device), cache
        )
        cache.commit(n)
        self.last_hidden, self.last_logits = hidden[0, -1], logits[0, -1]
        return hidden, logits

    def propose(self, history: torch.Tensor) -> DraftTree:
        assert self.last_hidden is not None and self.last_logits is not None, "update() first"
        return expand_tree(
            self.model, self.cache, self.last_hidden, self.last_logits, int(history[-1]), self.settings
        )


@torch.no_grad()
def anchor_trees(
    model: Eagle3DraftModel,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: Sequence[int],
    settings: Eagle3TreeSettings,
) -> list[DraftTree]:
    """The tree serving builds at each anchor t of one sequence (prefix 0..t verified, root x_{t+1}),
    for simulated τ: one prefix forward over the sequence [1,T,3Ht] / [1,T], then per anchor the
    cache cut back to t+1 and `expand_tree`. Anchors run from the last: a tree's staged K/V overwrite
    only positions after its own prefix. Needs t + 1 < T for every anchor."""
    if not anchors:
        return []
    end = max(anchors) + 1
    drafter = Eagle3Drafter(model, settings)
    hidden, logits = drafter.update(aux_hidden[:, :end], input_ids[:, 1 : end + 1])
    trees: dict[int, DraftTree] = {}
    for t in sorted(set(anchors), reverse=True):
        drafter.cache.crop(t + 1)
        trees[t] = expand_tree(model, drafter.cache, hidden[0, t], logits[0, t], int(input_ids[0, t + 1]), settings)
    return [trees[t] for t in anchors]


def chain_logits(
    model: Eagle3DraftModel, aux_hidden: torch.Tensor, next_ids: torch.Tensor, tokens: Sequence[int]
) -> torch.Tensor:
    """The inference draft loop along a given chain: prefix positions 0..t from `aux_hidden`
    [1,t+1,3Ht] and `next_ids` [1,t+1], then one step per token of `tokens` (each fed with the
    previous step's own hidden output). Returns the logits of every step [1 + len(tokens), draft_vocab].
    Reference for the training-time-test equivalence (and a plain chain drafter)."""
    drafter = Eagle3Drafter(model, Eagle3TreeSettings())
    drafter.update(aux_hidden, next_ids)
    assert drafter.last_hidden is not None and drafter.last_logits is not None
    rows = [drafter.last_logits]
    hidden = drafter.last_hidden
    cache = drafter.cache
    past = cache.length
    device = hidden.device
    with torch.no_grad():
        for j, token in enumerate(tokens):
            mask = torch.ones(1, 1, 1, past + j + 1, dtype=torch.bool, device=device)
            h, logits = model.step(
                hidden.reshape(1, 1, -1), torch.tensor([[token]], device=device),
                torch.tensor([[past + j]], device=device), mask, cache,
            )
            hidden = h[0, -1]
            rows.append(logits[0, -1])
    cache.discard()
    return torch.stack(rows)



# ------------------------------------------------------------------------------------ public API
class Eagle3Model(DartModel):
    """A base (target) model + an EAGLE-3 head: `eagle3_generate` / `eagle3_generate_stream` (the
    dynamic tree verified by DART's loop; lossless like `dart_generate`), `ar_generate` as in
    `DartModel`, `with_dtype`, `.to()`. Batch size 1. No n-gram trie (EAGLE-3 has none).

    `tree`: `Eagle3TreeSettings` or field overrides of `default_eagle3_tree` for the device."""

    def __init__(
        self,
        base_model: Any,
        draft_model: Eagle3DraftModel,
        tokenizer: Any = None,
        trie: Any = None,
        *,
        tree: Eagle3TreeSettings | Mapping[str, Any] | None = None,
        profile: bool = False,
    ) -> None:
        if trie is not None:
            raise ValueError("EAGLE-3 decoding uses no n-gram trie")
        if not isinstance(draft_model, Eagle3DraftModel):
            raise TypeError(f"Eagle3Model needs an Eagle3DraftModel, got {type(draft_model).__name__}")
        super().__init__(base_model, draft_model, tokenizer, None, tree=tree, profile=profile)  # type: ignore[arg-type]

    _load_head = staticmethod(load_eagle3_model)

    @property  # type: ignore[override]
    def tree(self) -> Eagle3TreeSettings:
        spec = self._tree_spec
        if isinstance(spec, Eagle3TreeSettings):
            return spec
        return default_eagle3_tree(self.target.device).with_overrides(spec)

    @tree.setter
    def tree(self, value: Eagle3TreeSettings | Mapping[str, Any] | None) -> None:
        spec = value if isinstance(value, Eagle3TreeSettings) or value is None else dict(value)
        if isinstance(spec, dict):
            Eagle3TreeSettings().with_overrides(spec)  # unknown names and bad values fail now
        self._tree_spec = spec

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        base_model_name_or_path: str,
        eagle3_model_name_or_path: str,
        *,
        dtype: torch.dtype | str | None = None,
        tree: Eagle3TreeSettings | Mapping[str, Any] | None = None,
        profile: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> Eagle3Model:
        """Load base model, tokenizer and EAGLE-3 head (ours or a published one) as `DartModel` does
        (`chat_template` as there: for base models without one)."""
        model = super().from_pretrained(
            base_model_name_or_path, eagle3_model_name_or_path, None, dtype=dtype, tree=tree, profile=profile,
            chat_template=chat_template, **kwargs,
        )
        assert isinstance(model, Eagle3Model)
        return model

    def dart_generate_stream(self, *args: Any, **kwargs: Any) -> Iterator[StepOutput]:
        raise TypeError("an Eagle3Model decodes with eagle3_generate / eagle3_generate_stream")

    def eagle3_generate_stream(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        tree: Eagle3TreeSettings | Mapping[str, Any] | None = None,
        profile: bool | None = None,
    ) -> Iterator[StepOutput]:
        """Yield each step's emitted tokens and acceptance length (arguments as `eagle3_generate`;
        checked before the first token). Stats land in `self.last_stats`."""
        prompt, budget, sampler = self._start(
            input_ids, temperature, top_p, top_k, max_new_token_num, max_length, generator
        )
        settings = tree if isinstance(tree, Eagle3TreeSettings) else self.tree.with_overrides(tree)
        drafter = Eagle3Drafter(self.draft_model, settings)  # type: ignore[arg-type]
        return tree_steps(self, prompt, budget, sampler, drafter, self.profile if profile is None else profile)

    def eagle3_generate(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        tree: Eagle3TreeSettings | Mapping[str, Any] | None = None,
        profile: bool | None = None,
        return_stats: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, GenerationStats]:
        """EAGLE-3 decoding of ONE prompt → LongTensor [1, prompt + new]; arguments and stopping as
        `DartModel.dart_generate` (greedy identical to the base model's in fp32; sampling lossless)."""
        steps = self.eagle3_generate_stream(
            input_ids, temperature, top_p, top_k, max_new_token_num, max_length,
            generator=generator, tree=tree, profile=profile,
        )
        return self._collect(input_ids, steps, return_stats)
