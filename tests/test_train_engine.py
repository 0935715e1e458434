"""DeepSpeed engine: training lowers the loss, exact resume after a kill, rotation, export, ZeRO stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import ENGINE_VOCAB, losses, make_head, make_trainer

from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel
from dart_train.data.batching import LengthBucketBatchSampler
from dart_train.data.dataset import TokenizedDataset
from dart_train.states.online import OnlineStateSource
from dart_train.trainer.engine import TrainSettings, cosine_with_warmup


def test_cosine_with_warmup_shape() -> None:
    f = cosine_with_warmup(total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0)
    assert f(2) == pytest.approx(1.0)
    assert f(10) == pytest.approx(0.1)
    values = [f(s) for s in range(2, 11)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_exact_resume_after_kill(tiny_target, tiny_dataset, tmp_path: Path) -> None:
    full = make_trainer(tiny_target, tiny_dataset, tmp_path / "full")
    full.train()
    reference = losses(tmp_path / "full")
    assert len(reference) == 6

    # Kill the run in the middle of step 6 (after the step-4 checkpoint and step 5's metrics line,
    # with one micro-batch of step 6 already consumed), then resume in a fresh trainer from disk.
    part_dir = tmp_path / "part"
    first = make_trainer(tiny_target, tiny_dataset, part_dir)
    source, calls = first.state_source, []

    def dying_source(batch):
        calls.append(1)
        if len(calls) == 5 * 2 + 2:  # second micro-batch of step 6 (grad_accum=2)
            raise KeyboardInterrupt("killed")
        return source(batch)

    first.state_source = dying_source
    with pytest.raises(KeyboardInterrupt):
        first.train()
    assert first.latest_tag() == "step_00000004"
    assert len(losses(part_dir)) == 5
    second = make_trainer(tiny_target, tiny_dataset, part_dir)
    assert second.resume()
    assert second.step == 4
    # Step 5 was logged after the checkpoint: moved aside (not lost), so no step appears twice.
    (dropped,) = part_dir.glob("metrics.dropped-00000004-*.jsonl")
    assert [json.loads(line)["step"] for line in dropped.read_text().splitlines()] == [5]
    assert len(losses(part_dir)) == 4
    second.train()
    resumed = losses(part_dir)
    assert resumed[:4] == reference[:4]
    assert resumed[4:] == reference[4:], (resumed, reference)
    steps = [json.loads(line)["step"] for line in (part_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]

    # keep-last-N rotation and the exported head
    tags = sorted(p.name for p in (part_dir / "checkpoints").glob("step_*"))
    assert tags == ["step_00000004", "step_00000006"]
    assert (part_dir / "checkpoints" / "step_00000006" / "rank_state_00000.pt").is_file()
    head = DartDraftModel.from_pretrained(part_dir / "head")
    full_head = DartDraftModel.from_pretrained(tmp_path / "full" / "head")
    for (k, a), (_, b) in zip(head.state_dict().items(), full_head.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("stage", [0, 2])
def test_resume_applies_changed_optimizer_settings(tiny_target, tiny_dataset, tmp_path: Path, caplog, stage: int) -> None:
    make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=2, zero_stage=stage).train()  # checkpoint at 2, lr 3e-3
    changed = make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=6, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1,
                           eps=1e-6, warmup_steps=1, zero_stage=stage)
    with caplog.at_level("WARNING", logger="dart_train.trainer.engine"):
        assert changed.resume()
    schedule = cosine_with_warmup(total_steps=6, warmup_steps=1)
    # What the torch AdamW inside DeepSpeed (ZeRO wraps it) reads at its next step: this run's values,
    # the LR at step 2 of the new schedule.
    assert isinstance(changed.engine.basic_optimizer, torch.optim.AdamW)
    for group in changed.engine.basic_optimizer.param_groups:
        assert group["lr"] == pytest.approx(1e-3 * schedule(2))
        assert (group["betas"], group["weight_decay"], group["eps"]) == ((0.8, 0.99), 0.1, 1e-6)
    assert "resume: optim.lr: 0.003 -> 0.001" in caplog.text
    assert "optim.betas: (0.9, 0.999) -> (0.8, 0.99)" in caplog.text and "trainer.max_steps: 2 -> 6" in caplog.text
    changed.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in rows[2:]] == pytest.approx([1e-3 * schedule(k) for k in range(3, 7)])
    # Unchanged settings: resuming gives back the checkpoint's own optimiser values.
    again = make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=6, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1,
                         eps=1e-6, warmup_steps=1, zero_stage=stage)
    assert again.resume() and again.step == 6
    assert again.engine.basic_optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * schedule(6))


def test_resume_without_a_checkpoint_starts_the_metrics_again(tiny_target, tiny_dataset, tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')  # killed at step 2
    trainer = make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=2)
    assert not trainer.resume()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    (dropped,) = tmp_path.glob("metrics.dropped-00000000-*.jsonl")
    assert dropped.read_text().startswith('{"step": 1, "loss": 9.0}')
    trainer.train()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_resume_refuses_settings_a_checkpoint_cannot_continue_with(tiny_target, tiny_dataset, tmp_path: Path) -> None:
    from dart_train.trainer.engine import ResumeError

    make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=2).train()
    with pytest.raises(ResumeError, match=r"resume with trainer.zero_stage=0"):
        make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=4, zero_stage=2).resume()
    with pytest.raises(ResumeError, match=r"trainer.grad_accum: the checkpoint has 2, this run 1"):
        make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=4, grad_accum=1).resume()
    assert make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=4).resume()  # as saved: fine


def test_training_reduces_loss_and_export_has_author_keys(tiny_target, tiny_dataset, tmp_path: Path) -> None:
    trainer = make_trainer(
        tiny_target, tiny_dataset, tmp_path, lr=1e-2, max_steps=40, grad_accum=1, save_every=None, max_anchors=None
    )
    first_params = {k: v.clone() for k, v in trainer.draft_model.named_parameters()}
    trainer.train()
    curve = losses(tmp_path)
    assert sum(curve[-5:]) / 5 < 0.8 * sum(curve[:5]) / 5
    # Only the head's own parameters were trained; the target and its embedding are untouched.
    assert all(not p.requires_grad for p in tiny_target.model.parameters())
    changed = [k for k, v in trainer.draft_model.named_parameters() if not torch.equal(v, first_params[k])]
    assert "fc.weight" in changed and "midlayer.mask_rep" in changed
    from safetensors import safe_open

    with safe_open(str(tmp_path / "head" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and "midlayer.mask_rep" in keys and "d2t" in keys and "t2d" in keys
    assert not any("embed_tokens" in k for k in keys)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    # On disk draft_length counts mask positions, as in the authors' config.json (d - 1).
    assert config["draft_length"] == 3 and config["draft_vocab_size"] == 48
    from dart_infer.methods.loading import load_draft_model

    assert load_draft_model(tmp_path / "head").config.draft_length == 4


def test_best_checkpoint_follows_tau(tiny_target, tiny_dataset, tmp_path: Path) -> None:
    taus = iter([1.5, 2.5, 2.0])
    # Evaluations at steps 1-3, checkpoints only at 3: best/ does not depend on the checkpoint cadence.
    trainer = make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=3, grad_accum=1, save_every=None, keep_last=1)
    trainer.settings.eval_every = 1
    trainer.evaluator = lambda model: {"tau": next(taus)}
    trainer.train()
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best == {"tau": 2.5, "step": 2}
    assert (tmp_path / "best" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000003"]


@pytest.fixture(scope="module")
def stage0_head(tiny_target, tiny_dataset, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The head after 3 steps of plain data-parallel training (ZeRO stage 0): the reference."""
    run = tmp_path_factory.mktemp("stage0")
    make_trainer(tiny_target, tiny_dataset, run, max_steps=3, grad_accum=1).train()
    return DartDraftModel.from_pretrained(run / "head").state_dict()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_give_the_weights_of_stage_0(tiny_target, tiny_dataset, stage0_head, tmp_path: Path, stage: int) -> None:
    from dart_train.trainer.simulated_tau import SimulatedTau

    trainer = make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=3, grad_accum=1, zero_stage=stage)
    # The evaluator runs outside the engine's forward: under ZeRO-3 it needs the gathered weights.
    trainer.evaluator = SimulatedTau(
        TokenizedDataset(tiny_dataset.sequences[:2]), OnlineStateSource(tiny_target, topk=8, hidden_dtype=torch.float32),
        eos_token_id=2, tree={"draft_top_k": 4, "beam_width": 4, "remain_total": 8}, anchors_per_sequence=4,
    )
    trainer.train()
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 3
    initial = make_head(tiny_target, tiny_dataset).state_dict()
    trained = DartDraftModel.from_pretrained(tmp_path / "head").state_dict()
    assert trained.keys() == stage0_head.keys()
    moved = 0
    for key, reference in stage0_head.items():
        torch.testing.assert_close(trained[key], reference, rtol=1e-5, atol=1e-6, msg=key)
        moved += not torch.equal(reference, initial[key]) if key in initial else 0
    assert moved >= 5  # the reference did train (fc, mask_rep, norms, attention, lm_head ...)


