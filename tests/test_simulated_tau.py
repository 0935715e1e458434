"""The training-time τ is honest: with the target's own greedy answers, simulated τ predicts what
serving measures, for the paper's search and for the CPU serving tree (context n-grams + copy spans)."""

from __future__ import annotations

import torch
from helpers import tiny_llama

from dart_infer.decoding.dart_model import DartModel
from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel
from dart_infer.target.adapter import TargetModel
from dart_infer.tree.settings import TreeSearchSettings
from dart_train.data.dataset import TokenizedDataset
from dart_train.states.online import OnlineStateSource
from dart_train.trainer.simulated_tau import SimulatedTau

VOCAB = 64
# The CPU serving tree's extras on the paper's search (tests/test_train_engine.py covers the plain one).
SERVED = {"draft_top_k": 8, "beam_width": 4, "remain_total": 12, "context_ngram_weight": 0.3,
          "copy_span_tokens": 6, "copy_span_min_match": 2}


def greedy_answers(dart: DartModel, target: TargetModel, count: int, new_tokens: int):
    """The target's own greedy answers to random prompts, decoded by DART (checked equal to generate),
    with DART's acceptance per step: (sequences, [(sequence, anchor t, accepted)], tokens, steps)."""
    sequences, steps, emitted_total, step_count = [], [], 0, 0
    for i in range(count):
        prompt = torch.randint(3, VOCAB, (6 + i,), generator=torch.Generator().manual_seed(40 + i))
        out, stats = dart.dart_generate(prompt, max_new_token_num=new_tokens, return_stats=True)
        ref = target.model.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False,
                                    min_new_tokens=new_tokens)
        if out.shape[1] < ref.shape[1]:
            continue  # stopped at EOS
        assert torch.equal(out[0], ref[0])
        mask = torch.zeros(out.shape[1], dtype=torch.bool)
        mask[prompt.numel():] = True
        sequences.append({"input_ids": out[0], "loss_mask": mask})
        history = prompt.numel() + 1
        for accepted, emitted in zip(stats.accept_lengths, stats.emitted, strict=True):
            steps.append((len(sequences) - 1, history - 2, accepted))
            history += emitted
        emitted_total += sum(stats.emitted)
        step_count += len(stats.emitted)
    return sequences, steps, emitted_total, step_count


def test_simulated_tau_predicts_served_tau_with_the_serving_tree() -> None:
    target = TargetModel(tiny_llama(seed=0, vocab_size=VOCAB))
    torch.manual_seed(11)
    head = DartDraftModel(DartDraftConfig.from_target_config(target.model.config, draft_length=4,
                                                             draft_vocab_size=VOCAB)).eval()
    dart = DartModel(target.model, head, tree=TreeSearchSettings(**SERVED))
    sequences, steps, tokens, step_count = greedy_answers(dart, target, count=6, new_tokens=48)
    assert len(sequences) >= 3
    evaluator = SimulatedTau(
        TokenizedDataset(sequences), OnlineStateSource(target, topk=None, hidden_dtype=torch.float32),
        eos_token_id=int(target.model.config.eos_token_id), tree=SERVED, anchors_per_sequence=10_000, batch_size=2,
    )
    # Per decoding state: the served tree's simulated acceptance is exactly what DART accepted there.
    results, _ = evaluator.anchor_results(head)
    by_anchor = {(r[0], r[1]): r[2] for r in results}
    compared = [(by_anchor[(i, t)], accepted) for i, t, accepted in steps
                if (i, t) in by_anchor and t + 2 + 4 + SERVED["copy_span_tokens"] <= sequences[i]["input_ids"].numel()]
    assert len(compared) >= 20 and all(sim == real for sim, real in compared), compared
    # Walked like decoding (every state evaluated): within 10% of served τ, tokens per step. The plain
    # mean over states weighs every state alike and over-counts long accepted runs, so it is no predictor.
    summary = evaluator(head)
    served_tau = tokens / step_count
    assert abs(summary["tau_served_walk"] - served_tau) <= 0.10 * served_tau, (summary, served_tau)
    assert summary["tau_served"] > 1.2 * served_tau
    # The headline is the paper's search alone, labelled apart from the served tree's τ.
    paper = SimulatedTau(
        TokenizedDataset(sequences), OnlineStateSource(target, topk=None, hidden_dtype=torch.float32),
        eos_token_id=int(target.model.config.eos_token_id), anchors_per_sequence=10_000, batch_size=2,
        tree={k: v for k, v in SERVED.items() if not k.startswith(("context", "copy"))},
    )(head)
    assert summary["tau"] == paper["tau"] and "tau_served" not in paper
    assert summary["tau_served"] > summary["tau"]  # the extras accept more on the target's repetitive text


def test_compare_head_goes_through_the_same_evaluation(tmp_path) -> None:
    """`train_eval.compare_head`: a saved head, loaded by name like the shipped one, gets exactly the
    τ the evaluator gives that head in memory (same data, anchors, tree and target embedding)."""
    from dart_train.builders import evaluate_other_head

    target = TargetModel(tiny_llama(seed=0, vocab_size=VOCAB))
    torch.manual_seed(12)
    head = DartDraftModel(DartDraftConfig.from_target_config(target.model.config, draft_length=4,
                                                             draft_vocab_size=VOCAB)).eval()
    head.set_target_embedding(target.embedding_weight)
    head.save_pretrained(tmp_path / "head")
    sequences = [{"input_ids": torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(i)),
                  "loss_mask": torch.arange(30) >= 8} for i in range(3)]
    evaluator = SimulatedTau(
        TokenizedDataset(sequences), OnlineStateSource(target, topk=None, hidden_dtype=torch.float32),
        eos_token_id=int(target.model.config.eos_token_id), tree=SERVED, batch_size=2,
    )
    other = evaluate_other_head(evaluator, str(tmp_path / "head"), head)
    assert other["head"] == str(tmp_path / "head")
    assert {k: other[k] for k in ("tau", "tau_served", "alpha_1")} == {k: evaluator(head)[k] for k in ("tau", "tau_served", "alpha_1")}
