"""The prefix-shared training forward equals inference; masks; annealed KL by hand; γ weighting."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama
from transformers import LlamaForCausalLM

from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel, DraftKVCache
from dart_infer.target.adapter import TargetModel
from dart_train.objectives import (
    annealed_kl_loss,
    build_layout,
    draft_forward,
    target_to_draft_index,
)

VOCAB = 97
DRAFT_VOCAB = 40
TARGET = dict(vocab_size=VOCAB, max_position_embeddings=256, attn_implementation="sdpa")  # tiny_llama fields


def tiny_head(target: LlamaForCausalLM, draft_length: int = 4, seed: int = 1) -> DartDraftModel:
    torch.manual_seed(seed)
    cfg = DartDraftConfig.from_target_config(target.config, draft_length=draft_length, draft_vocab_size=DRAFT_VOCAB)
    head = DartDraftModel(cfg).eval()
    head.set_target_embedding(target.get_input_embeddings().weight)
    # A non-trivial vocab mapping: every other target id, shuffled offsets.
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].sort().values
    head.set_vocab_mapping(ids)
    # Non-zero norms so every weight matters.
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def test_layout_positions_keep_and_validity() -> None:
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    layout = build_layout(loss_mask, draft_length=3)
    # Rows of anchor t predict x_{t+2+j}; anchors are all t with some row in the loss mask: t = 0..3.
    assert layout.anchors.tolist() == [[0, 1, 2, 3]]
    assert layout.row_valid[0].tolist() == [
        [False, True, True],  # predicts x2 (not in the mask), x3, x4
        [True, True, True],  # x3, x4, x5
        [True, True, False],  # x4, x5, x6 (x6 outside the loss mask)
        [True, False, False],  # x5, x6, x7
    ]
    assert layout.row_target_pos[0].tolist() == [[1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6]]
    t = 8
    assert layout.position_ids[0, :t].tolist() == list(range(8))
    # Masks continue after each anchor: anchor 0 → positions 1,2; anchor 1 → 2,3; ...
    assert layout.position_ids[0, t:].tolist() == [1, 2, 2, 3, 3, 4, 4, 5]
    assert layout.keep[0].tolist() == [0, 8, 9, 1, 10, 11, 2, 12, 13, 3, 14, 15]


def test_dense_mask_rule() -> None:
    loss_mask = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.bool)
    layout = build_layout(loss_mask, draft_length=3)
    mask = layout.dense_mask()[0, 0]
    t = 5
    assert layout.anchors.tolist() == [[0, 1, 2]]
    assert torch.equal(mask[:t, :t], torch.ones(t, t, dtype=torch.bool).tril())
    assert not mask[:t, t:].any()  # clean positions never see masks
    for a, anchor in enumerate(layout.anchors[0].tolist()):
        for j in range(2):
            row = mask[t + 2 * a + j]
            assert row[:t].tolist() == [k <= anchor for k in range(t)]
            own = [t + 2 * a + i for i in range(j + 1)]
            assert row[t:].nonzero().flatten().add(t).tolist() == own


def test_packed_documents_do_not_mix() -> None:
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    layout = build_layout(loss_mask, draft_length=2, document_ids=docs, position_ids=pos)
    mask = layout.dense_mask()[0, 0]
    assert not mask[4:8, :4].any()
    # Anchor 1 predicts x3 (same document) and x4 (next document: no row); anchors 2, 3 only the next.
    assert layout.anchors[0].tolist() == [0, 1, 4, 5]
    assert layout.row_valid[0, 1].tolist() == [True, False]
    # Mask slots of anchor 4 (document 1) see clean slot 4 only, at position 0 + 1.
    a4_slot = 8 + 2 * 1
    assert mask[a4_slot, :8].nonzero().flatten().tolist() == [4]
    assert layout.position_ids[0, a4_slot].item() == 1


def test_max_anchors_subsamples_deterministically() -> None:
    loss_mask = torch.ones(2, 40, dtype=torch.bool)
    a = build_layout(loss_mask, 4, max_anchors=5, generator=torch.Generator().manual_seed(7))
    b = build_layout(loss_mask, 4, max_anchors=5, generator=torch.Generator().manual_seed(7))
    assert a.anchors.shape == (2, 5)
    assert torch.equal(a.anchors, b.anchors)
    assert (a.anchors.diff(dim=1) > 0).all()


@pytest.mark.parametrize("draft_length", [1, 4, 8])
def test_training_forward_equals_inference_for_every_anchor(draft_length: int) -> None:
    target = tiny_llama(**TARGET)
    head = tiny_head(target, draft_length=draft_length)
    states = TargetModel(target)
    torch.manual_seed(5)
    lengths = [23, 17]
    seq_len = max(lengths)
    input_ids = torch.randint(0, VOCAB, (2, seq_len))
    loss_mask = torch.zeros(2, seq_len, dtype=torch.bool)
    loss_mask[0, 4:23] = True
    loss_mask[1, 2:9] = True
    loss_mask[1, 11:17] = True
    aux, _ = states.states(input_ids)
    layout = build_layout(loss_mask, draft_length)
    with torch.no_grad():
        logits = draft_forward(head, aux, input_ids, layout, use_flex=False)
    assert logits.shape[2:] == (draft_length, DRAFT_VOCAB)
    checked = 0
    for b in range(2):
        for a in range(layout.num_anchors):
            if not layout.anchor_valid[b, a]:
                continue
            t = int(layout.anchors[b, a])
            cache = DraftKVCache()
            # Inference: prefix positions 0..t with next tokens x_1..x_{t+1} (x_{t+1} = the root).
            aux_b, _ = states.states(input_ids[b : b + 1, : t + 2])
            ref = head.draft_step(aux_b[:, : t + 1], input_ids[b : b + 1, 1 : t + 2], cache)
            torch.testing.assert_close(logits[b, a], ref, rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == int(layout.anchor_valid.sum()) > 20


def test_inference_equivalence_with_incremental_cache() -> None:
    """Inference that grows its cache in several steps gives the same rows as the training forward."""
    target = tiny_llama(seed=2, **TARGET)
    head = tiny_head(target, draft_length=5, seed=4)
    states = TargetModel(target)
    input_ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(9))
    layout = build_layout(torch.ones(1, 30, dtype=torch.bool), 5)
    aux, _ = states.states(input_ids)
    with torch.no_grad():
        logits = draft_forward(head, aux, input_ids, layout, use_flex=False)
    cache = DraftKVCache()
    done = 0
    for end in (6, 7, 13, 20):  # prefix 0..end-1, appended in chunks
        ref = head.draft_step(aux[:, done:end], input_ids[:, done + 1 : end + 1], cache)
        done = end
        a = layout.anchors[0].tolist().index(end - 1)
        torch.testing.assert_close(logits[0, a], ref, rtol=1e-5, atol=1e-5)


def test_flex_block_mask_equals_dense_on_cpu() -> None:
    target = tiny_llama(**TARGET)
    head = tiny_head(target, draft_length=4)
    input_ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.zeros(2, 40, dtype=torch.bool)
    loss_mask[0, 10:40] = True
    loss_mask[1, 3:25] = True
    layout = build_layout(loss_mask, 4)
    aux, _ = TargetModel(target).states(input_ids)
    dense = layout.dense_mask()
    from torch.nn.attention.flex_attention import create_mask

    flex_dense = create_mask(layout.mask_mod, 2, 1, layout.num_slots, layout.num_slots, device="cpu")
    assert torch.equal(flex_dense, dense)
    with torch.no_grad():
        a = draft_forward(head, aux, input_ids, layout, use_flex=False)
        b = draft_forward(head, aux, input_ids, layout, use_flex=True)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _hand_kl(p_target_full: torch.Tensor, q_logits: torch.Tensor, draft_ids: list[int]) -> float:
    p = p_target_full[draft_ids]
    p = p / p.sum()
    q = torch.softmax(q_logits, -1)
    return float(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p.tolist(), q.tolist(), strict=True) if pi > 0))


def test_loss_equals_hand_computed_kl_full_and_topk() -> None:
    torch.manual_seed(0)
    vocab, draft_vocab, d, seq_len = 12, 5, 2, 6
    draft_ids = [1, 3, 4, 7, 10]
    d2t = torch.tensor(draft_ids) - torch.arange(draft_vocab)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    layout = build_layout(loss_mask, d)
    # anchors 0..3: rows predict x_{t+2+j}; valid: (0:[T,T]) (1:[T,T]) (2:[T,F]) (3:[F,F]→ not anchor)
    assert layout.anchors.tolist() == [[0, 1, 2]]
    target_logits = torch.randn(1, seq_len, vocab)
    target_logprobs = F.log_softmax(target_logits, -1)
    draft_logits = torch.randn(1, 3, d, draft_vocab, requires_grad=True)
    gamma = 0.6
    out = annealed_kl_loss(draft_logits, layout, d2t, target_logprobs=target_logprobs, gamma=gamma)
    expected = 0.0
    p_full = target_logprobs.exp()[0]
    for a, t in enumerate([0, 1, 2]):
        for j in range(d):
            if layout.row_valid[0, a, j]:
                expected += gamma**j * _hand_kl(p_full[t + 1 + j], draft_logits[0, a, j].detach(), draft_ids)
    expected /= 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    out.loss.backward()
    assert draft_logits.grad is not None and draft_logits.grad.abs().sum() > 0
    assert out.rows.tolist() == [3.0, 2.0]

    # Top-k with k = full vocab gives the same loss; a smaller k drops the mass outside it.
    topk = target_logprobs.topk(vocab, dim=-1)
    out_k = annealed_kl_loss(
        draft_logits, layout, d2t, target_logprobs=topk.values, target_ids=topk.indices, gamma=gamma
    )
    assert out_k.loss.item() == pytest.approx(expected, rel=1e-5)
    top3 = target_logprobs.topk(3, dim=-1)
    out_3 = annealed_kl_loss(draft_logits, layout, d2t, target_logprobs=top3.values, target_ids=top3.indices, gamma=gamma)
    expected3, anchors_rows = 0.0, 0
    for a, t in enumerate([0, 1, 2]):
        for j in range(d):
            if not layout.row_valid[0, a, j]:
                continue
            pos = t + 1 + j
            kept = [i for i in top3.indices[0, pos].tolist() if i in draft_ids]
            if not kept:
                continue
            anchors_rows += 1
            p = p_full[pos][kept] / p_full[pos][kept].sum()
            q = torch.log_softmax(draft_logits[0, a, j].detach(), -1)
            expected3 += gamma**j * float(sum(pi * (math.log(pi) - q[draft_ids.index(k)]) for pi, k in zip(p.tolist(), kept, strict=True)))
    expected3 /= 3
    assert out_3.loss.item() == pytest.approx(expected3, rel=1e-5, abs=1e-7)


def test_gamma_weights_positions() -> None:
    torch.manual_seed(1)
    vocab, d = 9, 3
    d2t = torch.zeros(vocab, dtype=torch.long)
    layout = build_layout(torch.tensor([[0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool), d)
    logprobs = F.log_softmax(torch.randn(1, 7, vocab), -1)
    logits = torch.randn(1, layout.num_anchors, d, vocab)
    per_pos = annealed_kl_loss(logits, layout, d2t, target_logprobs=logprobs, gamma=1.0).kl_sum
    for gamma in (0.0, 0.5, 0.6):
        out = annealed_kl_loss(logits, layout, d2t, target_logprobs=logprobs, gamma=gamma)
        want = sum(gamma**j * per_pos[j] for j in range(d)) / layout.num_anchors
        assert out.loss.item() == pytest.approx(float(want), rel=1e-6)


def test_alpha_counts_argmax_matches_in_target_ids() -> None:
    vocab, draft_vocab, d = 6, 3, 2
    draft_ids = torch.tensor([0, 2, 5])
    d2t = draft_ids - torch.arange(draft_vocab)
    layout = build_layout(torch.tensor([[0, 0, 1, 1]], dtype=torch.bool), d)  # anchors 0, 1
    logprobs = torch.full((1, 4, vocab), -10.0)
    logprobs[0, 1, 2] = 0.0  # target argmax at pos 1 → token 2 (draft id 1)
    logprobs[0, 2, 4] = 0.0  # at pos 2 → token 4: outside the draft vocab, never matched
    logprobs[0, 3, 5] = 0.0
    logits = torch.full((1, 2, d, draft_vocab), -5.0)
    logits[0, 0, 0, 1] = 5.0  # anchor 0 row 0 (label pos 1) → target 2: correct
    logits[0, 0, 1, 2] = 5.0  # anchor 0 row 1 (label pos 2) → target 5 ≠ 4
    logits[0, 1, 0, 2] = 5.0  # anchor 1 row 0 (label pos 2) → target 5 ≠ 4
    out = annealed_kl_loss(logits, layout, d2t, target_logprobs=logprobs)
    assert out.rows.tolist() == [2.0, 1.0]
    assert out.alpha.tolist() == [0.5, 0.0]


def test_target_to_draft_index_round_trip() -> None:
    ids = torch.tensor([0, 4, 5, 9])
    d2t = ids - torch.arange(4)
    index = target_to_draft_index(d2t, 10)
    assert index.tolist() == [0, -1, -1, -1, 1, 2, -1, -1, -1, 3]
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        target_to_draft_index(d2t, 9)


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="draft_length"):
        build_layout(torch.ones(1, 4, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match=r"\[B,T\]"):
        build_layout(torch.ones(4, dtype=torch.bool), 2)
    layout = build_layout(torch.ones(1, 6, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="d2t"):
        annealed_kl_loss(
            torch.zeros(1, layout.num_anchors, 2, 5), layout, torch.zeros(4, dtype=torch.long),
            target_logprobs=torch.zeros(1, 6, 5),
        )
