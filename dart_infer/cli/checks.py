"""Check a command's composed config before anything slow starts: keys, types, ranges, names.

Every `dart-*` command runs `check_config` on its config right after Hydra composes it, so a bad
value fails in a second with one line naming the key, instead of minutes later deep inside (or
never: `+trainer.max_stepz=2` used to be accepted and ignored). The expected type of a key is the
type of its default in `configs/`; keys whose default is null are typed in `NULLABLE`, and the tree
settings by their dataclasses. Ranges are by key name (`AT_LEAST_ONE`, `UNIT_INTERVAL`, `POSITIVE`;
every other number must be >= 0).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dart_infer.common.dtypes import DTYPE_NAMES
from dart_infer.common.errors import InputError

# Keys whose default is null (or that also take null), with the type of a non-null value.
NULLABLE: dict[str, type] = {
    "model.chat_template": str, "output_dir": str, "data.limit": int, "draft.init_from": str,
    "draft.vocab_max_sequences": int, "preprocess.regenerate.output": str, "preprocess.regenerate.max_turns": int,
    "states.autocast_dtype": str, "states.topk": int, "trainer.max_steps": int, "trainer.batch_size": int,
    "trainer.max_anchors": int, "trainer.max_minutes": float, "trainer.max_tokens": int, "trainer.pack_length": int, "trainer.save_every": int,
    "train_eval.every": int, "train_eval.compare_head": str,
    "optim.warmup_steps": int, "logging.wandb.mode": str, "logging.wandb.name": str,
    "train_eval.ngram_model": str, "train_eval.limit": int, "input": str, "output": str, "vocab_size": int,
    "fingerprint": str, "context_text": str, "tree_file": str, "draft_model": str, "eagle3_model": str,
    "ngram_model": str, "limit": int, "threads": int,
}
# Keys that take one value or a list of them.
SCALAR_OR_LIST = frozenset({"temperature", "input"})
# Counts and sizes (the key's last name) that must be >= 1.
AT_LEAST_ONE = frozenset({
    "max_steps", "max_new_tokens", "limit", "grad_accum", "max_tokens", "pack_length", "max_length", "batch_size",
    "draft_length", "draft_vocab_size", "keep_last", "log_every", "epochs", "order", "threads", "concurrency",
    "eval_prompts", "train_conversations", "prompts", "anchors_per_sequence", "topk", "updates_per_second",
    "prompt_lookup_num_tokens", "batch_docs", "max_prompt_tokens", "vocab_max_sequences", "port", "vocab_size",
    "draft_top_k", "beam_width", "remain_total", "total_tokens", "depth", "max_anchors", "min_count",
})
UNIT_INTERVAL = frozenset({"top_p", "warmup_ratio", "min_lr_ratio", "context_ngram_weight"})
POSITIVE = frozenset({"lr", "eps"})
CHOICES: dict[str, tuple[str, ...]] = {"model.dtype": tuple(DTYPE_NAMES), "serve_dtype": ("auto", *DTYPE_NAMES),
                                       "compile": ("auto", "true", "false"), "bf16_weights": ("auto", "true", "false")}
# Switches that also take a word: `resume=auto`.
BOOL_OR: dict[str, tuple[str, ...]] = {"resume": ("auto",)}
# Keys that take a word besides their type: `tree.remain_total=auto` fits the tree size to this machine
# (DartModel's tree="auto"; configs/tree/auto.yaml).
WORD_OR: dict[str, tuple[str, ...]] = {"tree.remain_total": ("auto",)}
# Keys naming a model or a head: an embedded name, a local directory or a Hub id.
MODEL_KEYS = ("model.name_or_path", "draft_model", "eagle3_model", "draft.init_from", "train_eval.compare_head")


MISSING = "???"


@functools.cache
def _settings_types() -> dict[str, dict[str, Any]]:
    """Field name -> type for the nodes that are settings dataclasses (any field may be set there)."""
    from dart_infer.methods import get_method
    from dart_infer.tree.settings import TreeSearchSettings

    def types(cls: type) -> dict[str, Any]:
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    tree = types(TreeSearchSettings)
    return {"tree": tree, "train_eval.tree": tree, "eagle3_tree": types(get_method("eagle3").tree_settings_class)}


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf (lists are leaves); interpolations resolved where they can be."""
    out: dict[str, Any] = {}
    for key in node:
        name = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):  # `???`: a value the user must give
            out[name] = MISSING
            continue
        try:
            value = node[key]
        except Exception:  # noqa: BLE001 - e.g. ${hydra:...} outside a Hydra run: keep it as written
            value = node._get_node(key)._value()
        if isinstance(value, DictConfig) and len(value):
            out.update(leaves(value, f"{name}."))
        else:
            out[name] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out


