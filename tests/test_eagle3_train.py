"""EAGLE-3's training-time test equals the inference draft loop step by step; the loss is DART's."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from transformers import LlamaForCausalLM

from dart_infer.methods.eagle3 import Eagle3DraftConfig, Eagle3DraftModel, chain_logits
from dart_infer.target.adapter import TargetModel
from dart_train.objectives import annealed_kl_loss, build_layout, draft_forward

VOCAB = 97
DRAFT_VOCAB = 40
TARGET = dict(vocab_size=VOCAB, max_position_embeddings=256, attn_implementation="sdpa")  # tiny_llama fields


def tiny_eagle3(
    target: LlamaForCausalLM, ttt_length: int = 7, seed: int = 1, norm_before_residual: bool = False
) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    cfg = Eagle3DraftConfig.from_target_config(
        target.config, draft_vocab_size=DRAFT_VOCAB, ttt_length=ttt_length, norm_before_residual=norm_before_residual
    )
    head = Eagle3DraftModel(cfg).eval()
    head.set_target_embedding(target.get_input_embeddings().weight)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].sort().values
    head.set_vocab_mapping(ids)
    with torch.no_grad():  # non-trivial norms: every weight matters
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


@pytest.mark.parametrize(("ttt_length", "norm_before_residual"), [(1, False), (3, False), (7, False), (7, True)])
def test_ttt_forward_equals_the_inference_loop_step_by_step(ttt_length: int, norm_before_residual: bool) -> None:
    target = tiny_llama(**TARGET)
    head = tiny_eagle3(target, ttt_length, norm_before_residual=norm_before_residual)
    states = TargetModel(target, head.config.aux_layer_ids)
    lengths = [23, 17]
    input_ids = torch.randint(0, VOCAB, (2, max(lengths)), generator=torch.Generator().manual_seed(5))
    loss_mask = torch.zeros(2, max(lengths), dtype=torch.bool)
    loss_mask[0, 4:23] = True
    loss_mask[1, 2:9] = True
    loss_mask[1, 11:17] = True
    aux, _ = states.states(input_ids)
    layout = build_layout(loss_mask, ttt_length)
    with torch.no_grad():
        logits = draft_forward(head, aux, input_ids, layout)
    assert logits.shape[2:] == (ttt_length, DRAFT_VOCAB)
    checked = deepest = 0
    for b in range(2):
        for a in range(layout.num_anchors):
            if not layout.anchor_valid[b, a]:
                continue
            t = int(layout.anchors[b, a])
            # Inference: prefix 0..t with next tokens x_1..x_{t+1}, then drafted steps fed x_{t+2}, ...
            steps = min(ttt_length, input_ids.shape[1] - 1 - t)
            chain = input_ids[b, t + 2 : t + 1 + steps].tolist()
            ref = chain_logits(head, aux[b : b + 1, : t + 1], input_ids[b : b + 1, 1 : t + 2], chain)
            torch.testing.assert_close(logits[b, a, :steps], ref, rtol=1e-5, atol=1e-5)
            checked += steps
            deepest = max(deepest, steps)
    assert checked >= int(layout.anchor_valid.sum()) > 20 and deepest == ttt_length


def test_packed_documents_ttt_equals_each_document_alone() -> None:
    """Packed rows (positions restart, documents never see each other) give each document's rows."""
    target = tiny_llama(seed=2, **TARGET)
    head = tiny_eagle3(target, 4, seed=4)
    states = TargetModel(target, head.config.aux_layer_ids)
    gen = torch.Generator().manual_seed(7)
    first, second = torch.randint(0, VOCAB, (1, 12), generator=gen), torch.randint(0, VOCAB, (1, 9), generator=gen)
    packed = torch.cat([first, second], dim=1)
    position_ids = torch.cat([torch.arange(12), torch.arange(9)])[None]
    document_ids = torch.cat([torch.zeros(12), torch.ones(9)]).long()[None]
    aux, _ = states.states(packed, position_ids=position_ids)
    layout = build_layout(torch.ones_like(packed, dtype=torch.bool), 4, position_ids=position_ids,
                          document_ids=document_ids)
    with torch.no_grad():
        logits = draft_forward(head, aux, packed, layout)
    for start, doc in ((0, first), (12, second)):
        aux_doc, _ = states.states(doc)
        alone = build_layout(torch.ones_like(doc, dtype=torch.bool), 4)
        with torch.no_grad():
            ref = draft_forward(head, aux_doc, doc, alone)
        for a in range(alone.num_anchors):
            t = int(alone.anchors[0, a])
            packed_a = layout.anchors[0].tolist().index(start + t)
            valid = alone.row_valid[0, a]
            torch.testing.assert_close(logits[0, packed_a][valid], ref[0, a][valid], rtol=1e-5, atol=1e-5)


