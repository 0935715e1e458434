"""Write a trained head for a serving engine: DART heads for vLLM through our plugin
(`dart_infer.engines.vllm.plugin`); EAGLE-3 heads for vLLM (speculators format) or SGLang (SpecForge layout).

`dart-export <head> --out <dir> [--format vllm|sglang]` (`dart_infer.cli.export`) over `export_head`.
Every export directory holds the head's `config.json` + `model.safetensors` in the engine's layout and
`vllm_speculative_config.json`: the dict vLLM takes as `speculative_config`
(`vllm serve <target> --speculative-config "$(cat <dir>/vllm_speculative_config.json)"`: the flag
takes JSON text, not a file name; or
`LLM(model=<target>, speculative_config=json.load(...))`) with `model` = the export's absolute path.

EAGLE-3 heads (`dart-train draft=eagle3`, layout in `dart_infer.methods.eagle3`). What the engines read,
checked against vLLM 0.32's own loader (`transformers_utils/configs/speculators/`,
`model_executor/models/llama_eagle3.py`, `v1/worker/gpu_model_runner.py`) and SGLang's
(`srt/models/llama_eagle3.py`, `set_eagle3_layers_to_capture`); facts only, no code copied:

- **vllm** (the speculators format): config.json without `model_type` (vLLM detects the format by
  `speculators_config`), `speculators_model_type: "eagle3"`, `architectures: ["Eagle3Speculator"]`,
  `transformer_layer_config` (the one-layer Llama config), `speculators_config` {`algorithm`,
  `proposal_methods`: [{`proposal_type: "greedy"`, `speculative_tokens`}], `default_proposal_method`,
  `verifier`: {`name_or_path`, `architectures`}}, and at the top level `draft_vocab_size`,
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (vLLM's meaning = ours: the INPUTS of
  those target layers) and `norm_before_residual` — always written: a speculators config without
  it means **true** to vLLM, our heads are false. Weights: `midlayer.` renamed `layers.0.`; `d2t` and
  `t2d` kept (vLLM skips `t2d`); no `embed_tokens` (vLLM then shares the target's).
- **sglang** (what SpecForge saves and SGLang's `LlamaForCausalLMEagle3` loads): our own layout
  (`midlayer.*`, Llama config with `LlamaForCausalLMEagle3`, `tie_word_embeddings: false` — true
  would make SGLang use the embedding as lm_head) plus `eagle_config`:
  {`use_aux_hidden_state: true`, `eagle_aux_hidden_state_layer_ids`} in SGLang's meaning, the OUTPUT
  of those layers, i.e. ours minus one (SGLang captures at the input of id + 1). The top-level key
  keeps vLLM's meaning: vLLM reads it before `eagle_config`, SGLang reads `eagle_config` first, so
  the same directory serves correctly in both.

DART heads (`--format vllm` only): the layout `dart_infer.engines.vllm.plugin` loads, written by
`dart_infer.engines.dart_export` (its docstring says what the files hold).

Step-back (`draft_max_batch` B, `--draft-max-batch`): vLLM 0.32's dynamic speculative decoding
(`num_speculative_tokens_per_batch_size`, inclusive batch-size ranges from 1; the scheduler looks up k
from the number of requests it schedules in a step) with `[[1, B, k], [B + 1, 2**20, 0]]`: draft k
tokens while at most B requests run together, none above (big CPU batches verify drafts at a loss).
With parallel drafting the draft slots per request are fixed at k when the engine starts, so only 0 and
k are safe there (0 still runs the draft forward, which keeps the draft KV cache in sync).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dart_infer.common.errors import InputError

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "ExportResult", "draft_schedule", "export_head", "head_kind", "speculative_config"]

FORMATS = ("vllm", "sglang")
SPEC_CONFIG_FILE = "vllm_speculative_config.json"
EAGLE3_METHOD = "eagle3"
# Draft tokens per step when not given: what the published speculators EAGLE-3 heads declare.
DEFAULT_SPECULATIVE_TOKENS = 3
# Keys of our head config that are not part of a Llama layer config (the speculators format puts
# them at the top level or drops them).
_EAGLE3_TOP_LEVEL = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                     "norm_before_residual")
# --draft-max-batch: "all" drafts at every batch size (no schedule); "auto" is DART_CPU_DRAFT_MAX_BATCH
# for a DART head exported on a machine without a CUDA GPU, "all" otherwise.
DRAFT_ALWAYS, DRAFT_AUTO = "all", "auto"
# Measured (scripts/bench_vllm_concurrency.py, docs/vllm.md "Serving under load"; 2-core Xeon, fp32):
# vLLM + the shipped head was 0.93-1.00x plain alone, 0.84-0.89x at 2 requests, 0.69-0.72x at 4.
DART_CPU_DRAFT_MAX_BATCH = 1
# The last range's end: any bound works, vLLM builds its lookup only up to max_num_seqs.
_BATCH_BOUND = 1 << 20
_OURS_ONLY = ("ttt_length", "architectures", "transformers_version", "base_model", "_name_or_path",
              "double_final_norm")


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    format: str
    kind: str
    speculative_config: dict[str, Any]
    verifier: str
    chain: dict[str, Any] | None = None  # a DART export's trie-chosen chain (config.json's dart_chain)


def head_kind(config: dict[str, Any]) -> str:
    """'eagle3' or 'dart' from a head's config.json; anything else is not a head we wrote."""
    architectures = config.get("architectures") or []
    if "LlamaForCausalLMEagle3" in architectures:
        return "eagle3"
    if "DartDraftModel" in architectures or "draft_length" in config:
        return "dart"
    if "speculators_config" in config:
        return "speculators"
    return "unknown"