def test_zero3_bf16_trains_close_to_fp32(tiny_target, tiny_dataset, stage0_head, tmp_path: Path) -> None:
    """bf16 weights (DeepSpeed's bf16 optimiser with fp32 master weights) under ZeRO-3: each weight's
    update follows stage 0's fp32 one up to bf16 rounding."""
    make_trainer(tiny_target, tiny_dataset, tmp_path, max_steps=3, grad_accum=1, zero_stage=3, bf16=True).train()
    initial = make_head(tiny_target, tiny_dataset).state_dict()
    trained = DartDraftModel.from_pretrained(tmp_path / "head").state_dict()
    for key in ("fc.weight", "midlayer.mask_rep", "lm_head.weight"):
        fp32_update = stage0_head[key].float() - initial[key].float()
        bf16_update = trained[key].float() - initial[key].float()
        cosine = torch.nn.functional.cosine_similarity(fp32_update.flatten(), bf16_update.flatten(), dim=0)
        assert cosine > 0.9, (key, float(cosine))


def test_time_budget_ends_the_run_at_a_step_and_a_resume_gets_a_fresh_one(
    tiny_target, tiny_dataset, tmp_path: Path, monkeypatch, caplog
) -> None:
    """trainer.max_minutes: the run ends at the step that reaches it, as at max_steps (checkpoint, head,
    summary saying why); a resume continues exactly with a fresh budget, on max_steps' LR schedule; a
    resume with no step left keeps the finished run's summary.json and head byte for byte."""
    from dart_train.trainer import engine

    make_trainer(tiny_target, tiny_dataset, tmp_path / "full").train()  # 6 steps, no budget: the reference
    # The clock the loop reads, moved by the data: a micro-batch takes 30 s, a step (grad_accum=2) 1 minute.
    now = [1000.0]
    monkeypatch.setattr(engine, "_clock", lambda: now[0])
    run = tmp_path / "budget"

    def budgeted():
        trainer = make_trainer(tiny_target, tiny_dataset, run, max_minutes=1.5, save_every=None)
        source = trainer.state_source

        def slow_source(batch):
            now[0] += 30.0
            return source(batch)

        trainer.state_source = slow_source
        return trainer

    summary = budgeted().train()  # 1 minute after step 1, 2 after step 2: ends at step 2 of 6
    assert summary == json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["total_steps"], summary["stopped_on"]) == (2, 6, "time_budget")
    assert (summary["max_minutes"], summary["minutes"]) == (1.5, 2.0) and summary["final_loss"] is not None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and summary["tokens"] == sum(r["tokens"] for r in rows) > 0
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]  # save_every=None
    assert (run / "head" / "model.safetensors").is_file()

    second = budgeted()
    assert second.resume() and second.step == 2
    assert second.train()["steps"] == 4  # a fresh budget: counted from this train(), not the first run's
    third = budgeted()
    assert third.resume() and third.step == 4
    assert third.train()["stopped_on"] == "max_steps"  # step 6 comes first
    # Exactly the uninterrupted run: the same losses, and the LR schedule of max_steps (not rescaled).
    full = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    budget = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["lr"]) for r in budget] == [(r["step"], r["loss"], r["lr"]) for r in full]

    # Resumed with no step left: nothing trained, the finished run's summary and head kept as they are.
    kept = (run / "summary.json").read_bytes()
    head = run / "head" / "model.safetensors"
    head_bytes, head_mtime = head.read_bytes(), head.stat().st_mtime_ns
    finished = budgeted()
    assert finished.resume() and finished.step == 6
    with caplog.at_level("WARNING", logger="dart_train.trainer.engine"):
        again = finished.train()
    assert (run / "summary.json").read_bytes() == kept and again == json.loads(kept)
    assert head.read_bytes() == head_bytes and head.stat().st_mtime_ns == head_mtime
    assert "already finished at step 6" in caplog.text


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="zero_stage"):
        TrainSettings(zero_stage=4)
    with pytest.raises(ValueError, match="grad_accum"):
        TrainSettings(grad_accum=0)
    for minutes in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="max_minutes must be >= 0"):
            TrainSettings(max_minutes=minutes)
    assert TrainSettings(max_minutes=0).max_minutes is None and TrainSettings(max_minutes=2).max_minutes == 2.0