def test_ttt_loss_trains_the_head_and_reaches_every_step() -> None:
    """Gradients flow into every weight through all steps, and a few AdamW steps lower the loss."""
    target = tiny_llama(**TARGET)
    head = tiny_eagle3(target, 4).train()
    states = TargetModel(target, head.config.aux_layer_ids)
    input_ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    aux, target_logits = states.states(input_ids)
    layout = build_layout(torch.ones_like(input_ids, dtype=torch.bool), 4)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(15):
        out = annealed_kl_loss(draft_forward(head, aux, input_ids, layout), layout, head.d2t,
                               target_logprobs=torch.log_softmax(target_logits, -1), gamma=0.8)
        opt.zero_grad()
        out.loss.backward()
        if not losses:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters() if p.requires_grad)
        opt.step()
        losses.append(float(out.loss.detach()))
    assert out.rows.tolist()[3] > 0 and losses[-1] < 0.8 * losses[0]


def test_simulated_tau_matches_eagle3_generate_on_greedy_data() -> None:
    """On target-greedy data, simulated acceptance per anchor (EAGLE-3's own tree, `anchor_trees`)
    equals serving's acceptance (a `DartModel` with the EAGLE-3 head) at that decoding step."""
    from dart_infer.decoding.dart_model import DartModel
    from dart_train.data.dataset import TokenizedDataset
    from dart_train.states.online import OnlineStateSource
    from dart_train.trainer.simulated_tau import SimulatedTau

    vocab = 16  # a small vocabulary makes deep acceptances common with a random head
    base = tiny_llama(0, **{**TARGET, "vocab_size": vocab})
    base.generation_config.eos_token_id = None
    torch.manual_seed(11)
    head = Eagle3DraftModel(Eagle3DraftConfig.from_target_config(base.config, ttt_length=5)).eval()
    tree = {"top_k": 4, "depth": 4, "total_tokens": 16}
    model = DartModel(base, head, tree=tree)
    sequences, steps = [], []
    for i in range(3):
        prompt = torch.randint(0, vocab, (6 + i,), generator=torch.Generator().manual_seed(20 + i))
        out, stats = model.dart_generate(prompt, max_new_token_num=30, return_stats=True)
        seq = out[0]
        mask = torch.zeros(seq.numel(), dtype=torch.bool)
        mask[prompt.numel() :] = True
        sequences.append({"input_ids": seq, "loss_mask": mask})
        history = prompt.numel() + 1  # prompt + the prefill's root
        for accepted, emitted in zip(stats.accept_lengths, stats.emitted, strict=True):
            steps.append((i, history - 2, accepted))
            history += emitted
    evaluator = SimulatedTau(
        TokenizedDataset(sequences), OnlineStateSource(TargetModel(base, head.config.aux_layer_ids), topk=None,
                                                       hidden_dtype=torch.float32),
        eagle3_tree=tree, anchors_per_sequence=10_000, batch_size=2,
    )
    results, _ = evaluator.anchor_results(head)
    by_anchor = {(r[0], r[1]): r for r in results}
    compared = 0
    for index, t, accepted in steps:
        if t + 2 + 5 > sequences[index]["input_ids"].numel() or (index, t) not in by_anchor:
            continue  # the data ends inside this step's window
        _, _, data_acc, target_acc = by_anchor[(index, t)]
        assert data_acc == accepted == target_acc, (index, t)
        compared += 1
    assert compared >= 10 and any(a > 1 for _, _, a in steps)
