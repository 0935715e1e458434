"""The DART training objective: prefix-shared layout, attention masks, annealed KL, α_j.

One forward of the draft head trains every anchor of a sequence at once (dart-method.md §2):

    slots  [ 0 .. T-1 : clean prefix positions | anchor 0: d-1 masks | anchor 1: d-1 masks | ... ]

- Clean slot t holds the draft's prefix input for position t: the target's aux hidden states at t and
  the embedding of the next token x_{t+1} (`DartDraftModel.prefix_inputs`). Clean slots are causal.
- Anchor a at clean position t owns d-1 mask slots (`DartDraftModel.mask_inputs`) at position ids
  pos[t]+1 … pos[t]+d-1. A mask slot sees the clean slots ≤ t (same document) and the earlier slots of
  its own block; blocks never see each other. This is exactly the attention pattern of an inference
  draft step whose prefix ends at t, so the logits are identical (tests/test_train_objective.py).
- `keep` selects, per anchor, clean slot t followed by its d-1 masks → d logit rows. Row j of anchor t
  predicts x_{t+2+j}; its soft label is the target's next-token distribution at position t+1+j
  (teacher forcing on the data sequence).

A row counts only if x_{t+2+j} exists, lies in the same packed document as t and is inside the loss
mask. Anchors are all positions with at least one counting row, or a random subset of at most
`max_anchors` of them per sequence (long contexts).

The mask rule is written once (`_attend`) and evaluated two ways: as a dense bool mask
[B,1,S,S] (CPU / SDPA) and as a `flex_attention` BlockMask (GPU).

Loss (annealed KL, γ=0.6 by default):
    L = Σ_anchors Σ_j γ^j · KL(p̃_target,j ‖ q_draft,j) / #anchors
p̃ is the target distribution restricted to the draft vocabulary and renormalised there: probability
mass on target tokens outside the draft vocabulary (and, with a top-k cache, outside the stored top-k)
is dropped and the rest rescaled to sum to 1 (the EAGLE-3 / SpecForge convention). The draft cannot
emit those tokens anyway; the dropped mass still shows in α_j, which compares the draft's argmax with
the target's argmax over the FULL target vocabulary. A row whose target mass in the draft vocabulary
is zero contributes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PrefixSharedLayout",
    "ObjectiveOutput",
    "build_layout",
    "dart_forward",
    "annealed_kl_loss",
    "target_to_draft_index",
]


@dataclass
class PrefixSharedLayout:
    """Token layout of one prefix-shared training forward for a batch of B sequences of T positions.

    Attributes (S = T + A·(d-1) slots, A = anchors per row after padding):
      anchors [B,A] clean position of each anchor (0 for padding anchors); anchor_valid [B,A];
      position_ids [B,S]; keep [B,A·d] (slot indices of the d logit rows of each anchor);
      row_valid [B,A,d] (row counts in the loss); row_target_pos [B,A,d] (position t+1+j whose
      target distribution is row j's label; clamped into range where invalid);
      slot_limit / slot_block / slot_doc [B,S]: the per-slot data the attention rule reads.
    """

    seq_len: int
    draft_length: int
    anchors: Tensor
    anchor_valid: Tensor
    position_ids: Tensor
    keep: Tensor
    row_valid: Tensor
    row_target_pos: Tensor
    slot_limit: Tensor
    slot_block: Tensor
    slot_doc: Tensor

    @property
    def num_slots(self) -> int:
        return self.position_ids.shape[1]

    @property
    def num_anchors(self) -> int:
        return self.anchors.shape[1]

    def dense_mask(self) -> Tensor:
        """Exact bool attention mask [B,1,S,S] (True = may attend) for SDPA."""
        batch, slots = self.position_ids.shape
        device = self.position_ids.device
        b = torch.arange(batch, device=device)[:, None, None]
        q = torch.arange(slots, device=device)[None, :, None]
        kv = torch.arange(slots, device=device)[None, None, :]
        return _attend(self, b, q, kv).unsqueeze(1)

    def block_mask(self, block_size: int = 128):
        """The same mask as a `flex_attention` BlockMask (heads broadcast)."""
        from torch.nn.attention.flex_attention import create_block_mask

        batch, slots = self.position_ids.shape
        device = self.position_ids.device
        # Eager construction evaluates the full S x S grid; compiled construction works block by
        # block, which long GPU contexts (S = T·d with every anchor) need.
        return create_block_mask(
            self.mask_mod, batch, None, slots, slots, device=device, BLOCK_SIZE=block_size,
            _compile=device.type == "cuda",
        )

    @property
    def mask_mod(self):
        """flex_attention `mask_mod(b, h, q, kv)` of this layout (all heads share the mask)."""

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return _attend(self, b, q, kv)

        return mask_mod

    def to(self, device: torch.device | str) -> PrefixSharedLayout:
        fields = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return PrefixSharedLayout(**fields)


def _attend(layout: PrefixSharedLayout, b: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """The prefix-shared rule: clean kv up to the query's limit in its document, or own block, causal."""
    limit, block, doc = layout.slot_limit, layout.slot_block, layout.slot_doc
    sees_prefix = (kv < layout.seq_len) & (kv <= limit[b, q]) & (doc[b, kv] == doc[b, q])
    q_block = block[b, q]
    same_block = (q_block >= 0) & (block[b, kv] == q_block) & (kv <= q)
    return sees_prefix | same_block


def build_layout(
    loss_mask: Tensor,
    draft_length: int,
    *,
    position_ids: Tensor | None = None,
    document_ids: Tensor | None = None,
    max_anchors: int | None = None,
    generator: torch.Generator | None = None,
    anchor_mask: Tensor | None = None,
) -> PrefixSharedLayout:
    """Choose anchors and build the prefix-shared layout for a right-padded batch.

    loss_mask [B,T] bool: positions whose token is trained on (padding must be False).
    position_ids [B,T]: clean position ids (default 0..T-1; packed rows restart per document).
    document_ids [B,T]: packed-document id per position (default: one document per row); attention
      and rows never cross documents.
    max_anchors: keep at most this many anchors per row, sampled uniformly with `generator`.
    anchor_mask [B,T] bool: optionally restricts which positions may be anchors.
    """
    if draft_length < 1:
        raise ValueError(f"draft_length must be >= 1, got {draft_length}")
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B,T], got shape {tuple(loss_mask.shape)}")
    if max_anchors is not None and max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1 or None, got {max_anchors}")
    loss_mask = loss_mask.bool()
    batch, seq_len = loss_mask.shape
    device = loss_mask.device
    d = draft_length
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=device).expand(batch, seq_len)
    if document_ids is None:
        document_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    if position_ids.shape != loss_mask.shape or document_ids.shape != loss_mask.shape:
        raise ValueError("position_ids / document_ids must have the shape of loss_mask [B,T]")

    # valid[b, t, j]: row j of an anchor at t predicts x_{t+2+j} inside the sequence, document and mask.
    t = torch.arange(seq_len, device=device)
    pred = t[:, None] + 2 + torch.arange(d, device=device)[None, :]  # [T,d]
    in_range = pred < seq_len
    pred_c = pred.clamp(max=seq_len - 1)
    valid = (
        in_range[None]
        & loss_mask[:, pred_c]
        & (document_ids[:, pred_c] == document_ids[:, :, None])
    )  # [B,T,d]
    candidate = valid.any(-1)  # [B,T]
    if anchor_mask is not None:
        if anchor_mask.shape != loss_mask.shape:
            raise ValueError("anchor_mask must have the shape of loss_mask [B,T]")
        candidate = candidate & anchor_mask.to(device=device, dtype=torch.bool)

    chosen: list[Tensor] = []
    for row in range(batch):
        pos = candidate[row].nonzero().flatten()
        if max_anchors is not None and pos.numel() > max_anchors:
            pick = torch.randperm(pos.numel(), generator=generator)[:max_anchors].to(device)
            pos = pos[pick.sort().values]
        chosen.append(pos)
    num_anchors = max(1, max(p.numel() for p in chosen))
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long, device=device)
    anchor_valid = torch.zeros(batch, num_anchors, dtype=torch.bool, device=device)
    for row, pos in enumerate(chosen):
        anchors[row, : pos.numel()] = pos
        anchor_valid[row, : pos.numel()] = True

    rows = torch.arange(batch, device=device)[:, None]
    row_valid = valid[rows, anchors] & anchor_valid[:, :, None]  # [B,A,d]
    row_target_pos = (anchors[:, :, None] + 1 + torch.arange(d, device=device)).clamp(max=seq_len - 1)

    # Mask slots: anchor a, mask j (1..d-1) sits at slot T + a(d-1) + j-1, position pos[t]+j.
    m = d - 1
    j = torch.arange(1, d, device=device)
    anchor_pos = position_ids.gather(1, anchors)  # [B,A]
    mask_pos = (anchor_pos[:, :, None] + j).reshape(batch, num_anchors * m)
    slot_pos = torch.cat([position_ids, mask_pos], dim=1)
    mask_slots = seq_len + torch.arange(num_anchors * m, device=device).view(num_anchors, m)  # [A,m]
    keep = torch.cat([anchors[:, :, None], mask_slots.expand(batch, -1, -1)], dim=2).reshape(batch, -1)

    slot_limit = torch.cat([t.expand(batch, -1), anchors.repeat_interleave(m, dim=1)], dim=1)
    slot_block = torch.cat(
        [
            torch.full((batch, seq_len), -1, dtype=torch.long, device=device),
            torch.arange(num_anchors, device=device).repeat_interleave(m).expand(batch, -1),
        ],
        dim=1,
    )
    slot_doc = torch.cat([document_ids, document_ids.gather(1, anchors).repeat_interleave(m, dim=1)], dim=1)
    return PrefixSharedLayout(
        seq_len=seq_len,
        draft_length=d,
        anchors=anchors,
        anchor_valid=anchor_valid,
        position_ids=slot_pos.contiguous(),
        keep=keep.contiguous(),
        row_valid=row_valid,
        row_target_pos=row_target_pos,
        slot_limit=slot_limit.contiguous(),
        slot_block=slot_block.contiguous(),
        slot_doc=slot_doc.contiguous(),
    )