# ------------------------------------------------------------------------------ simulated τ (evaluate)


def test_accepted_length_on_a_hand_built_tree() -> None:
    from dart_train.trainer.simulated_tau import accepted_length

    # root(0) → 1:[5] → 3:[7] ; root → 2:[6] → 4:[8] → 5:[9]
    tokens = torch.tensor([1, 5, 6, 7, 8, 9])
    retrieve = torch.tensor([[0, 1, 3, -1], [0, 2, 4, 5]])
    assert accepted_length(tokens, retrieve, [5, 7, 1]) == 2
    assert accepted_length(tokens, retrieve, [6, 8, 9, 3]) == 3
    assert accepted_length(tokens, retrieve, [6, 8]) == 2  # reference shorter than the path
    assert accepted_length(tokens, retrieve, [4]) == 0


def test_simulated_tau_matches_dart_generate_on_greedy_data(tiny_target) -> None:
    """On target-greedy data, simulated acceptance per anchor == DartModel's acceptance at that step."""
    from dart_infer.decoding.dart_model import DartModel
    from dart_infer.tree.settings import TreeSearchSettings
    from dart_train.trainer.simulated_tau import SimulatedTau

    torch.manual_seed(11)
    cfg = DartDraftConfig.from_target_config(tiny_target.model.config, draft_length=4, draft_vocab_size=ENGINE_VOCAB)
    head = DartDraftModel(cfg).eval()  # random head; the small vocab makes deep acceptances common
    tree = {"draft_top_k": 25, "beam_width": 20, "remain_total": 60}
    dart = DartModel(tiny_target.model, head, tree=TreeSearchSettings(**tree))  # the same tree as simulated τ
    sequences, steps = [], []
    for i in range(4):
        prompt = torch.randint(3, ENGINE_VOCAB, (6 + i,), generator=torch.Generator().manual_seed(20 + i))
        out, stats = dart.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        ref = tiny_target.model.generate(prompt[None], max_new_tokens=40, do_sample=False, min_new_tokens=40)
        seq = out[0]
        if seq.numel() < ref.shape[1]:
            continue  # stopped at EOS: the plain-generate reference is longer
        assert torch.equal(seq, ref[0])
        mask = torch.zeros(seq.numel(), dtype=torch.bool)
        mask[prompt.numel() :] = True
        sequences.append({"input_ids": seq, "loss_mask": mask})
        history = prompt.numel() + 1  # prompt + the prefill's root
        for accepted, emitted in zip(stats.accept_lengths, stats.emitted, strict=True):
            steps.append((len(sequences) - 1, history - 2, accepted))
            history += emitted
    assert len(sequences) >= 2
    dataset = TokenizedDataset(sequences)
    evaluator = SimulatedTau(
        dataset, OnlineStateSource(tiny_target, topk=None, hidden_dtype=torch.float32),
        eos_token_id=int(tiny_target.model.config.eos_token_id), tree=tree, anchors_per_sequence=10_000, batch_size=2,
    )
    results, _ = evaluator.anchor_results(head)
    by_anchor = {(r[0], r[1]): r for r in results}
    compared = 0
    for index, t, accepted in steps:
        if t + 2 + 4 > sequences[index]["input_ids"].numel() or (index, t) not in by_anchor:
            continue  # the data ends inside this step's window
        _, _, data_acc, target_acc = by_anchor[(index, t)]
        assert data_acc == accepted, (index, t)
        assert target_acc == accepted, (index, t)
        compared += 1
    assert compared >= 10
    assert any(a > 1 for _, _, a in steps)
    summary = evaluator(head)
    assert summary["tau"] == summary["tau_data"] > 1.0


