"""The pieces `dart-train` wires together, built from its config: the target, the head, the state
source, the held-out evaluator, regenerated data, the trainer settings and the wandb run.

Each takes the resolved `train` config (configs/train.yaml), so `dart_train.cli.train`, the demo and
the benchmarks build the same things the same way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dart_infer.common.dtypes import dtype_name, resolve_dtype
from dart_train.trainer.settings import LoggingConfig, OptimConfig, TrainerConfig, TrainSettings, from_group

log = logging.getLogger(__name__)


def states_target_dtype(cfg: DictConfig) -> torch.dtype:
    """The dtype of the target's weights for computing training states (`states.target_dtype`).

    `auto`: bfloat16 where it measures faster, else `model.dtype` (`resolve_dtype`).
    Measured on this project's CPU (AVX512-BF16 + AMX), SmolLM2's forward over 2x1024 tokens: bf16
    weights 2,039 tok/s, fp32 weights under bf16 autocast 1,425, fp32 717 (autocast re-casts the
    weights every op)."""
    name = cfg.states.get("target_dtype", "auto")
    loaded = resolve_dtype(cfg.model.get("dtype", "float32")) or torch.float32
    chosen = resolve_dtype(name, otherwise=loaded) or loaded
    if str(name) == "auto":
        log.info("states.target_dtype=auto: %s", dtype_name(chosen))
    return chosen


def draft_method(cfg: DictConfig) -> Any:
    """The training hooks (`dart_train.objectives.methods`) of the head `draft.method` names: `dart` by default,
    `eagle3` with `draft=eagle3` (configs/draft/eagle3.yaml)."""
    from dart_train.objectives.methods import get_train_method

    return get_train_method(str(cfg.draft.get("method", "dart")))


def loss_gamma(cfg: DictConfig) -> float:
    """The per-position (DART) / per-step (EAGLE-3) loss weight base: `draft.gamma` when the draft
    group sets one (EAGLE-3: 0.8), else `optim.gamma` (DART: 0.6)."""
    gamma = cfg.draft.get("gamma")
    return float(gamma if gamma is not None else cfg.optim.gamma)


def build_head(target: Any, cfg: DictConfig, vocab_mapping_fn: Any, embedding: torch.Tensor | None = None) -> Any:
    """A random head shaped from the target's config (or `draft.init_from`), checked against it.
    `embedding`: the target's input embedding as served (default: the target's own weight)."""
    from dart_infer.methods import get_method, load_head
    from dart_infer.methods.loading import check_head_matches_target

    draft_cfg = cfg.draft
    method = draft_method(cfg)
    serving = get_method(method.name)  # the head and config classes
    if draft_cfg.init_from:
        head, found = load_head(str(draft_cfg.init_from), dtype=torch.float32)
        if found is not serving:
            raise ValueError(f"draft.init_from={draft_cfg.init_from} is a {found.display_name} head, but "
                             f"draft.method={method.name} trains a {serving.display_name} head")
    else:
        vocab = target.vocab_size
        draft_vocab = draft_cfg.draft_vocab_size or vocab
        if not 0 < int(draft_vocab) <= vocab:
            raise ValueError(
                f"draft.draft_vocab_size={draft_vocab} does not fit the target: it must be in 1..{vocab} "
                "(the target's vocabulary size)"
            )
        length_key = method.length_key
        steps = int(draft_cfg[length_key])
        if steps < 1:
            raise ValueError(f"draft.{length_key} must be >= 1, got {steps}")
        config = method.new_config(target, int(draft_vocab), steps)
        torch.manual_seed(int(cfg.seed))
        head = serving.head_class(config).float()
        head.set_vocab_mapping(vocab_mapping_fn(int(draft_vocab)))
        if draft_cfg.get("init_output_from_target", False):
            init_output_from_target(head, target.model)
    check_head_matches_target(head, target, serving.display_name)
    head.set_target_embedding(target.embedding_weight if embedding is None else embedding)
    return head.train()


def init_output_from_target(head: Any, model: Any) -> None:
    """Start the head's output where the target's is: `lm_head` rows = the target's output embedding
    at the draft vocabulary's ids, and the final norm's weight = the target's when both are the same
    kind of RMSNorm (the draft's final hidden state then starts in a space the target's head reads)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    output = model.get_output_embeddings()
    if output is None or tuple(output.weight.shape[1:]) != (head.config.hidden_size,):
        raise ValueError("draft.init_output_from_target needs a target whose output embedding is [vocab, hidden]")
    ids = torch.arange(head.d2t.numel()) + head.d2t.cpu()
    with torch.no_grad():
        head.lm_head.weight.copy_(output.weight.detach()[ids.to(output.weight.device)].float().cpu())
        norm = getattr(getattr(model, "model", None), "norm", None)
        if type(norm) is LlamaRMSNorm and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight.detach().float().cpu())
        else:
            log.info("draft.init_output_from_target: the target's final norm (%s) is not copied", type(norm).__name__)


