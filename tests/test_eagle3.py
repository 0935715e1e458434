"""EAGLE-3 serving: the published checkpoint layout loads, greedy decoding is lossless, sampling
follows the target's distribution, the dynamic tree is EAGLE-2's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    COMMON,
    PUBLISHED_KEYS,
    check_first_step_follows_the_target,
    reference,
    small_vocab_dart,
    tiny_pair,
)
from safetensors.torch import save_file

from dart_infer.decoding.dart_model import DartModel
from dart_infer.methods.eagle3 import (
    Eagle3DraftConfig,
    Eagle3DraftModel,
    Eagle3TreeSettings,
    TreeDraftCache,
    load_eagle3_model,
)
from dart_infer.tree.settings import TreeSearchSettings


def eagle3_pair(kind: str = "llama", draft_vocab_size: int | None = None, seed: int = 0):
    base, _ = tiny_pair(kind, seed=seed)
    torch.manual_seed(seed + 1)
    head = Eagle3DraftModel(Eagle3DraftConfig.from_target_config(base.config, draft_vocab_size=draft_vocab_size))
    if draft_vocab_size is not None:
        subset = torch.randperm(COMMON["vocab_size"], generator=torch.Generator().manual_seed(seed))
        head.set_vocab_mapping(subset[:draft_vocab_size].sort().values)
    return base, head.eval()


def test_a_checkpoint_in_the_published_layout_loads(tmp_path: Path) -> None:
    """A head written by hand the way published EAGLE-3 heads are (Llama config with
    `LlamaForCausalLMEagle3`, `draft_vocab_size`, no fields of ours; the target's embedding included)."""
    hidden, vocab, draft_vocab = 32, 48, 20
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    draft_ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    state = {
        "embed_tokens.weight": rand(vocab, hidden),
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.hidden_norm.weight": rand(hidden), "midlayer.input_layernorm.weight": rand(hidden),
        "midlayer.post_attention_layernorm.weight": rand(hidden),
        "midlayer.self_attn.q_proj.weight": rand(4 * 8, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(2 * 8, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(2 * 8, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, 4 * 8),
        "midlayer.mlp.gate_proj.weight": rand(64, hidden), "midlayer.mlp.up_proj.weight": rand(64, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, 64),
        "norm.weight": rand(hidden), "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": draft_ids - torch.arange(draft_vocab), "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_hidden_layers": 1, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "model.safetensors"))
    head = load_eagle3_model(str(tmp_path))
    loaded = head.state_dict()
    assert set(loaded) == PUBLISHED_KEYS
    for key in PUBLISHED_KEYS:
        assert torch.equal(loaded[key], state[key]), key
    assert torch.equal(head.draft_to_target(torch.arange(draft_vocab)), draft_ids)
    assert head.config.target_hidden_size == hidden and head.config.aux_layer_ids is None

    # It serves on a base of that shape (aux layers default to (2, L//2, L-3), as vLLM's), losslessly.
    base, _ = tiny_pair()
    model = DartModel(base, head, tree={"top_k": 3, "depth": 3, "total_tokens": 8})
    assert model.target.aux_layer_ids == (2, 3, 3)
    prompt = torch.tensor([[3, 9, 27, 11]])
    assert torch.equal(model.dart_generate(prompt, max_new_token_num=12), reference(base, prompt, 12))

    # Saved again, it keeps that layout: the keys above, no embedding, the published config fields.
    out = tmp_path / "saved"
    head.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"] and saved["model_type"] == "llama"
    assert saved["draft_vocab_size"] == draft_vocab and saved["num_hidden_layers"] == 1
    assert saved["target_hidden_size"] == hidden
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert set(fh.keys()) == PUBLISHED_KEYS


def test_an_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    _, head = eagle3_pair()
    head.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    del state["midlayer.hidden_norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="hidden_norm"):
        load_eagle3_model(str(tmp_path))


TREES = [
    Eagle3TreeSettings(top_k=8, depth=5, total_tokens=40),  # wide: many accepted paths
    Eagle3TreeSettings(top_k=3, depth=4, total_tokens=6),
    Eagle3TreeSettings(top_k=1, depth=1, total_tokens=1),  # a single draft token
]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("tree", TREES, ids=["wide", "small", "single"])
def test_greedy_output_is_identical_to_generate(kind: str, tree: Eagle3TreeSettings) -> None:
    base, head = eagle3_pair(kind, draft_vocab_size=40 if kind == "qwen3" else None)
    model = DartModel(base, head, tree=tree)
    accepted = 0
    for i in range(6):
        prompt = torch.randint(3, 48, (1, 3 + 4 * i), generator=torch.Generator().manual_seed(i))
        expected = reference(base, prompt, 40)
        out, stats = model.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(out, expected), i
        accepted += sum(stats.accept_lengths)
        assert stats.new_tokens == 40 and max(stats.tree_sizes) <= tree.total_tokens
    if tree.total_tokens >= 6:
        assert accepted > 0  # the accept-and-keep-path logic was exercised, not only bonus tokens


def test_a_head_that_drafts_the_target_is_accepted_deeply() -> None:
    """A draft vocabulary-wide head whose tree always holds the target's continuation: with the
    target's own greedy tokens in the tree, acceptance reaches the full depth (the tree's paths,
    positions and the draft cache across steps line up with the target's)."""
    base, head = eagle3_pair()
    model = DartModel(base, head, tree={"top_k": 48, "depth": 3, "total_tokens": 48 * 3})
    prompt = torch.tensor([[5, 17, 33, 8, 21]])
    out, stats = model.dart_generate(prompt, max_new_token_num=30, return_stats=True)
    assert torch.equal(out, reference(base, prompt, 30))
    # top_k = vocabulary at level 1: every step accepts at least one token.
    assert min(stats.accept_lengths) >= 1


def test_dynamic_tree_is_eagle2s() -> None:
    """Level sizes, cumulative-probability selection, parents and masks of `expand_tree`."""
    base, head = eagle3_pair(draft_vocab_size=30)
    head.set_target_embedding(base.get_input_embeddings().weight)
    from dart_infer.methods.eagle3 import Eagle3Drafter

    drafter = Eagle3Drafter(head, Eagle3TreeSettings(top_k=3, depth=4, total_tokens=10))
    aux = torch.randn(1, 6, 3 * 32, generator=torch.Generator().manual_seed(0))
    drafter.update(aux, torch.tensor([[8, 15, 16, 23, 42, 7]]))
    length = drafter.cache.length
    tree = drafter.propose(torch.tensor([4, 8, 15, 16, 23, 42, 7]))
    assert drafter.cache.length == length and drafter.cache._pending == 0  # tree K/V not kept
    n = tree.tokens.numel()
    assert n == 11 and int(tree.tokens[0]) == 7
    assert int(tree.positions.max()) <= 4
    # Ancestor-closed, parents first, positions = depth; the mask is ancestor-or-self.
    for node in range(1, n):
        parent = int(tree.parents[node])
        assert 0 <= parent < node and tree.positions[node] == tree.positions[parent] + 1
        assert torch.equal(tree.mask[node], tree.mask[parent] | (torch.arange(n) == node))
    # Level 1 holds the top-3 draft tokens of the last prefix position, in target ids.
    logp = torch.log_softmax(drafter.last_logits, -1)
    top3 = set(head.draft_to_target(torch.topk(logp, 3).indices).tolist())
    assert {int(t) for t, p in zip(tree.tokens, tree.positions, strict=True) if p == 1} <= top3
    # Every root-to-leaf path is a retrieve row.
    leaves = set(range(n)) - set(tree.parents[1:].tolist())
    assert {int(row[row >= 0][-1]) for row in tree.retrieve_indices} == leaves


def test_tree_draft_cache_stages_after_the_prefix_and_discards() -> None:
    cache = TreeDraftCache()
    k = torch.arange(4.0).view(1, 1, 4, 1)
    cache.extend(k, k)
    cache.commit(4)
    keys, _ = cache.extend(torch.full((1, 1, 2, 1), 10.0), torch.zeros(1, 1, 2, 1))
    keys, _ = cache.extend(torch.full((1, 1, 1, 1), 20.0), torch.zeros(1, 1, 1, 1))
    assert keys.flatten().tolist() == [0, 1, 2, 3, 10, 10, 20]
    cache.discard()
    keys, _ = cache.extend(torch.full((1, 1, 1, 1), 5.0), torch.zeros(1, 1, 1, 1))
    cache.commit(1)
    assert keys.flatten().tolist() == [0, 1, 2, 3, 5] and cache.length == 5


def test_stream_with_dtype_and_errors() -> None:
    base, head = eagle3_pair()
    model = DartModel(base, head, tree={"top_k": 4, "depth": 3, "total_tokens": 8})
    prompt = torch.tensor([[3, 4, 5, 6]])
    steps = list(model.dart_generate_stream(prompt, max_new_token_num=20))
    assert sum(len(s.tokens) for s in steps) == 20 and steps[-1].finished
    assert model.last_stats is not None and model.last_stats.tau >= 1.0
    copy = model.with_dtype("bfloat16")
    assert copy.method.name == "eagle3" and copy.draft_model.fc.weight.dtype == torch.bfloat16
    assert copy.tree == model.tree
    assert copy.dart_generate(prompt, max_new_token_num=5).shape == (1, 9)
    # Per-call settings are the head's method's: EAGLE-3's names, not DART's.
    assert torch.equal(model.dart_generate(prompt, max_new_token_num=12, tree={"total_tokens": 3}),
                       reference(base, prompt, 12))
    with pytest.raises(TypeError, match="unknown EAGLE-3 tree settings"):
        model.dart_generate(prompt, tree={"remain_total": 3})
    with pytest.raises(TypeError, match="unknown EAGLE-3 tree settings"):
        DartModel(base, head, tree={"draft_top_k": 3})
    with pytest.raises(TypeError, match="EAGLE-3 tree settings must be Eagle3TreeSettings"):
        DartModel(base, head, tree=TreeSearchSettings())
    with pytest.raises(ValueError, match="EAGLE-3 decoding uses no n-gram trie"):
        DartModel(base, head, trie=object())
    with pytest.raises(TypeError, match="no draft method serves a Linear"):
        DartModel(base, torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 0.0), pytest.param(0.8, 6, 0.9, marks=pytest.mark.slow)]
)
def test_sampling_emits_the_targets_distribution(temperature: float, top_k: int, top_p: float) -> None:
    """DART's statistical check (tests/test_sampling.py) on EAGLE-3's trees."""
    vocab = 10
    base = small_vocab_dart(vocab).base_model
    torch.manual_seed(1)
    head = Eagle3DraftModel(Eagle3DraftConfig.from_target_config(base.config)).eval()
    model = DartModel(base, head, tree={"top_k": vocab, "depth": 3, "total_tokens": 24})
    check_first_step_follows_the_target(model, model.dart_generate, temperature, top_k, top_p)


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_greedy_is_lossless(smollm2_dir: str, smollm2_tokenizer) -> None:
    """Real shapes (9 heads / 3 KV heads, a 4,096-token draft vocabulary over 49,152): an MT-Bench
    prompt, fp32, a random head with the CPU tree: token for token `generate(do_sample=False)`."""
    from transformers import AutoModelForCausalLM

    from dart_infer.data.conversations import load_conversations

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    head = Eagle3DraftModel(Eagle3DraftConfig.from_target_config(base.config, draft_vocab_size=4096))
    head.set_vocab_mapping(torch.randperm(base.config.vocab_size)[:4096].sort().values)
    model = DartModel(base, head.eval(), smollm2_tokenizer)
    assert model.tree.total_tokens == 12  # the CPU default
    for conversation in load_conversations("mtbench", limit=1):
        prompt = smollm2_tokenizer.apply_chat_template(
            conversation.messages[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        expected = base.generate(prompt, do_sample=False, max_new_tokens=32)
        assert torch.equal(model.dart_generate(prompt, max_new_token_num=32), expected), conversation.id