def test_head_autocast_runs_the_forward_in_bf16_and_keeps_fp32_weights(tiny_target, tiny_dataset, tmp_path: Path) -> None:
    plain = make_trainer(tiny_target, tiny_dataset, tmp_path / "fp32", max_steps=2)
    mixed = make_trainer(tiny_target, tiny_dataset, tmp_path / "bf16", max_steps=2, autocast_dtype="bfloat16")
    assert mixed.ds_config["torch_autocast"]["enabled"] and not plain.ds_config["torch_autocast"]["enabled"]
    batch = next(iter(plain.loader))
    seen = []
    hook = mixed.draft_model.fc.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    a, _ = plain._micro_step(batch)
    b, _ = mixed._micro_step(batch)
    hook.remove()
    assert seen == [torch.bfloat16]  # the head's matmuls ran in bf16 ...
    assert all(p.dtype == torch.float32 for p in mixed.draft_model.parameters())  # ... on fp32 weights
    assert float(a.loss) != float(b.loss) and float(b.loss) == pytest.approx(float(a.loss), rel=2e-2)
    with pytest.raises(ValueError, match="exclude each other"):
        TrainSettings(bf16=True, autocast_dtype="bfloat16")


def test_compiled_flex_attention_gives_the_dense_mask_logits(tiny_target, tiny_dataset) -> None:
    """The kernel GPU training runs BlockMask attention through (the engine turns it on on CUDA):
    compiled flex_attention, here on CPU and forward only (its CPU backward does not exist), gives
    the logits of the exact dense mask."""
    import dart_infer.methods.dart.model as model_module
    from dart_train.data.batching import collate
    from dart_train.objectives import build_layout, draft_forward

    head = make_head(tiny_target, tiny_dataset).eval()
    batch = collate([tiny_dataset[i] for i in range(3)])
    states = OnlineStateSource(tiny_target, topk=16, hidden_dtype=torch.float32)(batch)
    layout = build_layout(batch["loss_mask"], head.config.draft_length)
    with torch.no_grad():
        dense = draft_forward(head, states["aux_hidden"], batch["input_ids"], layout, use_flex=False)
        try:
            model_module.use_compiled_flex_attention()
            assert model_module._compiled_flex is not None
            flex = draft_forward(head, states["aux_hidden"], batch["input_ids"], layout, use_flex=True)
        finally:
            model_module.use_compiled_flex_attention(False)  # other tests run eager flex
    valid = layout.row_valid
    torch.testing.assert_close(flex[valid], dense[valid], rtol=1e-4, atol=1e-4)


