"""`<out_dir>/records.jsonl`: every measurement of a dart-eval run, on disk as soon as it is measured.

The first line is a header holding the run's settings (everything that changes what a measurement
means: model, head, trie, tree, methods, dtypes, sampling, max_new_tokens, seed, threads, device);
then one line per record, `{"unit": [...], "record": {...}}`. A unit (`Unit`: one
prompt, turn and sampling setting) is measured with every method interleaved, so its records are
appended together and fsynced before the next unit starts: a killed run loses at most that unit.

A later run with the same out_dir reads the file back and measures only the units it lacks (the
evaluator keeps an uninterrupted run's seeds and method order). If the saved settings differ, it
refuses (`InputError`) instead of mixing or overwriting measurements; a file with a header and no
records holds nothing to lose and is replaced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dart_infer.common.configs import flatten_dotted
from dart_infer.common.errors import InputError
from dart_infer.data.conversations import Conversation

log = logging.getLogger(__name__)


@dataclass
class Record:
    """One (prompt, turn, sampling setting, method, dtype) generation."""

    benchmark: str
    prompt_id: str
    turn: int
    method: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    steps: int | None = None  # verification steps (None where the method does not report them)
    step_tokens: int | None = None  # tokens emitted by those steps (the prefill's first token excluded)
    accept_lengths: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    identical_to_ar: bool | None = None  # same output as `ar` in the same dtype, setting and seed
    output_ids: list[int] = field(default_factory=list)
    dtype: str = "float32"
    label: str = ""  # the method's name in tables: `method`, or `method@fp32` outside the serving dtype
    sampling: str = "T=0"
    seed: int | None = None
    # T=0 against the float32 target's greedy output (`ar` in float32), where that ran:
    identical_to_fp32: bool | None = None
    tokens_to_first_difference: int | None = None  # common prefix; the whole output when identical
    prompt_index: int | None = None  # the conversation's position in its benchmark (prompt ids may repeat)


# (benchmark, prompt index, prompt digest, sampling label, turn): what one measurement is of. The
# digest makes an edited prompt file's rows new units rather than reuse records of other prompts.
Unit = tuple[str, int, str, str, int]


def prompt_digest(conversation: Conversation) -> str:
    """A short stable digest of a conversation's messages."""
    text = json.dumps(conversation.messages, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


RECORDS_FILE = "records.jsonl"
FORMAT = 1  # the header's "dart_eval_records" value
_RECORD_FIELDS = {f.name for f in fields(Record)}


def _plain(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples become lists, paths strings), so settings compare equal."""
    return json.loads(json.dumps(value, default=str))


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: <saved> there, <current> here` for every setting that differs (nested keys dotted)."""
    there, here = flatten_dotted(saved), flatten_dotted(current)
    keys = [k for k in dict.fromkeys([*here, *there]) if there.get(k, "<unset>") != here.get(k, "<unset>")]
    return [f"{k}: {_short(there.get(k, '<unset>'))} there, {_short(here.get(k, '<unset>'))} here" for k in keys]


class RecordStore:
    """The records of one out_dir: `lookup` what is there, `append` a unit as soon as it is measured."""

    def __init__(self, out_dir: str | Path, settings: dict[str, Any]) -> None:
        self.path = Path(out_dir) / RECORDS_FILE
        self.settings = _plain(settings)
        self._units: dict[Unit, dict[str, Record]] = {}
        self._saved: dict[str, Any] | None = None  # the header's settings, when the file has one
        self._fresh = True  # no header written yet: the first append (re)writes the file
        self._needs_newline = False  # a killed run left a partial last line: start on a new one

    @classmethod
    def open(cls, out_dir: str | Path, settings: dict[str, Any]) -> RecordStore:
        """Read `<out_dir>/records.jsonl` if there is one; InputError if it was made with other settings."""
        store = cls(out_dir, settings)
        if store.path.exists():
            store._load()
            store._check(store.settings, "")
        return store

    def _load(self) -> None:
        try:
            with open(self.path, "a", encoding="utf-8"):  # appendable? (opening for append changes nothing)
                pass
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise InputError(f"out_dir: cannot read and append {self.path} ({err}); pick another out_dir "
                             "or make that file readable and writable") from err
        unreadable = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                unreadable += 1  # a line cut short by a killed run
                continue
            if self._saved is None:
                if not (isinstance(entry, dict) and entry.get("dart_eval_records") == FORMAT
                        and isinstance(entry.get("settings"), dict)):
                    raise InputError(f"out_dir: {self.path} is not a dart-eval records file (no header line); "
                                     "pick another out_dir or move that file away")
                self._saved = entry["settings"]
                continue
            try:
                record = Record(**{k: v for k, v in entry["record"].items() if k in _RECORD_FIELDS})
                self._units.setdefault(tuple(entry["unit"]), {})[record.label or record.method] = record
            except (KeyError, TypeError, AttributeError):
                unreadable += 1
        if self._saved is None and unreadable:
            raise InputError(f"out_dir: {self.path} is not a dart-eval records file (no header line); "
                             "pick another out_dir or move that file away")
        if unreadable:
            log.warning("%s: skipped %d unreadable line(s) (a run killed while writing); their prompts are "
                        "measured again", self.path, unreadable)
        self._fresh = not self._units  # only a header (or nothing): nothing to lose, rewrite it
        self._needs_newline = bool(text) and not text.endswith("\n")

    def _check(self, current: dict[str, Any], prefix: str) -> None:
        """Refuse (InputError) when records exist and the saved settings under `prefix` differ."""
        if not self._units or self._saved is None:
            return
        saved = self._saved.get(prefix, {}) if prefix else {k: v for k, v in self._saved.items() if k != "resolved"}
        diff = differences(saved, current)
        if diff:
            raise InputError(
                f"out_dir: {self.path} holds {self.count()} measurement(s) made with other settings "
                f"({'; '.join(diff[:4])}{'; …' if len(diff) > 4 else ''}); pick another out_dir=, or delete "
                "that file to measure again with these settings"
            )

    def confirm(self, resolved: dict[str, Any]) -> None:
        """Settings known once the model is loaded (the tree it resolved, its device): checked against
        the saved ones like the others, and saved with the header."""
        resolved = _plain(resolved)
        self._check(resolved, "resolved")
        self.settings = {**self.settings, "resolved": resolved}

    def count(self, units: Iterable[Unit] | None = None) -> int:
        """How many of `units` (default: all) have records in the file."""
        return len(self._units) if units is None else sum(tuple(u) in self._units for u in units)

    def lookup(self, unit: Unit) -> list[Record] | None:
        """The records saved for `unit` (every method label measured), or None."""
        records = self._units.get(tuple(unit))
        return list(records.values()) if records else None

    def append(self, unit: Unit, records: Sequence[Record]) -> None:
        """Add one unit's records to the file and push them to disk before returning."""
        lines = []
        if self._fresh:
            lines.append(json.dumps({"dart_eval_records": FORMAT, "settings": self.settings}))
        lines += [json.dumps({"unit": list(unit), "record": asdict(r)}) for r in records]
        with open(self.path, "w" if self._fresh else "a", encoding="utf-8") as f:
            f.write(("\n" if self._needs_newline and not self._fresh else "") + "".join(f"{x}\n" for x in lines))
            f.flush()
            os.fsync(f.fileno())
        self._fresh = self._needs_newline = False
        self._units[tuple(unit)] = {r.label or r.method: r for r in records}
