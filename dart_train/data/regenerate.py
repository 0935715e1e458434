"""Self-distillation data: replace the assistant turns of conversations with the target's own answers.

API:
- `regenerate(model, tokenizer, conversations, out_path, *, max_new_tokens=512, batch_size=8,
  temperature=0.0, top_p=1.0, seed=0, max_prompt_tokens=None, keep_truncated=True, max_turns=None,
  template_kwargs=None, model_name=None) -> RegenerateStats`
  Writes one JSON line per conversation to `out_path` (OpenAI-messages rows
  `{"id", "messages": [{"role", "content"}], "source", "meta"}`), which
  `dart_infer.data.conversations.load_conversations(out_path)` reads back. Resumable: ids already in the
  file are skipped, and a last line cut by a kill is dropped before appending. Every row records the
  settings that shaped it (`meta["generation"]`: model, sampling, limits, batching, template options);
  a file holding rows made with other settings is refused rather than reused (`regeneration_key`
  names a file per setting: the CLI's default output). Keys a row does not record (rows written
  before they were recorded) are not compared.
- `generation_settings(model_name, **options) -> dict` (what a row records) and
  `regeneration_key(settings) -> str` (its short hash).

Several ranks (torch.distributed initialised): rank r answers every world_size-th conversation still
to do into `<out>.part-<r>`, then rank 0 appends the parts' rows to `out` (each id once) and removes
them; a killed run's parts count as done on resume.

Rule: the new conversation keeps the original's system and user messages in order; after every
user message the target answers (its chat template with the generation prompt, exactly as served),
and the original assistant messages are dropped. So prompt-only rows (MT-Bench style, several user
turns) get answers too. `max_turns` ends a conversation after that many answers (1: first turns
only, what MT-Bench/ShareGPT first-turn serving sees; the cheapest tokens to generate). Conversations are batched with left padding; each round generates the next
answer of every conversation in the batch that still has one to give. Conversations are ordered by
the length of their first user message within windows of 16 batches (less left padding; a partial
run is still a sample of the whole input), stably, so the same input always gives the same batches. Greedy when
`temperature == 0` (answers equal `model.generate` on each prompt alone, up to batching numerics),
else sampled with `temperature`/`top_p`; a batch's sampling seed derives from `seed` and its first
conversation id (reproducible for the same batches). An answer stops at the end-of-turn/EOS token or
after `max_new_tokens` (counted in `meta["truncated_answers"]`). A cut answer still gets the
template's end-of-turn token when the data is rendered, one token the target would not have produced
there (measured on SmolLM2/MT-Bench: every other loss-masked token of greedy regenerated data equals
the target's argmax); `keep_truncated=False` ends the conversation before a cut answer instead.
A conversation whose next prompt exceeds `max_prompt_tokens` stops there; one left with no answer is
skipped and counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dart_infer.data.loaders import eos_token_ids

log = logging.getLogger(__name__)


@dataclass
class RegenerateStats:
    written: int = 0
    already_done: int = 0
    skipped_no_user_turn: int = 0
    skipped_no_answer: int = 0  # prompt over max_prompt_tokens, or only truncated answers dropped
    answers: int = 0
    truncated_answers: int = 0
    generated_tokens: int = 0


def generation_settings(
    model_name: str, *, max_new_tokens: int, temperature: float, top_p: float, seed: int, max_turns: int | None,
    max_prompt_tokens: int | None, keep_truncated: bool, batch_size: int, template_kwargs: Mapping | None,
    chat_template: str | None = None,
) -> dict[str, Any]:
    """Everything that shapes a regenerated row. The batch size only when sampling (a batch's seed comes
    from its first conversation); greedy answers do not depend on it beyond padding numerics.
    `chat_template`: the `model.chat_template` setting, recorded only when set (so files made with the
    tokenizer's own template keep their names)."""
    settings = {"model": model_name, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "seed": seed, "max_turns": max_turns, "max_prompt_tokens": max_prompt_tokens,
                "keep_truncated": keep_truncated, "batch_size": batch_size if temperature > 0 else None,
                "template_kwargs": dict(template_kwargs or {})}
    if chat_template:
        settings["chat_template"] = chat_template
    return settings


def regeneration_key(settings: Mapping[str, Any]) -> str:
    """Short hash of the settings that shape regenerated rows (a file per key keeps old answers)."""
    return hashlib.sha256(json.dumps(dict(settings), sort_keys=True, default=str).encode()).hexdigest()[:12]


def _check_generation(path: Path, row: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    saved = (row.get("meta") or {}).get("generation") or {}
    different = {k: (saved[k], v) for k, v in settings.items() if k in saved and saved[k] != v}
    if different:
        raise ValueError(
            f"{path} holds answers generated with other settings {different} (saved, now): they are not reused. "
            "Write to another output (the CLI's default, preprocess.regenerate.output=null, is one file per "
            "setting) or delete that file."
        )


def _done_ids(path: Path, settings: Mapping[str, Any] | None = None, repair: bool = True) -> set[str]:
    """Ids already written (made with `settings`); a last line cut off by a kill is removed (`repair`)."""
    if not path.exists():
        return set()
    done: set[str] = set()
    good_end = 0
    with open(path, "rb") as f:
        data = f.read()
    position = 0
    while position < len(data):
        newline = data.find(b"\n", position)
        if newline < 0:
            break  # no newline: the last write did not finish
        line = data[position:newline]
        if line.strip():
            try:
                row = json.loads(line)
                done.add(str(row["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(
                    f"{path} line at byte {position} is not a regenerated conversation; refusing to append to it"
                ) from None
            if settings is not None:
                _check_generation(path, row, settings)
        position = newline + 1
        good_end = position
    if good_end < len(data) and repair:
        log.warning("%s: dropping an incomplete last line (interrupted run)", path)
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def _batch_seed(seed: int, first_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{first_id}".encode()).digest()[:7], "little")


@dataclass
class _State:
    conversation: Any
    pending: list[dict[str, str]]  # original system/user messages not yet placed
    messages: list[dict[str, str]]
    truncated: int = 0
    stopped: bool = False

    def answers(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)

    def advance(self) -> bool:
        """Move messages from `pending` up to and including the next user turn; False when none is left."""
        while self.pending:
            message = self.pending.pop(0)
            self.messages.append(message)
            if message["role"] == "user":
                return True
        return False


def regenerate(
    model: Any,
    tokenizer: Any,
    conversations: Iterable[Any],
    out_path: str | os.PathLike[str],
    *,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompt_tokens: int | None = None,
    keep_truncated: bool = True,
    max_turns: int | None = None,
    template_kwargs: Mapping | None = None,
    model_name: str | None = None,
    chat_template: str | None = None,
) -> RegenerateStats:
    """Regenerate every assistant turn with `model` and append the conversations to `out_path` (JSONL)."""
    from dart_train.data.template import check_chat_template

    check_chat_template(tokenizer)
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be positive")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 or None, got {max_turns}")
    from dart_train.common.dist import rank_and_world_size

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rank, world = rank_and_world_size()
    part = out.with_name(f"{out.name}.part-{rank}") if world > 1 else out
    generation = generation_settings(
        model_name or getattr(model.config, "_name_or_path", ""), max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, seed=seed, max_turns=max_turns, max_prompt_tokens=max_prompt_tokens,
        keep_truncated=keep_truncated, batch_size=batch_size, template_kwargs=template_kwargs,
        chat_template=chat_template,
    )
    done = _done_ids(out, generation, repair=rank == 0)
    for other in sorted(out.parent.glob(f"{out.name}.part-*")):  # a killed multi-rank run's parts
        done |= _done_ids(other, generation, repair=other == part)
    if world > 1:
        torch.distributed.barrier()  # every rank has read the same files before any writes
    eos = list(eos_token_ids(model, tokenizer))  # the same EOS set serving stops at
    if not eos:
        raise ValueError("neither the model's generation config nor the tokenizer defines an EOS token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    kwargs = dict(template_kwargs or {})
    stats = RegenerateStats()
    device = next(model.parameters()).device

    todo: list[Any] = []
    for conversation in conversations:
        if str(conversation.id) in done:
            stats.already_done += 1
            continue
        if not any(m["role"] == "user" for m in conversation.messages):
            stats.skipped_no_user_turn += 1
            continue
        todo.append(conversation)
    # Less left padding: sort by first-prompt length within windows of 16 batches, so a partial run
    # (resumable) is still a sample of the whole input, not its shortest prompts.
    window = 16 * batch_size
    todo = [
        c for start in range(0, len(todo), window)
        for c in sorted(todo[start : start + window], key=lambda c: len(next(
            m["content"] for m in c.messages if m["role"] == "user")))
    ]
    todo = todo[rank::world]  # the same list on every rank (read before the barrier)
    turn_limit = max_turns if max_turns is not None else float("inf")

    model.eval()
    with open(part, "a", encoding="utf-8") as sink:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            states = [
                _State(c, [dict(m) for m in c.messages if m["role"] != "assistant"], []) for c in chunk
            ]
            active = [s for s in states if s.advance()]
            if temperature > 0:
                torch.manual_seed(_batch_seed(seed, str(chunk[0].id)))
            while active:
                prompts = []
                for state in active:
                    text = tokenizer.apply_chat_template(
                        state.messages, tokenize=False, add_generation_prompt=True, **kwargs
                    )
                    prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
                runnable = []
                for state, ids in zip(active, prompts, strict=True):
                    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                        state.messages.pop()  # drop the unanswered user turn
                        state.stopped = True
                    else:
                        runnable.append((state, ids))
                if not runnable:
                    break
                width = max(len(ids) for _, ids in runnable)
                input_ids = torch.full((len(runnable), width), pad_id, dtype=torch.long)
                attention = torch.zeros(len(runnable), width, dtype=torch.long)
                for row, (_, ids) in enumerate(runnable):
                    input_ids[row, width - len(ids) :] = torch.tensor(ids)
                    attention[row, width - len(ids) :] = 1
                with torch.no_grad():
                    output = model.generate(
                        input_ids=input_ids.to(device),
                        attention_mask=attention.to(device),
                        max_new_tokens=max_new_tokens,
                        do_sample=temperature > 0,
                        temperature=temperature if temperature > 0 else None,
                        top_p=top_p if temperature > 0 else None,
                        top_k=None,
                        eos_token_id=eos,
                        pad_token_id=pad_id,
                    )
                new_tokens = output[:, width:].cpu().tolist()
                for (state, _), tokens in zip(runnable, new_tokens, strict=True):
                    stop = next((k for k, t in enumerate(tokens) if t in eos), None)
                    answer = tokens if stop is None else tokens[:stop]
                    stats.generated_tokens += len(answer) + (stop is not None)
                    if stop is None:
                        state.truncated += 1
                        if not keep_truncated:  # end the conversation before the cut answer
                            state.messages.pop()
                            state.stopped = True
                            continue
                    stats.answers += 1
                    content = tokenizer.decode(answer, skip_special_tokens=True)
                    state.messages.append({"role": "assistant", "content": content})
                active = [s for s, _ in runnable if not s.stopped and s.answers() < turn_limit and s.advance()]
            for state in states:
                if not any(m["role"] == "assistant" for m in state.messages):
                    stats.skipped_no_answer += 1
                    continue
                conversation = state.conversation
                row = {
                    "id": str(conversation.id),
                    "messages": state.messages,
                    "source": f"regenerated:{getattr(conversation, 'source', '')}",
                    "meta": {
                        **dict(getattr(conversation, "meta", {}) or {}),
                        "regenerated_by": generation["model"],
                        "generation": generation,
                        "truncated_answers": state.truncated,
                        "stopped_early": state.stopped,
                    },
                }
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
                stats.written += 1
                stats.truncated_answers += state.truncated
            sink.flush()
            os.fsync(sink.fileno())
            log.info("regenerate: %d/%d conversations written", stats.written, len(todo))
    if world > 1:
        torch.distributed.barrier()
        if rank == 0:
            _merge_parts(out)
        torch.distributed.barrier()
    return stats


def _merge_parts(out: Path) -> None:
    """Append the rows of `<out>.part-*` that `out` lacks (each id once), then remove the parts."""
    done = _done_ids(out)
    parts = sorted(out.parent.glob(f"{out.name}.part-*"))
    with open(out, "a", encoding="utf-8") as sink:
        for path in parts:
            for line in path.read_text(encoding="utf-8").splitlines():
                row = json.loads(line) if line.strip() else None
                if row is None or str(row["id"]) in done:
                    continue
                done.add(str(row["id"]))
                sink.write(line + "\n")
        sink.flush()
        os.fsync(sink.fileno())
    for path in parts:
        path.unlink()
