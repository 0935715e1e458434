"""dart-eval never loses what it measured: bad input is refused before the model loads, every prompt's
records reach `<out_dir>/records.jsonl` as soon as they are measured, an interrupted run resumes where
it stopped, and the table is printed before any results file or plot can fail.

`run_eval` runs in-process on the tiny random target of conftest's `tiny_dart` (a few seconds a run), so
failures can be injected where they would happen: at a write, in a plot, after k prompts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers import run_dart_eval
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from dart_infer.cli import eval as eval_cli
from dart_infer.cli.eval_checks import check_out_dir
from dart_infer.common.configs import configs_dir
from dart_infer.common.errors import InputError
from dart_infer.evaluation.evaluate import Evaluator
from dart_infer.evaluation.records import RECORDS_FILE, RecordStore
from dart_infer.evaluation.results import ResultsNotWritten, write_plots

# mtbench with both turns: the second turn's prompt holds the first answer, so a resumed run has to
# rebuild it from the saved records. 2 prompts x 2 turns = 4 measurements, 2 methods each.
UNITS = 4


def eval_cfg(root: Path, out_dir: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        return compose("eval", overrides=[
            "model=custom", f"model.name_or_path={root / 'base'}", f"draft_model={root / 'head'}",
            f"ngram_model={root / 'tiny.trie'}", "benchmarks=[mtbench]", "limit=2", "multi_turn=true",
            "max_new_tokens=6", "temperature=0", "baseline_dtypes=[]", "methods=[ar,dart]", "compile=false",
            f"out_dir={out_dir}", *overrides,
        ])


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: refusals must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(eval_cli, "load_models", refuse)


def read_records(out_dir: Path) -> list[dict]:
    lines = (out_dir / RECORDS_FILE).read_text().splitlines()
    entries = []
    for line in lines[1:]:
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return entries


def count_appends(monkeypatch, fail_after: int | None = None) -> list[tuple]:
    """Record every unit appended to records.jsonl; with `fail_after`, stop the run right after the
    k-th unit was written (as a crash or Ctrl-C there would)."""
    appended: list[tuple] = []
    original = RecordStore.append

    def append(self, unit, records):
        original(self, unit, records)
        appended.append(tuple(unit))
        if fail_after is not None and len(appended) == fail_after:
            raise KeyboardInterrupt

    monkeypatch.setattr(RecordStore, "append", append)
    return appended


# ------------------------------------------------------------------------ refused before any work


def test_unwritable_out_dir_is_refused_before_the_model_loads(tiny_dart, tmp_path: Path, no_model) -> None:
    _, root = tiny_dart
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for out_dir in (blocker / "out", blocker):  # under a regular file; a regular file itself
        with pytest.raises(InputError, match=r"out_dir=.*cannot write there.*give a writable directory") as err:
            eval_cli.run_eval(eval_cfg(root, out_dir))
        assert str(out_dir) in str(err.value) and "\n" not in str(err.value)
    # A read-only directory: refused exactly when a write there really fails (root writes anyway).
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        try:
            (read_only / "probe").touch()
            (read_only / "probe").unlink()
            writable = True
        except PermissionError:
            writable = False
        if writable:
            assert check_out_dir(read_only) == read_only
        else:
            with pytest.raises(InputError, match="out_dir="):
                check_out_dir(read_only)
    finally:
        read_only.chmod(0o700)


@pytest.mark.parametrize(("override", "message"), [
    ("limit=0", r"limit=0: expected null \(all of them\) or a whole number >= 1"),
    ("limit=-3", "limit=-3: expected"),
    ("max_new_tokens=0", "max_new_tokens=0: expected a whole number >= 1"),
    ("benchmarks=[]", r"benchmarks=\[\]: give at least one"),
    ("methods=[ar,eagle3]", "needs eagle3_model="),
])
def test_bad_counts_are_refused_before_the_model_loads(tiny_dart, tmp_path: Path, no_model, override: str,
                                                       message: str) -> None:
    _, root = tiny_dart
    with pytest.raises(InputError, match=message):
        eval_cli.run_eval(eval_cfg(root, tmp_path / "out", override))
    assert not (tmp_path / "out" / RECORDS_FILE).exists()


@pytest.mark.parametrize(("name", "text", "says"), [
    ("empty.jsonl", "", "is empty"),
    ("blank.jsonl", "\n\n", "is empty"),
    ("wrong.jsonl", '{"text": "hello"}\n{"text": "again"}\n',
     "no usable prompt in its 2 row\\(s\\) \\(row 0: no 'conversations', 'messages', 'turns' or 'prompt' field\\)"),
    ("notjson.jsonl", "hello\nworld\n", "row 0: expected an object, got str"),
    ("assistant_only.jsonl", '{"messages": [{"role": "assistant", "content": "hi"}]}\n', "no user turn"),
    ("empty.json", "[]", "is empty"),
    ("object.json", '{"prompt": "one"}', "expected a JSON array"),
    ("prompts.txt", "Write a poem.\n", "unsupported file type"),
])
def test_bad_benchmark_files_are_refused_naming_the_file(tiny_dart, tmp_path: Path, no_model, name: str,
                                                         text: str, says: str) -> None:
    _, root = tiny_dart
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError, match=says) as err:
        eval_cli.run_eval(eval_cfg(root, tmp_path / "out", f"benchmarks=[mtbench,{path}]"))
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    if name.endswith(".jsonl"):
        assert "expected JSON lines (.jsonl) or a JSON array (.json)" in message and "'prompt'" in message
    assert not (tmp_path / "out" / RECORDS_FILE).exists()


def test_cli_refuses_in_one_line(tiny_dart, tmp_path: Path) -> None:
    _, root = tiny_dart
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    common = ["model=custom", f"model.name_or_path={root / 'base'}", f"draft_model={root / 'head'}",
              "ngram_model=null", "benchmarks=[humaneval]"]
    for args, says in (([f"out_dir={blocker / 'out'}"], f"out_dir={blocker / 'out'}: cannot write there"),
                       ([f"out_dir={tmp_path / 'out'}", "limit=0"], "limit=0")):
        result = run_dart_eval(*common, *args, cwd=tmp_path)
        assert result.returncode != 0
        assert [line for line in result.stderr.splitlines() if says in line], result.stderr[-2000:]
        assert not (tmp_path / "out" / RECORDS_FILE).exists()


# ----------------------------------------------------------------------- records, resume, refusal


def test_interrupted_run_resumes_and_measures_only_the_missing_prompts(tiny_dart, tmp_path: Path,
                                                                       monkeypatch, capsys) -> None:
    _, root = tiny_dart
    out = tmp_path / "out"
    appended = count_appends(monkeypatch, fail_after=3)
    with pytest.raises(KeyboardInterrupt):
        eval_cli.run_eval(eval_cfg(root, out))
    assert f"stopped: 3 of {UNITS} measurements are saved in {out / RECORDS_FILE}" in capsys.readouterr().err
    first = read_records(out)
    assert len(first) == 3 * 2  # three units written, both methods each, before the interruption
    # A kill in the middle of a write leaves a partial last line: skipped, measured again.
    with open(out / RECORDS_FILE, "a") as f:
        f.write('{"unit": ["mtbench", 1')
    capsys.readouterr()

    monkeypatch.undo()  # no more interruption
    appended = count_appends(monkeypatch)
    paths = eval_cli.run_eval(eval_cfg(root, out))
    stdout = capsys.readouterr().out
    assert f"resuming: 3 of {UNITS} measurements already in {out / RECORDS_FILE}" in stdout
    assert len(appended) == 1 and appended[0][1:] == (1, appended[0][2], "T=0", 1)  # prompt 1, 2nd turn
    assert "| mtbench | T=0 | dart | float32 | 4 |" in stdout

    saved = json.loads(paths["json"].read_text())
    records = saved["records"]
    assert len(records) == UNITS * 2 and saved["meta"]["resumed_measurements"] == 3
    # The first run's measurements are reused as they were (timings included), not measured again.
    kept = {(e["record"]["prompt_index"], e["record"]["turn"], e["record"]["label"]): e["record"] for e in first}
    for record in records:
        key = (record["prompt_index"], record["turn"], record["label"])
        if key in kept:
            assert record == kept[key]
    # The file reads back whole: the partial line stays skipped, the new unit follows on its own line.
    assert len(read_records(out)) == UNITS * 2

    # The same measurements as an uninterrupted run: seeds, method order, and the second turn's
    # prompt built from the saved first answer.
    fresh = json.loads(eval_cli.run_eval(eval_cfg(root, tmp_path / "fresh"))["json"].read_text())["records"]
    strip = ("seconds", "timings")
    assert [{k: v for k, v in r.items() if k not in strip} for r in records] == \
           [{k: v for k, v in r.items() if k not in strip} for r in fresh]
    assert [r["seed"] for r in records] == [0, 0, 1, 1, 2, 2, 3, 3]

    # Everything there: nothing measured, nothing warmed up, the results written again.
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(Evaluator, "warm_up", no_measuring)
    monkeypatch.setattr(Evaluator, "_run_ar", no_measuring)
    eval_cli.run_eval(eval_cfg(root, out))
    assert f"resuming: {UNITS} of {UNITS} measurements" in capsys.readouterr().out


def test_other_settings_are_refused_and_the_records_kept(tiny_dart, tmp_path: Path, monkeypatch) -> None:
    _, root = tiny_dart
    out = tmp_path / "out"
    eval_cli.run_eval(eval_cfg(root, out, "limit=1", "multi_turn=false"))
    before = (out / RECORDS_FILE).read_bytes()
    for override, says in (("max_new_tokens=7", "max_new_tokens: 6 there, 7 here"),
                           ("methods=[ar,dart_no_trie]", "methods: "),
                           ("tree.remain_total=3", 'tree.remain_total: "auto" there, 3 here')):
        with pytest.raises(InputError, match=says) as err:
            eval_cli.run_eval(eval_cfg(root, out, "limit=1", "multi_turn=false", override))
        assert "pick another out_dir=, or delete that file" in str(err.value) and "\n" not in str(err.value)
        assert (out / RECORDS_FILE).read_bytes() == before
    # More prompts with the same settings: the first is reused, the next two measured.
    appended = count_appends(monkeypatch)
    eval_cli.run_eval(eval_cfg(root, out, "limit=3", "multi_turn=false"))
    assert [unit[1] for unit in appended] == [1, 2]
    assert (out / RECORDS_FILE).read_bytes().startswith(before)


def test_a_foreign_records_file_is_not_touched(tiny_dart, tmp_path: Path, no_model) -> None:
    _, root = tiny_dart
    out = tmp_path / "out"
    out.mkdir()
    (out / RECORDS_FILE).write_text('{"something": "else"}\n')
    with pytest.raises(InputError, match="is not a dart-eval records file"):
        eval_cli.run_eval(eval_cfg(root, out))
    assert (out / RECORDS_FILE).read_text() == '{"something": "else"}\n'


# ------------------------------------------------------------------------------ results last


def test_failed_results_write_keeps_the_table_and_the_records(tiny_dart, tmp_path: Path, monkeypatch,
                                                              capsys, caplog) -> None:
    import dart_infer.evaluation.results as results

    _, root = tiny_dart
    out = tmp_path / "out"
    original = results.atomic_write_bytes

    def read_only(path, data):
        if Path(path).name == "results.json":
            raise PermissionError(13, "Permission denied", str(path))
        original(path, data)

    monkeypatch.setattr(results, "atomic_write_bytes", read_only)
    with caplog.at_level(logging.WARNING), pytest.raises(ResultsNotWritten) as err:
        eval_cli.run_eval(eval_cfg(root, out))
    stdout = capsys.readouterr().out
    assert "| mtbench | T=0 | dart | float32 | 4 |" in stdout  # the table was printed first
    assert stdout.index("| mtbench | T=0 | dart") < stdout.index("records: ")
    assert "results.json" in str(err.value) and str(out / RECORDS_FILE) in str(err.value)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("results.json" in w and "PermissionError" in w for w in warnings), warnings
    assert len(read_records(out)) == UNITS * 2
    assert not (out / "results.json").exists() and (out / "results.md").exists()  # the other file still written
    assert (out / "speedup_tau.png").exists()

    # Once writable, the same command writes the results without measuring again.
    monkeypatch.setattr(results, "atomic_write_bytes", original)
    appended = count_appends(monkeypatch)
    paths = eval_cli.run_eval(eval_cfg(root, out))
    assert appended == [] and len(json.loads(paths["json"].read_text())["records"]) == UNITS * 2


def test_a_failed_plot_is_a_warning(tiny_dart, tmp_path: Path, monkeypatch, capsys, caplog) -> None:
    import dart_infer.evaluation.results as results

    _, root = tiny_dart
    out = tmp_path / "out"

    def broken(fig, summary):
        raise ValueError("number sections must be larger than 0.")

    monkeypatch.setattr(results, "PLOTS", ((*results.PLOTS[0][:3], broken), *results.PLOTS[1:]))
    with caplog.at_level(logging.WARNING):
        paths = eval_cli.run_eval(eval_cfg(root, out, "limit=1"))
    assert "| mtbench | T=0 | dart |" in capsys.readouterr().out
    assert json.loads(paths["json"].read_text())["records"]
    assert "speedup_plot" not in paths and paths["time_plot"].read_bytes()[:4] == b"\x89PNG"
    assert not list(out.glob(".speedup_tau.png.tmp*")) and not (out / "speedup_tau.png").exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w for w in warnings if "speedup_tau.png" in w] == [
        f"could not write {out / 'speedup_tau.png'}: ValueError: number sections must be larger than 0."]


def test_plots_of_an_empty_summary_never_raise(tmp_path: Path) -> None:
    saved = write_plots({}, tmp_path)  # whatever matplotlib makes of no rows: a warning at most
    assert len(saved.paths) + len(saved.failed) == 3