def _parents(key: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`]."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _kind(expected: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(expected, "a single value")


def _base_type(hint: Any) -> Any:
    """`int | None` -> int, `tuple[float, ...] | None` -> list: what a config value must be."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    origin = typing.get_origin(hint) or hint
    return list if origin in (tuple, list) else origin


def _plural(expected: Any) -> str:
    return {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}.get(expected, "values")


def _element_type(default: Any) -> Any:
    """The element type of a default list when all its elements share one (numbers count as float)."""
    kinds = {float if type(v) in (int, float) else type(v) for v in default} if isinstance(default, list) else set()
    return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in (bool, float, str) else None


def _type_error(key: str, value: Any, expected: Any, element: Any = None) -> str | None:
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif expected is str:
        ok = not isinstance(value, list | dict)
    elif expected is list:
        ok = isinstance(value, list) or (key.rsplit(".", 1)[-1] in SCALAR_OR_LIST and not isinstance(value, dict))
    elif expected is dict:
        ok = isinstance(value, dict)
    else:
        ok = not isinstance(value, dict)
    if ok and expected is list and element is not None:
        items = value if isinstance(value, list) else [value]
        bad = [v for v in items if _type_error(key, v, element) or _range_error(key, v)]
        if bad:
            return f"{key}={_show(value)}: expected a list of {_plural(element)} in range ({_show(bad[0])} is not)"
    if ok:
        return None
    hint = f" (a list is written {key}=[a,b])" if expected is list else ""
    return f"{key}={_show(value)}: expected {_kind(expected)}{hint}"


def _range_error(key: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    name = key.rsplit(".", 1)[-1]
    if name in AT_LEAST_ONE and value < 1:
        return f"{key}={value}: must be >= 1"
    if name in UNIT_INTERVAL and not 0 <= value <= 1:
        return f"{key}={value}: must lie in [0, 1]"
    if name in POSITIVE and value <= 0:
        return f"{key}={value}: must be > 0"
    if value < 0:
        return f"{key}={value}: must be >= 0"
    return None


def _show(value: Any) -> str:
    return "null" if value is None else str(value)


def _unknown(key: str, known: Iterable[str], command: str) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"`{command} --cfg job` prints every key"
    return f"unknown key {key}: {command} has no such setting ({hint})"


def check_config(command: str, cfg: DictConfig, defaults: DictConfig) -> None:
    """Raise `InputError` (one line naming the key) for the first bad key or value in `cfg`.

    `defaults`: the same config composed with the same group choices and no value overrides; it
    gives every key's expected type. `command` names the entry point in messages.
    """
    settings = _settings_types()
    default_leaves = leaves(defaults)
    for key, value in leaves(cfg).items():
        node, _, field = key.rpartition(".")
        if node in settings and field in settings[node]:  # a tree field, set or not in configs/
            expected: Any = _base_type(settings[node][field])
            nullable, element = True, (float if expected is list else None)
        elif key in default_leaves:
            default = None if default_leaves[key] == MISSING else default_leaves[key]
            expected = type(default) if default is not None else NULLABLE.get(key)
            element = _element_type(default)
            nullable = default is None or key in NULLABLE or expected is str
        else:
            parent = next((p for p in _parents(key) if p in default_leaves), None)
            if parent is None:
                raise InputError(_unknown(key, default_leaves, command))
            default = default_leaves[parent]
            expected = NULLABLE.get(parent) if default in (None, MISSING) else type(default)
            shown = _show(OmegaConf.to_container(OmegaConf.select(cfg, parent)))
            raise InputError(f"{parent}={shown}: expected {_kind(expected)}, not a mapping")
        if value == MISSING:
            raise InputError(f"{key} has no value and needs one: add {key}=<value> to the command")
        if key in BOOL_OR and str(value).lower() in BOOL_OR[key] or key in WORD_OR and value in WORD_OR[key]:
            continue
        if value is None:
            if not nullable:
                raise InputError(f"{key}=null: expected {_kind(expected)}")
            continue
        problem = _type_error(key, value, expected, element) or _range_error(key, value)
        if problem and key in BOOL_OR:
            problem = f"{key}={_show(value)}: expected true, false or {' or '.join(BOOL_OR[key])}"
        if problem is None and key in CHOICES and str(value).lower() not in CHOICES[key]:
            problem = f"{key}={value}: expected one of {', '.join(CHOICES[key])}"
        if problem:
            raise InputError(problem)
    for key in MODEL_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if value:
            from dart_infer.data.assets import check_model_reference

            check_model_reference(str(value), key, head=key != "model.name_or_path")


def group_overrides(overrides: Iterable[str], groups: Mapping[str, Any]) -> list[str]:
    """The overrides among `overrides` that choose a config-group option (`model=custom`)."""
    out = []
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in groups:
            out.append(arg)
    return out


def check_hydra_job(command: str, config_name: str, cfg: DictConfig) -> None:
    """`check_config` inside a running Hydra job: the defaults are composed with this job's group choices."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    chosen = group_overrides(hydra_cfg.overrides.task, hydra_cfg.runtime.choices)
    check_config(command, cfg, compose(config_name=config_name, overrides=chosen))


def check_composed(command: str, config_name: str, cfg: DictConfig, overrides: list[str]) -> None:
    """`check_config` for a config composed with `hydra.compose` (a `dart-demo` stage)."""
    from hydra import compose

    choices = compose(config_name=config_name, overrides=overrides, return_hydra_config=True).hydra.runtime.choices
    check_config(command, cfg, compose(config_name=config_name, overrides=group_overrides(overrides, choices)))


def _default_keys(config_name: str) -> list[str]:
    """Every key of a command's default config (for 'did you mean'), composed outside any Hydra run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dart_infer.common.configs import configs_dir

    if GlobalHydra.instance().is_initialized():  # inside a Hydra job (a dart-demo stage)
        return list(leaves(compose(config_name=config_name)))
    with initialize_config_dir(str(configs_dir()), version_base="1.3"):
        return list(leaves(compose(config_name=config_name)))


def hydra_error(err: BaseException, command: str, config_name: str) -> BaseException:
    """Hydra's own config errors (unknown key, unknown group option, bad override syntax) as one-line
    `InputError`s; any other error unchanged."""
    from hydra.errors import HydraException

    if not isinstance(err, HydraException):
        return err
    converted = _hydra_input_error(err, command, config_name)
    converted.__cause__ = err  # DART_DEBUG=1 shows Hydra's own traceback too
    return converted


def _hydra_input_error(err: BaseException, command: str, config_name: str) -> InputError:
    import re

    text = str(err)
    merging = re.search(r"Error merging override (\S+?)=(.*)", text)
    if merging:  # OmegaConf refused the value's type itself (a mapping into a list, ...)
        cause = " ".join(str(err.__cause__ or "").split("\n")[0].split())
        return InputError(f"{merging.group(1)}={merging.group(2).strip()}: this value does not fit the key"
                          + (f" ({cause})" if cause else ""))
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown:
        return InputError(_unknown(unknown.group(1), _default_keys(config_name), command))
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
    options = re.search(r"Available options in '[^']+':\n((?:\t.*\n?)*)", text)
    if missing and options:
        choices = ", ".join(line.strip() for line in options.group(1).splitlines() if line.strip())
        return InputError(f"{missing.group(1)}={missing.group(2)}: no such option (choose from {choices})")
    kept = [line.strip() for line in text.split("Config search path")[0].splitlines()
            if line.strip() and not line.startswith(("See https://", "Set the environment"))]
    if getattr(err, "override", None):  # a syntax error: name the override it is in
        kept.insert(0, f"cannot parse the override {err.override!r}")  # type: ignore[attr-defined]
    return InputError(": ".join(kept) if kept else type(err).__name__)
