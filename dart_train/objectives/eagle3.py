"""EAGLE-3's training-time test (TTT) on DART's layout, anchors and loss.

`ttt_forward` is what `dart_train.objectives.methods.draft_forward` runs for an EAGLE-3 head (its hook in
`dart_train.objectives.methods`): the same `PrefixSharedLayout` (anchors, row validity, soft-label positions)
and the same loss
(`annealed_kl_loss`: KL to the target's distribution restricted to the draft vocabulary, weight
γ^k on step k), so data, online/offline states, packing, the engine, resume, export and evaluation
are DART's. Only the forward differs — d = `ttt_length` SEQUENTIAL steps instead of one parallel one:

- step 0 runs every clean position t causally (within its packed document): input
  (fc(aux_t), x_{t+1}) at position t → h⁰_t, logits predicting x_{t+2};
- step k ≥ 1 runs only at the anchors: anchor t's input is (h^{k-1}_t, x_{t+1+k}) at position
  pos_t + k; it attends to step 0's keys at positions ≤ t of its document and to its own keys of
  steps 1..k (its chain) — exactly what the inference draft loop sees when it drafts k tokens after
  the prefix ending at t (`dart_infer.methods.eagle3.chain_logits`; tests/test_eagle3_train.py checks the
  logits equal step by step in fp32).

Choices (EAGLE-3 / SpecForge and where we differ):
- fed-back hidden: the head's own pre-norm output, as EAGLE-3 (its TTT "feeds the draft's output back");
- tokens: the data's ground-truth tokens x_{t+1+k}, as EAGLE-3 and SpecForge (not the draft's own
  argmax); the soft label of step k is the target's distribution at t+1+k (teacher forcing);
- positions: step k sits at pos_t + k, where inference puts the k-th drafted token. SpecForge's TTT
  keeps every step at pos_t (its inference does not), so our training matches our serving exactly;
- step weights 0.8^k (`configs/draft/eagle3.yaml` gamma, SpecForge's and EAGLE-3's default);
- loss: DART's KL over the draft vocabulary with the target renormalised there (rows with no target
  mass in the draft vocabulary drop out). SpecForge instead drops rows whose target argmax is outside
  the draft vocabulary and uses cross-entropy to the renormalised target (the same gradient).
- attention is computed by hand (prefix scores + chain scores under one softmax), O(A·T) memory per
  step like one causal forward, so every position can be an anchor (`trainer.max_anchors=null`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dart_train.objectives.dart import PrefixSharedLayout

__all__ = ["ttt_forward"]


def _attend(
    q: Tensor, k_prefix: Tensor, v_prefix: Tensor, prefix_mask: Tensor,
    chain_k: list[Tensor], chain_v: list[Tensor], scale: float,
) -> Tensor:
    """Softmax attention of q [B,h,A,D] over prefix keys [B,hkv,T,D] (where prefix_mask [B,A,T])
    plus one key per chain step ([B,hkv,A,D] each, the query's own). Returns [B,A,h·D]."""
    groups = q.shape[1] // k_prefix.shape[1]
    kp = k_prefix.repeat_interleave(groups, dim=1)
    vp = v_prefix.repeat_interleave(groups, dim=1)
    scores = (q @ kp.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~prefix_mask[:, None], float("-inf"))
    if chain_k:
        ck = torch.stack([k.repeat_interleave(groups, dim=1) for k in chain_k], dim=3)  # [B,h,A,k,D]
        cv = torch.stack([v.repeat_interleave(groups, dim=1) for v in chain_v], dim=3)
        chain_scores = (q[:, :, :, None] * ck).sum(-1) * scale  # [B,h,A,k]
        probs = torch.softmax(torch.cat([scores, chain_scores], dim=-1), dim=-1)
        t = scores.shape[-1]
        out = probs[..., :t] @ vp + (probs[..., t:, None] * cv).sum(3)
    else:
        out = torch.softmax(scores, dim=-1) @ vp
    batch, heads, rows, dim = out.shape
    return out.transpose(1, 2).reshape(batch, rows, heads * dim)


def ttt_forward(model: Any, aux_hidden: Tensor, input_ids: Tensor, layout: PrefixSharedLayout) -> Tensor:
    """EAGLE-3's TTT over every anchor of `layout` → draft logits [B,A,d,draft_vocab] (module doc).

    aux_hidden [B,T,3Ht] are the target's aux hidden states on `input_ids` [B,T]; row k of anchor t
    predicts x_{t+2+k} (the layout's row meaning, shared with DART)."""
    batch, seq_len = input_ids.shape
    d, anchors = layout.draft_length, layout.anchors
    device = model.fc.weight.device
    input_ids = input_ids.to(device)
    positions = layout.position_ids[:, :seq_len].to(device)
    docs = layout.slot_doc[:, :seq_len].to(device)
    anchors = anchors.to(device)
    scale = model.attention_scale
    o_proj = model.midlayer.self_attn.o_proj

    # Step 0: every clean position, causal within its document.
    hidden = model.project(aux_hidden)
    next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    q, k0, v0 = model.attention_qkv(model.layer_input(hidden, next_ids), positions)
    idx = torch.arange(seq_len, device=device)
    causal = (idx[None, :] <= idx[:, None])[None] & (docs[:, None, :] == docs[:, :, None])
    out, logits = model.layer_output(hidden, o_proj(_attend(q, k0, v0, causal, [], [], scale)))
    take = anchors[:, :, None]
    rows = [logits.gather(1, take.expand(-1, -1, logits.shape[-1]))]
    hidden = out.gather(1, take.expand(-1, -1, out.shape[-1]))  # [B,A,H]

    # Steps 1..d-1: the anchors only, each over its prefix and its own chain.
    anchor_pos = positions.gather(1, anchors)
    prefix = (idx[None, None, :] <= anchors[:, :, None]) & (docs[:, None, :] == docs.gather(1, anchors)[:, :, None])
    chain_k: list[Tensor] = []
    chain_v: list[Tensor] = []
    for k in range(1, d):
        # Ground-truth token x_{t+1+k}; beyond the sequence a stand-in (no valid row reads it).
        tokens = input_ids.gather(1, (anchors + 1 + k).clamp(max=seq_len - 1))
        q, kk, vv = model.attention_qkv(model.layer_input(hidden, tokens), anchor_pos + k)
        chain_k.append(kk)
        chain_v.append(vv)
        out, logits = model.layer_output(hidden, o_proj(_attend(q, k0, v0, prefix, chain_k, chain_v, scale)))
        rows.append(logits)
        hidden = out
    return torch.stack(rows, dim=2)