def dart_forward(
    draft_model: torch.nn.Module, aux_hidden: Tensor, input_ids: Tensor, layout: PrefixSharedLayout, *,
    use_flex: bool | None = None,
) -> Tensor:
    """DART's training forward (`draft_forward` checks the inputs): clean slots, then every anchor's
    d - 1 mask slots, in ONE forward of the draft layer under the prefix-shared mask."""
    batch = input_ids.shape[0]
    d, num_anchors = layout.draft_length, layout.num_anchors
    next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    res_clean, attn_clean = draft_model.prefix_inputs(aux_hidden, next_ids)
    res_mask, attn_mask_in = draft_model.mask_inputs(batch, num_anchors * (d - 1))
    residual = torch.cat([res_clean, res_mask.to(res_clean.dtype)], dim=1)
    attn_in = torch.cat([attn_clean, attn_mask_in.to(attn_clean.dtype)], dim=1)
    if use_flex is None:
        use_flex = aux_hidden.is_cuda
    mask = layout.block_mask() if use_flex else layout.dense_mask()
    logits = draft_model.decode(residual, attn_in, layout.position_ids, mask, keep=layout.keep)
    return logits.view(batch, num_anchors, d, -1)


def target_to_draft_index(d2t: Tensor, target_vocab_size: int) -> Tensor:
    """LongTensor [V]: draft id of each target id, -1 where the target token is not in the draft vocab."""
    draft_ids = torch.arange(d2t.numel(), device=d2t.device)
    target_ids = draft_ids + d2t
    if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= target_vocab_size):
        raise ValueError("d2t maps draft ids outside the target vocabulary")
    index = torch.full((target_vocab_size,), -1, dtype=torch.long, device=d2t.device)
    index[target_ids] = draft_ids
    return index


