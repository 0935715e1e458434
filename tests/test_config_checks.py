"""Bad config values, keys and names fail in one line naming the key, before anything slow starts.

The sweep gives every key of the five commands' configs a value of the wrong type and checks that
`check_config` (what each command runs first) refuses it in one line that names the key; the CLI
tests check that the commands print exactly that line, with exit code 2 and no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException

from dart_infer.cli.checks import MISSING, check_config, hydra_error, leaves
from dart_infer.common.configs import configs_dir
from dart_infer.common.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, InputError, report
from dart_infer.data.assets import check_model_reference

COMMANDS = ("train", "ngram", "eval", "demo", "app")
# Group choices whose options add keys of their own: swept as well as the defaults.
VARIANTS = {"train": [[], ["draft=eagle3"], ["trainer=zero2"], ["states=offline"], ["train_eval=off"],
                      ["model=custom", "model.name_or_path=x/y"], ["experiment=recipe_ab", "ab=maxlen512"],
                      ["experiment=dart_vs_eagle3", "cmp_head=eagle3"]], "eval": [[], ["tree=gpu"]]}


@pytest.fixture(autouse=True)
def _hydra():
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(configs_dir()), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def wrong_value(value) -> str:
    """An override value of the wrong type for a key whose default is `value`."""
    if isinstance(value, bool | int | float):
        return "not_a_number" if not isinstance(value, bool) else "maybe"
    if isinstance(value, dict):
        return "not_a_mapping"
    return "{a: 1}"  # a mapping: wrong for strings, lists and paths alike


def typed_default(key: str, value):
    from dart_infer.cli.checks import NULLABLE

    if value is None or value == MISSING:
        return {int: 0, str: "", float: 0.0}.get(NULLABLE.get(key), "")
    return value


def first_error(name: str, overrides: list[str], defaults) -> str:
    """The one-line error a command gives for these overrides: Hydra's (at composition) or the check's."""
    try:
        check_config(f"dart-{name}", compose(config_name=name, overrides=overrides), defaults)
    except HydraException as err:
        converted = hydra_error(err, f"dart-{name}", name)
        assert isinstance(converted, InputError), err
        return str(converted)
    except InputError as err:
        return str(err)
    raise AssertionError(f"{overrides} was accepted")


@pytest.mark.parametrize("name", COMMANDS)
def test_every_key_with_a_wrong_type_is_one_line_naming_it(name) -> None:
    swept, seen = 0, set()
    for variant in VARIANTS.get(name, [[]]):
        defaults = compose(config_name=name, overrides=[o for o in variant if "." not in o.split("=")[0]])
        for key, value in leaves(compose(config_name=name, overrides=variant)).items():
            if (key, type(value)) in seen:
                continue  # swept in an earlier variant with a value of the same type
            seen.add((key, type(value)))
            bad = f"{key}={wrong_value(typed_default(key, value))}"
            message = first_error(name, [*variant, bad], defaults)
            assert "\n" not in message and message.startswith(f"{key}="), (bad, message)
            swept += 1
    assert swept >= 15


@pytest.mark.parametrize("name", COMMANDS)
def test_defaults_pass(name) -> None:
    for variant in VARIANTS.get(name, [[]]):
        defaults = compose(config_name=name, overrides=[o for o in variant if "." not in o.split("=")[0]])
        check_config(f"dart-{name}", compose(config_name=name, overrides=variant), defaults)


@pytest.mark.parametrize(("override", "expected"), [
    ("+trainer.max_stepz=2", "unknown key trainer.max_stepz: dart-train has no such setting (did you mean trainer.max_steps?)"),
    ("trainer.max_steps=0", "trainer.max_steps=0: must be >= 1"),
    ("trainer.max_steps=2.5", "trainer.max_steps=2.5: expected an integer"),
    ("optim.lr=0", "optim.lr=0: must be > 0"),
    ("optim.betas=[0.9,x]", "optim.betas=[0.9, 'x']: expected a list of numbers in range (x is not)"),
    ("train_eval.tree.beam_width=0", "train_eval.tree.beam_width=0: must be >= 1"),
    ("++train_eval.tree.level_weight=[1.0,0.5]", None),  # a tree field not in configs/: allowed
    ("++train_eval.tree.beam_widht=3", "unknown key train_eval.tree.beam_widht"),
    ("model.dtype=bf32", "model.dtype=bf32: expected one of"),
    ("resume=yes", "resume=yes: expected true, false or auto"),
    ("resume=auto", None),
])
def test_train_values(override, expected) -> None:
    defaults = compose(config_name="train")
    cfg = compose(config_name="train", overrides=[override])
    if expected is None:
        check_config("dart-train", cfg, defaults)
        return
    with pytest.raises(InputError, match=None) as caught:
        check_config("dart-train", cfg, defaults)
    assert str(caught.value).startswith(expected)


def test_demo_negative_steps_and_missing_value() -> None:
    with pytest.raises(InputError, match=r"^train_steps=-1: must be >= 0$"):
        check_config("dart-demo", compose(config_name="demo", overrides=["train_steps=-1"]), compose(config_name="demo"))
    custom = compose(config_name="train", overrides=["model=custom"])
    with pytest.raises(InputError, match=r"^model.name_or_path has no value"):
        check_config("dart-train", custom, custom)


def test_model_references(tmp_path) -> None:
    check_model_reference("dart-smollm2-135m-instruct", "draft_model", head=True)
    check_model_reference(str(tmp_path), "draft_model", head=True)
    check_model_reference("Qwen/Qwen3-4B", "model.name_or_path")
    check_model_reference("gpt2", "model.name_or_path")  # a bare Hub id of a model
    with pytest.raises(InputError, match="did you mean dart-smollm2-135m-instruct"):
        check_model_reference("dart-smollm2-135m-instruc", "draft_model", head=True)
    with pytest.raises(InputError, match="no such directory"):
        check_model_reference(str(tmp_path / "runs" / "x" / "final"), "draft_model", head=True)
    with pytest.raises(InputError, match="no such directory"):
        check_model_reference("my-head", "draft_model", head=True)  # heads on the Hub are org/name
    (tmp_path / "runs").mkdir()
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        with pytest.raises(InputError, match="no such directory"):
            check_model_reference("runs/final", "draft.init_from", head=True)  # runs/ exists: a local path
    finally:
        os.chdir(here)


def test_report_exit_codes(capsys) -> None:
    assert report(InputError("k=v: expected an integer"), "dart-x") == EXIT_BAD_INPUT
    assert report(FileNotFoundError("no such file: a.jsonl"), "dart-x") == EXIT_BAD_INPUT
    assert report(RuntimeError("boom\nsecond line"), "dart-x") == 1
    assert report(KeyboardInterrupt(), "dart-x") == EXIT_INTERRUPTED
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["dart-x: error: k=v: expected an integer", "dart-x: error: no such file: a.jsonl",
                     "dart-x: error: RuntimeError: boom second line (DART_DEBUG=1 shows the traceback)",
                     "dart-x: interrupted"]


def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    bin_dir = Path(sys.executable).parent
    return subprocess.run([str(bin_dir / script), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("script", "args", "expected"), [
    ("dart-train", ["+trainer.max_stepz=2"], "dart-train: error: unknown key trainer.max_stepz"),
    ("dart-eval", ["draft_model=dart-smollm2-135m-instruc"], "dart-eval: error: draft_model=dart-smollm2-135m-instruc: "),
    ("dart-ngram", ["order=x"], "dart-ngram: error: order=x: expected an integer"),
    ("dart-demo", ["train_steps=-1"], "dart-demo: error: train_steps=-1: must be >= 0"),
    ("dart-app", ["model=nonexist"], "dart-app: error: model=nonexist: no such option (choose from custom,"),
    ("dart-eval", ["limit=[1"], "dart-eval: error: cannot parse the override 'limit=[1'"),
    # The demo checks every stage's config before its first stage starts.
    ("dart-demo", ["eval_overrides=['limit=abc']"], "dart-demo: error: the demo's eval stage: limit=abc: expected"),
    ("dart-demo", ["train_overrides=['trainer.max_stepz=3']"],
     "dart-demo: error: the demo's train stage: unknown key trainer.max_stepz"),
])
def test_commands_print_one_line_and_exit_2(script, args, expected, tmp_path) -> None:
    result = run(script, *args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith(expected), result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_debug_switch_shows_the_traceback(tmp_path) -> None:
    result = run("dart-ngram", "order=x", f"hydra.run.dir={tmp_path}", env={"DART_DEBUG": "1"})
    assert result.returncode == EXIT_BAD_INPUT
    assert "Traceback" in result.stderr and result.stderr.splitlines()[-1].startswith("dart-ngram: error: order=x")