def load_target(cfg: DictConfig) -> tuple[Any, Any, torch.Tensor]:
    """(target in the states dtype, tokenizer, the input embedding in `model.dtype` for the head).

    The target is loaded in `model.dtype` and cast once to `states.target_dtype`; the head keeps the
    embedding as loaded, since serving (fp32 by default) embeds with that one."""
    from transformers import AutoModelForCausalLM

    from dart_infer.data.assets import resolve_model
    from dart_infer.data.loaders import load_tokenizer
    from dart_infer.target.adapter import TargetModel
    from dart_train.data.template import check_chat_template

    path = resolve_model(str(cfg.model.name_or_path))
    # The chat template renders the training data and its loss mask; serving loads it the same way.
    # Checked first: a bad or missing model.chat_template fails before the model loads.
    tokenizer = load_tokenizer(path, cfg.model.get("chat_template"))
    check_chat_template(tokenizer)
    dtype = resolve_dtype(cfg.model.get("dtype", "float32")) or torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    if torch.cuda.is_available():
        model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    model.eval().requires_grad_(False)
    embedding = model.get_input_embeddings().weight.detach()
    states_dtype = states_target_dtype(cfg)
    if states_dtype != dtype:
        from dart_infer.common.dtypes import cast_parameters

        embedding = embedding.clone()
        cast_parameters(model, states_dtype)  # not .to(): rotary inv_freq buffers must stay float32
    return TargetModel(model), tokenizer, embedding


def vocab_mapping_fn(cfg: DictConfig, dataset: Any, tokenizer: Any, vocab_size: int) -> Callable[[int], torch.Tensor]:
    """`draft_vocab -> t2d` for `build_head`: the most frequent target tokens under the loss mask in the
    first `draft.vocab_max_sequences` sequences, the tokenizer's special tokens kept."""
    from dart_train.data.vocab import build_vocab_mapping

    def mapping(draft_vocab: int) -> torch.Tensor:
        limit = cfg.draft.vocab_max_sequences
        sequences = dataset.sequences if limit is None else dataset.sequences[: int(limit)]
        specials = [i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if i is not None]
        return build_vocab_mapping(sequences, vocab_size, draft_vocab, special_token_ids=specials)

    return mapping