@dataclass
class ObjectiveOutput:
    """loss: scalar to backpropagate; kl [d], alpha [d], rows [d]: per-position means and counts
    (kl/alpha are detached; summed stats `kl_sum`, `correct` allow exact aggregation across batches)."""

    loss: Tensor
    kl: Tensor
    alpha: Tensor
    rows: Tensor
    kl_sum: Tensor
    correct: Tensor
    num_anchors: int


def annealed_kl_loss(
    draft_logits: Tensor,
    layout: PrefixSharedLayout,
    d2t: Tensor,
    *,
    target_logprobs: Tensor,
    target_ids: Tensor | None = None,
    gamma: float = 0.6,
) -> ObjectiveOutput:
    """Annealed KL Σ_j γ^j KL(p̃_target ‖ q_draft,j), averaged over valid anchors, plus α_1..α_d.

    draft_logits [B,A,d,Vd]. The target distribution per position comes either as full log-probs /
    logits over the target vocab (`target_ids=None`, target_logprobs [B,T,V]) or as top-k
    (target_logprobs [B,T,k] log-probabilities normalised over the FULL vocab, target_ids [B,T,k]).
    Both are restricted to the draft vocabulary and renormalised (module docstring).
    """
    batch, num_anchors, d, draft_vocab = draft_logits.shape
    if d != layout.draft_length or num_anchors != layout.num_anchors:
        raise ValueError("draft_logits do not match the layout")
    if d2t.numel() != draft_vocab:
        raise ValueError(f"d2t has {d2t.numel()} entries, draft logits have {draft_vocab}")
    device = draft_logits.device
    rows = torch.arange(batch, device=device)[:, None, None]
    pos = layout.row_target_pos.to(device)
    row_valid = layout.row_valid.to(device)
    d2t = d2t.to(device)
    log_q = F.log_softmax(draft_logits.float(), dim=-1)  # [B,A,d,Vd]
    draft_target_ids = torch.arange(draft_vocab, device=device) + d2t

    # Restrict per position [B,T,·] first (T rows are fewer than A·d rows), then gather rows.
    if target_ids is None:
        scores = target_logprobs.float()
        top1_per_pos = scores.argmax(-1)  # [B,T] over the full target vocab
        log_p_pos = F.log_softmax(scores[..., draft_target_ids], dim=-1)  # [B,T,Vd]
        log_p = log_p_pos[rows, pos]  # [B,A,d,Vd]
        kl_rows = (log_p.exp() * (log_p - log_q)).sum(-1)
        has_mass = torch.ones_like(row_valid)
    else:
        if target_ids.shape != target_logprobs.shape:
            raise ValueError("target_ids and target_logprobs must have the same shape [B,T,k]")
        scores = target_logprobs.float()
        ids = target_ids.long()
        top1_per_pos = ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        vocab = int(max(int(ids.max()), int(draft_target_ids.max()))) + 1
        draft_of = target_to_draft_index(d2t, vocab)[ids]  # [B,T,k], -1 outside the draft vocab
        kept = draft_of >= 0
        masked = scores.masked_fill(~kept, float("-inf"))
        norm = torch.logsumexp(masked, dim=-1, keepdim=True)
        has_mass_pos = kept.any(-1)  # [B,T]
        log_p_pos = torch.where(kept, masked - norm.nan_to_num(neginf=0.0), torch.zeros_like(masked))
        log_p = log_p_pos[rows, pos]  # [B,A,d,k]
        kept_rows = kept[rows, pos]
        log_q_at = log_q.gather(-1, draft_of[rows, pos].clamp(min=0))
        p = torch.where(kept_rows, log_p.exp(), torch.zeros_like(log_p))
        kl_rows = (p * (log_p - log_q_at)).sum(-1)
        has_mass = has_mass_pos[rows, pos]
    target_top1 = top1_per_pos[rows, pos]  # [B,A,d]
    valid = row_valid & has_mass
    weights = gamma ** torch.arange(d, device=device, dtype=torch.float32)
    kl_rows = torch.where(valid, kl_rows, torch.zeros_like(kl_rows))
    anchors_used = int(layout.anchor_valid.sum())
    loss = (kl_rows * weights).sum() / max(anchors_used, 1)

    draft_top1 = draft_logits.argmax(-1)
    draft_top1 = draft_top1 + d2t[draft_top1]
    correct = ((draft_top1 == target_top1) & valid).sum(dim=(0, 1)).float()
    rows_per_pos = valid.sum(dim=(0, 1)).float()
    kl_sum = kl_rows.detach().sum(dim=(0, 1))
    denom = rows_per_pos.clamp(min=1)
    return ObjectiveOutput(
        loss=loss,
        kl=kl_sum / denom,
        alpha=correct / denom,
        rows=rows_per_pos,
        kl_sum=kl_sum,
        correct=correct,
        num_anchors=anchors_used,
    )