def draft_schedule(draft_max_batch: int, num_speculative_tokens: int) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` for "draft k tokens at up to B concurrent requests,
    none above" (module docstring)."""
    return [[1, draft_max_batch, num_speculative_tokens], [draft_max_batch + 1, _BATCH_BOUND, 0]]


def _check_draft_max_batch(value: int | str) -> int | str:
    """B as an int >= 1, or "all" / "auto"; anything else is one line."""
    text = str(value).strip().lower()
    if text in (DRAFT_ALWAYS, DRAFT_AUTO):
        return text
    if not isinstance(value, bool) and text.isdigit() and 1 <= int(text) < _BATCH_BOUND:
        return int(text)
    raise InputError(f"--draft-max-batch {value}: expected a number of concurrent requests 1..{_BATCH_BOUND - 1} "
                     f"(draft at up to that many, none above), '{DRAFT_ALWAYS}' (always draft) or '{DRAFT_AUTO}'")


def _resolve_draft_max_batch(value: int | str, kind: str) -> int | None:
    """The B to write (None: no schedule). auto: the CPU-measured B for DART heads exported where no CUDA
    GPU is visible (a GPU verifies a batch's drafts far more cheaply: not measured here, so no limit)."""
    if value == DRAFT_ALWAYS:
        return None
    if value == DRAFT_AUTO:
        if kind != "dart":
            return None
        import torch

        return None if torch.cuda.is_available() else DART_CPU_DRAFT_MAX_BATCH
    return int(value)


def speculative_config(out_dir: Path, num_speculative_tokens: int, parallel_drafting: bool = False,
                       draft_max_batch: int | None = None) -> dict[str, Any]:
    """The dict vLLM takes as `speculative_config` for an exported head (DART: `parallel_drafting`,
    all k tokens from one forward; vLLM runs it on its EAGLE-3 path); with `draft_max_batch` B, vLLM
    drafts only while at most B requests are scheduled together (`draft_schedule`)."""
    spec: dict[str, Any] = {"model": str(out_dir.resolve()), "method": EAGLE3_METHOD,
                            "num_speculative_tokens": num_speculative_tokens}
    if parallel_drafting:
        spec["parallel_drafting"] = True
    if draft_max_batch is not None:
        spec["num_speculative_tokens_per_batch_size"] = draft_schedule(draft_max_batch, num_speculative_tokens)
    return spec


def _resolve_head(head: str) -> Path:
    """A local head directory (an embedded head name included); a Hub id is not looked up."""
    from dart_infer.data.assets import check_model_reference, resolve_model

    check_model_reference(head, "head", head=True)  # near-misses and missing paths: one line
    path = Path(resolve_model(head)).expanduser()
    if not path.is_dir():
        raise InputError(f"head={head}: not a local directory; dart-export reads a head written by dart-train "
                         "(<run>/head or <run>/best) or an embedded head name")
    if not (path / "config.json").is_file():
        raise InputError(f"head={head}: {path} has no config.json; is it a head directory (<run>/head)?")
    return path.resolve()


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: already exists and is not empty; choose a new directory "
                         "(an export never overwrites)")


def _verifier(head_dir: Path, config: dict[str, Any], target: str | None) -> str:
    """The target model the head was trained for: `--target`, else the head's `base_model`, else the
    dart-train run the head sits in (`<run>/config.yaml`: model.name_or_path). Embedded names become
    the local converted checkpoint, local paths absolute, so `vllm serve <export>` finds it."""
    from dart_infer.data.assets import EMBEDDED_MODELS, resolve_model

    name = target or config.get("base_model")
    if not name:
        run_config = head_dir.parent / "config.yaml"
        if run_config.is_file():
            from omegaconf import OmegaConf

            name = OmegaConf.select(OmegaConf.load(run_config), "model.name_or_path")
    if not name:
        raise InputError(f"head={head_dir}: cannot tell which target model it was trained for (no base_model "
                         "in its config.json, no dart-train config.yaml beside it); pass --target <model>")
    name = str(name)
    if name.lower() in EMBEDDED_MODELS:
        return resolve_model(name, convert=False)
    local = Path(name).expanduser()
    return str(local.resolve()) if local.exists() else name


def _target_architectures(verifier: str) -> list[str]:
    config = Path(verifier) / "config.json"
    if config.is_file():
        return list(json.loads(config.read_text()).get("architectures") or [])
    return []


def _load_eagle3(head_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config with every field explicit, state dict) of the head, checked by loading it (missing or
    mis-shaped tensors are refused here, not by the engine)."""
    from dart_infer.methods.eagle3 import load_eagle3_model

    try:
        model = load_eagle3_model(str(head_dir))
    except (ValueError, FileNotFoundError) as err:
        raise InputError(f"head={head_dir}: {err}") from err
    config = model.config.to_diff_dict()  # what save_pretrained writes: no transformers-internal defaults
    for key in _EAGLE3_TOP_LEVEL + ("ttt_length",):
        config[key] = getattr(model.config, key)
    config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return config, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _layer_config(config: dict[str, Any]) -> dict[str, Any]:
    layer = {k: v for k, v in config.items() if k not in _EAGLE3_TOP_LEVEL + _OURS_ONLY}
    layer["model_type"] = "llama"
    layer["tie_word_embeddings"] = False
    return layer


def _vllm_files(config: dict[str, Any], state: dict[str, Any], tokens: int, verifier: str) -> tuple[dict, dict]:
    out_config: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": EAGLE3_METHOD,
        "transformer_layer_config": _layer_config(config),
        "speculators_config": {
            "algorithm": EAGLE3_METHOD,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": _target_architectures(verifier)},
        },
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "tie_word_embeddings": False,
        "torch_dtype": config["dtype"],
    }
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:  # absent: vLLM's default = ours
        out_config["eagle_aux_hidden_state_layer_ids"] = list(config["eagle_aux_hidden_state_layer_ids"])
    tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items() if "embed_tokens" not in k}
    return out_config, tensors


def _sglang_files(config: dict[str, Any], state: dict[str, Any], verifier: str) -> tuple[dict, dict]:
    out_config = {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    out_config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", tie_word_embeddings=False,
                      base_model=verifier)
    eagle = {"use_aux_hidden_state": True}
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if min(ids) < 1:  # SGLang names layer outputs: the embedding (our 0) has no name there
            raise InputError(f"--format sglang: aux layer ids {ids} include 0 (the embeddings), which SGLang "
                             "cannot capture; export with --format vllm")
        eagle["eagle_aux_hidden_state_layer_ids"] = [int(i) - 1 for i in ids]
    out_config["eagle_config"] = eagle
    tensors = {k: v for k, v in state.items() if "embed_tokens" not in k}
    return out_config, tensors


def export_head(
    head: str,
    out: str | Path,
    fmt: str = "vllm",
    *,
    target: str | None = None,
    num_speculative_tokens: int | None = None,
    draft_max_batch: int | str = DRAFT_AUTO,
    ngram_model: str | None = None,
) -> ExportResult:
    """Write `head` (a directory or embedded head name) for `fmt` into the new directory `out`;
    `draft_max_batch`: B (draft at up to B concurrent requests), "all" or "auto" (module docstring);
    `ngram_model`: a trie (or "auto") the plugin's chain search uses (DART heads, `dart_export`)."""
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt}: unknown; one of {', '.join(FORMATS)}")
    draft_max_batch = _check_draft_max_batch(draft_max_batch)
    if num_speculative_tokens is not None and num_speculative_tokens < 1:
        raise InputError(f"--num-speculative-tokens {num_speculative_tokens}: must be >= 1")
    out_dir = Path(out).expanduser().resolve()
    _check_out(out_dir)
    head_dir = _resolve_head(head)
    raw = json.loads((head_dir / "config.json").read_text())
    kind = head_kind(raw)
    if kind == "dart" and fmt != "vllm":
        raise InputError(f"head={head}: a DART head; --format {fmt} cannot take it: DART serves in vLLM only "
                         "(its plugin, dart_infer.engines.vllm.plugin); use --format vllm")
    if kind not in ("eagle3", "dart"):
        raise InputError(f"head={head}: {head_dir / 'config.json'} is not a DART or EAGLE-3 head we can read "
                         "(architectures must be DartDraftModel or LlamaForCausalLMEagle3)")
    if ngram_model is not None and kind != "dart":
        raise InputError(f"--ngram-model: only a DART head's plugin searches a trie; {head} is an EAGLE-3 head "
                         "(vLLM drafts its chain itself): leave --ngram-model out")
    verifier = _verifier(head_dir, raw, target)  # before the slow part: a missing target fails first
    max_batch = _resolve_draft_max_batch(draft_max_batch, kind)
    chain = None
    if kind == "dart":
        from dart_infer.engines.dart_export import chain_config, dart_vllm_files
        from dart_infer.engines.vllm.plugin import CHAIN_CONFIG_KEY

        chain = chain_config(ngram_model, verifier) if ngram_model is not None else None
        out_config, tensors, tokens = dart_vllm_files(head_dir, verifier, num_speculative_tokens)
        if chain is not None:
            out_config[CHAIN_CONFIG_KEY] = chain
        spec = speculative_config(out_dir, tokens, parallel_drafting=True, draft_max_batch=max_batch)
    else:
        out_config, tensors, spec = _eagle3_files(head, head_dir, out_dir, fmt, verifier, num_speculative_tokens,
                                                  max_batch)
    _write(out_dir, out_config, tensors, spec)
    log.info("exported %s head %s (%s) to %s", kind, head_dir, fmt, out_dir)
    return ExportResult(out_dir, fmt, kind, spec, verifier, chain)


def _eagle3_files(head: str, head_dir: Path, out_dir: Path, fmt: str, verifier: str,
                  num_speculative_tokens: int | None, draft_max_batch: int | None) -> tuple[dict, dict, dict]:
    """(config.json, tensors, speculative config) of an EAGLE-3 head in `fmt`."""
    config, state = _load_eagle3(head_dir)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and len(set(ids)) != len(ids):
        # vLLM (and SGLang) capture a set of layers: a repeated id leaves fc short of its 3 states.
        raise InputError(f"head={head}: its aux layer ids {list(ids)} repeat a layer, which vLLM and SGLang "
                         "capture only once (fc would get fewer than 3 states); a target with 7 or more layers "
                         "avoids it")
    tokens = num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS
    if fmt == "vllm":
        out_config, tensors = _vllm_files(config, state, tokens, verifier)
    else:
        out_config, tensors = _sglang_files(config, state, verifier)
    return out_config, tensors, speculative_config(out_dir, tokens, draft_max_batch=draft_max_batch)


def _write(out_dir: Path, out_config: dict[str, Any], tensors: dict[str, Any], spec: dict[str, Any]) -> None:
    """Write the export directory atomically (all files or none)."""
    from safetensors.torch import save_file

    from dart_infer.common.files import atomic_directory

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out_dir) as staging:
        (staging / "config.json").write_text(json.dumps(out_config, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        (staging / SPEC_CONFIG_FILE).write_text(json.dumps(spec, indent=2) + "\n")
        # mkdtemp makes it private; a serving engine often runs as another user.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