def make_loader(cfg: DictConfig, dataset: Any, tokenizer: Any, rank: int = 0, world_size: int = 1) -> Any:
    """The resumable loader of this rank's micro-batches (`trainer`: packed rows with `pack_length`,
    else padded length buckets of `max_tokens` / `batch_size`)."""
    from dart_train.data.batching import LengthBucketBatchSampler, PackedBatchSampler, ResumableLoader

    t = trainer_config(cfg)
    longest = max(dataset.lengths)
    if t.pack_length:
        if t.batch_size:
            raise ValueError("trainer.batch_size does not apply to packed rows: set trainer.pack_length=null")
        row_tokens = max(t.pack_length, longest)
        sampler: Any = PackedBatchSampler(
            dataset.lengths, row_tokens=row_tokens, max_tokens=max(t.max_tokens or 0, row_tokens),
            seed=int(cfg.seed), rank=rank, world_size=world_size,
        )
    else:
        sampler = LengthBucketBatchSampler(
            dataset.lengths, max_tokens=max(t.max_tokens, longest) if t.max_tokens else None,
            batch_size=t.batch_size or None, seed=int(cfg.seed), rank=rank, world_size=world_size,
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return ResumableLoader(dataset, sampler, pad_token_id=int(pad))


def make_state_source(cfg: DictConfig, target: Any, dataset: Any, run_dir: Path) -> Any:
    from dart_train.states.cache_reader import OfflineStateSource
    from dart_train.states.cache_writer import cache_header, keyed_cache_dir, precompute_states
    from dart_train.states.online import OnlineStateSource

    states = cfg.states
    topk = states.topk
    if states.mode == "online":
        return OnlineStateSource(
            target,
            topk=int(topk) if topk is not None else None,
            hidden_dtype=resolve_dtype(states.hidden_dtype) or torch.bfloat16,
            autocast_dtype=resolve_dtype(states.autocast_dtype, otherwise=None),
            labels_only=True,
            compile=bool(states.get("compile", False)),
        )
    if states.mode == "offline":
        root = Path(states.cache_dir) if states.cache_dir else run_dir / "states"
        autocast = resolve_dtype(states.autocast_dtype, otherwise=None)
        # One cache per target, data and settings under the root: a change makes a new one, keeps the old.
        cache = keyed_cache_dir(root, cache_header(target, dataset, topk=int(topk), shard_size=int(states.shard_size),
                                                   autocast_dtype=autocast))
        log.info("offline states: %s", cache)
        precompute_states(  # resumable: only missing shards are computed
            target, dataset, cache, topk=int(topk), shard_size=int(states.shard_size),
            max_tokens=int(states.max_tokens), autocast_dtype=autocast,
            progress=bool(cfg.logging.progress),
        )
        return OfflineStateSource(cache, dataset, verify=bool(states.get("verify", True)))
    raise ValueError(f"states.mode must be 'online' or 'offline', got {states.mode!r}")


def make_evaluator(cfg: DictConfig, target: Any, tokenizer: Any, train_cfg: DictConfig) -> Any:
    ev = cfg.train_eval
    if not ev.enabled:
        return None
    from dart_infer.data.conversations import load_conversations
    from dart_infer.data.loaders import eos_token_ids
    from dart_infer.data.resolve import trie_from_config
    from dart_train.data.dataset import build_dataset
    from dart_train.states.online import OnlineStateSource
    from dart_train.trainer.simulated_tau import SimulatedTau

    conversations = load_conversations(str(ev.source), split=ev.split, limit=ev.limit)
    dataset = build_dataset(
        conversations, tokenizer, int(cfg.preprocess.max_length), template_kwargs=template_kwargs(cfg)
    )
    # As dart-eval resolves its trie: a missing, corrupt or mismatched one is refused before training.
    trie = trie_from_config(ev, (tokenizer, target.vocab_size), prefix="train_eval.")
    if trie.notice:
        (log.info if trie.trie is not None else log.warning)("%s", trie.notice)
    return SimulatedTau(
        dataset,
        OnlineStateSource(target, topk=int(cfg.states.topk) if cfg.states.topk else None,
                          hidden_dtype=torch.float32),
        eos_token_ids=eos_token_ids(target.model, tokenizer),
        trie=trie.trie,
        tree=OmegaConf.to_container(ev.tree, resolve=True),
        anchors_per_sequence=int(ev.anchors_per_sequence),
        reference=str(ev.reference),
        gamma=loss_gamma(train_cfg),
        method_trees=_method_trees(cfg),
    )


def _method_trees(cfg: DictConfig) -> dict[str, Any] | None:
    """The trained method's own tree for simulated τ when its draft group has one (EAGLE-3: `draft.tree`)."""
    if cfg.draft.get("tree") is None:
        return None
    return {draft_method(cfg).name: OmegaConf.to_container(cfg.draft.tree, resolve=True)}


def evaluate_other_head(evaluator: Any, name: str, trained: Any) -> dict[str, Any]:
    """`train_eval.compare_head`: another head (e.g. the shipped one) through the same held-out
    evaluation as the head just trained, in its dtype and on its device, so the two τ compare."""
    from dart_infer.methods import load_head

    weight = trained.fc.weight
    other = load_head(name, dtype=weight.dtype)[0].to(weight.device).eval()  # a head of any method
    other.set_target_embedding(trained.embed_tokens.weight)  # the embedding it is served with
    with torch.no_grad():
        result = dict(evaluator(other))
    log.info("train_eval.compare_head=%s: held-out τ %.3f (the trained head's is in metrics.jsonl)", name,
             result["tau"])
    return {"head": name, **result}


def regenerate_conversations(cfg: DictConfig, target: Any, tokenizer: Any, conversations: list[Any]) -> list[Any]:
    """Self-distillation: the target answers every prompt (resumable JSONL), then train on that.
    Conversations come back in the input's order, whatever order (or ranks) wrote them."""
    from dart_infer.data.conversations import load_conversations
    from dart_train.data.regenerate import regenerate

    output = regenerate_output(cfg)
    stats = regenerate(
        target.model, tokenizer, conversations, output, **_regenerate_options(cfg),
        model_name=str(cfg.model.name_or_path),
    )
    log.info("regenerated into %s: %s", output, stats)
    by_id = {str(c.id): c for c in load_conversations(str(output))}
    return [by_id[str(c.id)] for c in conversations if str(c.id) in by_id]


def _regenerate_options(cfg: DictConfig) -> dict[str, Any]:
    regen = cfg.preprocess.regenerate
    return {
        "max_new_tokens": int(regen.max_new_tokens), "batch_size": int(regen.batch_size),
        "temperature": float(regen.temperature), "top_p": float(regen.top_p), "seed": int(regen.seed),
        "max_prompt_tokens": int(regen.max_prompt_tokens) if regen.max_prompt_tokens else None,
        "keep_truncated": bool(regen.keep_truncated),
        "max_turns": int(regen.max_turns) if regen.get("max_turns") else None,
        "template_kwargs": template_kwargs(cfg),
        "chat_template": cfg.model.get("chat_template") or None,
    }


def regenerate_output(cfg: DictConfig) -> Path:
    """`preprocess.regenerate.output`, or (null) one file per model and generation settings:
    `<output_root>/regenerated/<model>/<key>.jsonl`, so changed settings never reuse old answers."""
    from dart_train.data.regenerate import generation_settings, regeneration_key

    regen = cfg.preprocess.regenerate
    if regen.output:
        return Path(str(regen.output))
    name = str(cfg.model.name_or_path)
    key = regeneration_key(generation_settings(name, **_regenerate_options(cfg)))
    return Path(str(cfg.output_root)) / "regenerated" / name.strip("/").replace("/", "--") / f"{key}.jsonl"


def template_kwargs(cfg: DictConfig) -> dict[str, Any] | None:
    kwargs = cfg.preprocess.get("template_kwargs")
    return OmegaConf.to_container(kwargs, resolve=True) if kwargs else None


def trainer_config(cfg: DictConfig) -> TrainerConfig:
    """The `trainer` group as its structured config (`dart_train.trainer.settings.TrainerConfig`)."""
    return from_group(TrainerConfig, cfg.trainer)


def settings_from_config(cfg: DictConfig) -> TrainSettings:
    """The engine's settings: the `optim`, `trainer` and `logging` groups read into their structured
    configs and taken field by field by name (`TrainSettings.from_groups`); decided here only what
    depends on more than one key."""
    trainer = trainer_config(cfg)
    autocast = resolve_dtype(trainer.autocast, otherwise=None)  # auto: bfloat16 where it measures faster
    every = cfg.train_eval.every if cfg.train_eval.enabled else None
    return TrainSettings.from_groups(
        from_group(OptimConfig, cfg.optim), trainer, from_group(LoggingConfig, cfg.logging),
        gamma=loss_gamma(cfg), autocast_dtype=dtype_name(autocast) if autocast is not None else None,
        seed=int(cfg.seed), eval_every=int(every) if every else None,
    )


def wandb_init_kwargs(cfg: DictConfig, run_dir: Path, resume_step: int = 0) -> dict[str, Any]:
    """`wandb.init` arguments. A resumed run logs into a new wandb run `<id>-from<step>` of the same group:
    wandb ignores steps at or below a run's last one, and a killed run logged past its checkpoint
    (its rewind/fork are server previews), so each segment's steps stay monotonic and none is dropped."""
    w = cfg.logging.wandb
    base = run_dir.name.replace("/", "_")
    config = OmegaConf.to_container(cfg, resolve=True)
    if resume_step:
        config = {**config, "resumed_from_step": resume_step}
    return {
        "project": str(w.project), "name": w.name or run_dir.name, "dir": str(run_dir),
        # null → $WANDB_MODE (the dart CLIs default it to offline); an explicit mode wins.
        "mode": str(w.mode) if w.mode else os.environ.get("WANDB_MODE", "offline"),
        "config": config, "group": base, "resume": "allow",
        "id": f"{base}-from{resume_step:08d}" if resume_step else base,
    }


def start_wandb(cfg: DictConfig, run_dir: Path, resume_step: int = 0) -> Any:
    w = cfg.logging.wandb
    if not w.enabled:
        return None
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed (pip install 'dart-spec[wandb]'): logging to metrics.jsonl only")
        return None
    kwargs = wandb_init_kwargs(cfg, run_dir, resume_step)
    if resume_step:
        log.info("wandb: resumed at step %d, logging to run %s (group %s)", resume_step, kwargs["id"], kwargs["group"])
    return wandb.init(**kwargs)
