"""Conversation loaders: real embedded data sets, user files, `datasets`, and malformed rows."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dart_infer.data.conversations import (
    Conversation,
    is_heldout,
    load_conversations,
    sharegpt_heldout_ids,
    source_conversation,
)


def _roles(conversation: Conversation) -> list[str]:
    return [m["role"] for m in conversation.messages]


@pytest.fixture(scope="module")
def sharegpt_all() -> list[Conversation]:
    with pytest.warns(UserWarning, match="malformed"):
        return load_conversations("sharegpt")


def test_sharegpt_salvages_the_truncated_file(sharegpt_all: list[Conversation]) -> None:
    assert len(sharegpt_all) >= 17_000
    assert len({c.id for c in sharegpt_all}) == len(sharegpt_all)
    for conversation in sharegpt_all[:500]:
        assert conversation.source == "sharegpt"
        assert set(_roles(conversation)) <= {"system", "user", "assistant"}
        assert all(isinstance(m["content"], str) for m in conversation.messages)


def test_sharegpt_split_is_fixed_and_disjoint(sharegpt_all: list[Conversation]) -> None:
    train = load_conversations("sharegpt", split="train")
    heldout = load_conversations("sharegpt", split="heldout")
    assert len(train) + len(heldout) == len(sharegpt_all)
    assert not {c.id for c in train} & {c.id for c in heldout}
    assert 0.01 < len(heldout) / len(sharegpt_all) < 0.03
    assert all(is_heldout(c.id) for c in heldout)
    assert [c.id for c in load_conversations("sharegpt", split="heldout", limit=5)] == [c.id for c in heldout[:5]]


def _opener(conversation: Conversation) -> str | None:
    user = next((m["content"] for m in conversation.messages if m["role"] == "user"), None)
    return None if user is None else " ".join(user.split())


def test_sharegpt_split_keeps_conversations_and_prompts_on_one_side() -> None:
    train = load_conversations("sharegpt", split="train")
    heldout = load_conversations("sharegpt", split="heldout")
    # Chunks `<conversation>_<n>` of one source conversation never straddle the split ...
    assert not {source_conversation(c.id) for c in train} & {source_conversation(c.id) for c in heldout}
    # ... and no held-out first user turn is also a training conversation's first user turn.
    assert not ({_opener(c) for c in train} & {_opener(c) for c in heldout}) - {None}
    assert {c.id for c in heldout} == sharegpt_heldout_ids(train + heldout)


def test_heldout_split_rules_on_small_data() -> None:
    def conv(cid: str, opener: str) -> Conversation:
        return Conversation(cid, [{"role": "user", "content": opener}, {"role": "assistant", "content": "x"}], "t")

    assert source_conversation("abc_12") == "abc" and source_conversation("a_b") == "a_b"
    assert source_conversation("plain") == "plain"
    sources = [f"s{i}" for i in range(400)]
    held = [s for s in sources if is_heldout(s)]
    kept, leaky = held[0], held[1]
    rows = [conv(f"{s}_0", f"opener {s}") for s in sources]
    rows += [conv(f"{kept}_1", f"second  chunk of {kept}"),  # a sibling chunk follows its source
             conv(f"{leaky}_1", "hi"), conv("s_other_0", " hi ")]  # an opener also on the train side
    ids = sharegpt_heldout_ids(rows)
    assert {f"{kept}_0", f"{kept}_1"} <= ids
    assert not {f"{leaky}_0", f"{leaky}_1"} & ids  # moved to train as a whole, with both chunks
    assert ids == {f"{s}_{n}" for s in held[2:] for n in (0,)} | {f"{kept}_0", f"{kept}_1"}


def test_sharegpt_rejects_unknown_split() -> None:
    with pytest.raises(ValueError, match="split"):
        load_conversations("sharegpt", split="validation")


def test_mtbench_has_80_two_turn_questions() -> None:
    questions = load_conversations("mtbench")
    assert len(questions) == 80
    assert all(_roles(q) == ["user", "user"] for q in questions)
    assert {q.meta["category"] for q in questions} >= {"writing", "coding", "math", "reasoning"}


def test_humaneval_has_164_prompts() -> None:
    problems = load_conversations("humaneval")
    assert len(problems) == 164
    assert problems[0].id == "HumanEval/0"
    assert problems[0].messages[0]["content"].startswith("from typing import List")
    assert problems[0].meta["entry_point"] == "has_close_elements"


def test_jsonl_shapes_and_malformed_rows_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    rows = [
        json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}),
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}),
        json.dumps({"prompt": "Write a haiku."}),
        "{not json",
        json.dumps({"id": "c", "conversations": [{"from": "martian", "value": "?"}]}),
        json.dumps({"id": "d", "messages": []}),
        json.dumps([1, 2, 3]),
        "",
    ]
    path.write_text("\n".join(rows) + "\n")
    with pytest.warns(UserWarning, match=r"skipped 4 malformed row\(s\)"):
        conversations = load_conversations(str(path))
    assert [c.id for c in conversations] == ["a", "b", "2"]
    assert _roles(conversations[0]) == ["user", "assistant"]
    assert conversations[1].messages[1] == {"role": "assistant", "content": "4"}
    assert _roles(conversations[2]) == ["user"]


def test_json_array_and_gzip(tmp_path: Path) -> None:
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    with gzip.open(tmp_path / "rows.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    assert [c.id for c in load_conversations(str(tmp_path / "rows.json"))] == ["0", "1", "2"]
    assert len(load_conversations(str(tmp_path / "rows.jsonl.gz"), limit=2)) == 2


def test_datasets_library_source(tmp_path: Path) -> None:
    data = tmp_path / "hf"
    data.mkdir()
    (data / "train.jsonl").write_text(
        "\n".join(json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(4))
    )
    conversations = load_conversations(f"hf:{data}")
    assert [c.messages[0]["content"] for c in conversations] == ["q0", "q1", "q2", "q3"]


def test_unknown_source_and_bad_limit() -> None:
    with pytest.raises(FileNotFoundError, match="Unknown conversation source 'nope'"):
        load_conversations("nope")
    with pytest.raises(ValueError, match="limit"):
        load_conversations("mtbench", limit=-1)