def test_memory_estimate_matches_the_layout_of_the_largest_batch(tiny_target, tiny_dataset) -> None:
    from dart_train.data.batching import collate
    from dart_train.objectives import build_layout
    from dart_train.trainer.engine import estimate_step_memory

    head = make_head(tiny_target, tiny_dataset)
    sampler = LengthBucketBatchSampler(tiny_dataset.lengths, batch_size=3, seed=5)
    loss_tokens = [int(s["loss_mask"].sum()) for s in tiny_dataset.sequences]
    estimate = estimate_step_memory(sampler.batches(0), tiny_dataset.lengths, loss_tokens, draft_config=head.config,
                                    max_anchors=6, compiled_flex=False)
    # Recompute the largest batch's layout the way training builds it.
    def alone(batch):
        return estimate_step_memory([batch], tiny_dataset.lengths, loss_tokens, draft_config=head.config, max_anchors=6,
                                    compiled_flex=False).total

    largest = max(sampler.batches(0), key=alone)
    assert len({alone(b) for b in sampler.batches(0)}) > 1  # the batches differ: picking the largest matters
    batch = collate([tiny_dataset[i] for i in largest])
    layout = build_layout(batch["loss_mask"], head.config.draft_length, max_anchors=6,
                          generator=torch.Generator().manual_seed(0))
    assert (estimate.rows, estimate.slots, estimate.anchors) == (len(largest), layout.num_slots, layout.num_anchors)
    mask = layout.dense_mask()
    assert estimate.attention >= mask.numel() * mask.element_size()
    heads = head.config.num_attention_heads
    assert estimate.attention == 2 * len(largest) * heads * layout.num_slots**2 * 4 + mask.numel()
    assert "dense-mask attention" in estimate.describe()
    # Compiled flex attention: linear in slots; the dense mask: quadratic.
    long = [[0]]
    for lengths in ([1024], [4096]):
        dense = estimate_step_memory(long, lengths, [64], draft_config=head.config, max_anchors=64, compiled_flex=False)
        flex = estimate_step_memory(long, lengths, [64], draft_config=head.config, max_anchors=64, compiled_flex=True)
        assert flex.attention < dense.attention / 10
        if lengths == [1024]:
            first = (dense.attention, flex.attention)
    assert 12 < dense.attention / first[0] < 17 and 3 < flex.attention / first[1] < 5
