"""DART decoding end to end: greedy output identical to the base model's, stopping rules, stats, errors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import COMMON, assert_greedy, reference, tiny_llama_config, tiny_pair
from transformers import LlamaForCausalLM

from dart_infer import DartDraftConfig, DartDraftModel, DartModel, TreeSearchSettings
from dart_infer.decoding.sampling import greedy_accept

TREES = [
    TreeSearchSettings(draft_top_k=48, beam_width=20, remain_total=40),  # wide: many accepted paths
    TreeSearchSettings(draft_top_k=5, beam_width=3, remain_total=6),
    TreeSearchSettings(draft_top_k=1, beam_width=1, remain_total=1),  # a single draft token
]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("tree", TREES, ids=["wide", "small", "single"])
def test_greedy_output_is_identical_to_generate(kind: str, tree: TreeSearchSettings) -> None:
    base, head = tiny_pair(kind, draft_vocab_size=40 if kind == "qwen3" else None)
    model = DartModel(base, head, tree=tree)
    accepted = 0
    for i in range(8):
        prompt = torch.randint(3, 48, (1, 3 + 4 * i), generator=torch.Generator().manual_seed(i))
        expected = reference(base, prompt, 40)
        out, stats = model.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(out, expected), i
        assert torch.equal(model.ar_generate(prompt, max_new_token_num=40), expected), i
        accepted += sum(stats.accept_lengths)
        assert stats.new_tokens == 40 and max(stats.tree_sizes) <= tree.remain_total
    if tree.remain_total >= 6:
        assert accepted > 0  # the accept-and-keep-path logic was exercised, not only bonus tokens


def test_greedy_accept_takes_the_longest_matching_path() -> None:
    # root(0) → 1:'5', 2:'6'; 1 → 3:'7'; 3 → 4:'8'; 2 → 5:'9'
    tokens = torch.tensor([4, 5, 6, 7, 8, 9])
    retrieve = torch.tensor([[0, 1, 3, 4], [0, 2, 5, -1]])
    logits = torch.zeros(6, 12)
    logits[0, 5] = logits[1, 7] = logits[3, 1] = 1.0  # target: 5 after root, 7 after '5', then 1
    logits[2, 9] = logits[4, 3] = logits[5, 3] = 1.0
    nodes, bonus = greedy_accept(tokens, retrieve, logits)
    assert nodes.tolist() == [0, 1, 3] and bonus == 1
    logits[0] = 0
    logits[0, 6] = 1.0  # now the second branch matches all the way to its leaf
    nodes, bonus = greedy_accept(tokens, retrieve, logits)
    assert nodes.tolist() == [0, 2, 5] and bonus == 3
    logits[0] = 0
    logits[0, 11] = 1.0  # nothing matches: root only, bonus from the root
    nodes, bonus = greedy_accept(tokens, retrieve, logits)
    assert nodes.tolist() == [0] and bonus == 11


def test_a_trie_guides_the_tree_and_output_stays_identical() -> None:
    """A trie of the target's own continuations (as prompt lookup would find them) makes long
    accepted paths; the output is still exactly the base model's."""
    from ngram_builder import NgramTrie

    base, head = tiny_pair()
    prompts = [
        torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(50 + i)) for i in range(4)
    ]
    expected = [reference(base, p, 40) for p in prompts]
    trie = NgramTrie(3, vocab_size=48)
    for sequence in expected:
        trie.add_tokens(sequence[0].tolist())
    tree = TreeSearchSettings(
        draft_top_k=48, beam_width=8, remain_total=24, ngram_weight=2.0, ngram_on_first_level=True
    )
    with_trie = DartModel(base, head, trie=trie, tree=tree)
    without = DartModel(base, head, tree=tree)
    for prompt, want in zip(prompts, expected, strict=True):
        out, stats = with_trie.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(out, want)
        _, plain = without.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert stats.tau > 2.0 and stats.tau > plain.tau


def test_a_trie_for_another_vocabulary_is_rejected() -> None:
    from ngram_builder import NgramTrie

    base, head = tiny_pair()
    trie = NgramTrie(3, vocab_size=100)
    trie.add_tokens([5, 99, 7])
    with pytest.raises(ValueError, match="vocabulary of 48"):
        DartModel(base, head, trie=trie)


def test_stops_at_eos_max_new_tokens_and_max_length() -> None:
    base, head = tiny_pair()
    prompt = torch.randint(3, 48, (1, 7), generator=torch.Generator().manual_seed(0))
    free = reference(base, prompt, 30)[0, 7:]
    eos = int(free[12])
    first = int((free == eos).nonzero()[0])
    base.generation_config.eos_token_id = eos
    model = DartModel(base, head, tree=TREES[0])
    out = model.dart_generate(prompt, max_new_token_num=30)
    assert (
        torch.equal(out, reference(base, prompt, 30)) and out.shape[1] == 7 + first + 1 and out[0, -1] == eos
    )
    base.generation_config.eos_token_id = None
    model = DartModel(base, head, tree=TREES[0])
    assert model.dart_generate(prompt, max_new_token_num=9).shape == (1, 16)
    assert model.dart_generate(prompt, max_new_token_num=30, max_length=20).shape == (1, 20)
    assert model.dart_generate(prompt, max_new_token_num=1).shape == (1, 8)
    assert model.ar_generate(prompt, max_new_token_num=30, max_length=11).shape == (1, 11)


def test_stream_yields_each_steps_tokens_and_stats_add_up() -> None:
    base, head = tiny_pair()
    model = DartModel(base, head, tree=TREES[0], profile=True)
    prompt = torch.randint(3, 48, (1, 9), generator=torch.Generator().manual_seed(1))
    steps = list(model.dart_generate_stream(prompt, max_new_token_num=25))
    stats = model.last_stats
    tokens = [t for s in steps for t in s.tokens]
    assert torch.equal(torch.tensor(tokens), reference(base, prompt, 25)[0, 9:])
    assert steps[0].accept_length == 0 and len(steps[0].tokens) == 1  # the prefill's token
    assert all(len(s.tokens) == s.accept_length + 1 for s in steps[1:-1])
    assert steps[-1].finished and not any(s.finished for s in steps[:-1])
    assert stats.steps == len(steps) - 1 and stats.new_tokens == 25
    assert stats.tau == pytest.approx(24 / stats.steps) and stats.tau >= 1.0
    assert set(stats.timings) == {"prefill", "draft", "search", "verify", "bookkeeping"}
    assert all(s.timings is not None for s in steps)
    assert 0 < sum(stats.timings.values()) <= stats.wall_time
    assert stats.as_dict()["tokens_per_second"] > 0


def test_bad_requests_fail_before_generation() -> None:
    base, head = tiny_pair()
    model = DartModel(base, head)
    prompt = torch.randint(3, 48, (1, 10))
    with pytest.raises(ValueError, match="empty prompt"):
        model.dart_generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="max_length"):
        model.dart_generate(prompt, max_length=10)
    with pytest.raises(ValueError, match="max_length"):
        model.dart_generate_stream(prompt, max_length=5)  # checked eagerly, not at the first next()
    with pytest.raises(ValueError, match="batch size 1"):
        model.dart_generate(prompt.repeat(2, 1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.dart_generate(torch.tensor([[3, 48]]))
    with pytest.raises(ValueError, match="top_p"):
        model.dart_generate(prompt, temperature=1.0, top_p=1.5)
    with pytest.raises(TypeError, match="unknown tree-search settings"):
        model.dart_generate(prompt, tree={"beam": 3})
    with pytest.raises(ValueError, match="remain_total"):
        model.dart_generate(prompt, tree={"remain_total": 0})


@pytest.mark.parametrize("entry", ["dart_generate", "dart_generate_stream", "ar_generate", "ar_generate_stream"])
def test_every_entry_point_rejects_non_finite_sampling_and_non_integer_lengths(entry: str) -> None:
    """NaN / inf temperatures used to decode silently and max_new_token_num=2.5 failed inside torch:
    each is now one line naming the argument, before the first token (streams included)."""
    base, head = tiny_pair()
    model = DartModel(base, head)
    generate = getattr(model, entry)
    prompt = torch.randint(3, 48, (1, 10), generator=torch.Generator().manual_seed(0))
    bad = [
        ({"temperature": float("nan")}, ValueError, "temperature must be a finite number >= 0 (0 = greedy), got nan"),
        ({"temperature": float("inf")}, ValueError, "temperature must be a finite number >= 0 (0 = greedy), got inf"),
        ({"temperature": 1.0, "top_p": float("nan")}, ValueError, "top_p must be in [0, 1]"),
        ({"temperature": 1.0, "top_k": 2.5}, TypeError, "top_k must be an int >= 0 (0 = off), got 2.5 (float)"),
        ({"temperature": 1.0, "top_k": True}, TypeError, "top_k must be an int >= 0 (0 = off), got True (bool)"),
        ({"max_new_token_num": 2.5}, TypeError, "max_new_token_num must be an int (a number of tokens), got 2.5"),
        ({"max_new_token_num": 8.0}, TypeError, "max_new_token_num must be an int (a number of tokens), got 8.0"),
        ({"max_new_token_num": True}, TypeError, "max_new_token_num must be an int (a number of tokens), got True"),
        ({"max_length": 30.5}, TypeError, "max_length must be an int (a number of tokens), got 30.5 (float)"),
        ({"max_length": False}, TypeError, "max_length must be an int (a number of tokens), got False (bool)"),
    ]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=re.escape(message)) as raised:
            generate(prompt, **{"max_new_token_num": 4, **kwargs})  # a stream raises here, not at next()
        assert "\n" not in str(raised.value), kwargs
    out = generate(prompt, max_new_token_num=np.int64(3), max_length=np.int64(40))  # numpy ints are ints
    tokens = out.shape[1] - 10 if isinstance(out, torch.Tensor) else sum(len(s.tokens) for s in out)
    assert tokens == 3


def test_head_that_does_not_fit_the_base_is_rejected() -> None:
    base, _ = tiny_pair()
    wider = LlamaForCausalLM(tiny_llama_config(**{**COMMON, "hidden_size": 48, "intermediate_size": 64}))
    with pytest.raises(ValueError, match="hidden_size 48 != base hidden_size 32"):
        DartModel(base, DartDraftModel(DartDraftConfig.from_target_config(wider.config)))
    other_vocab = LlamaForCausalLM(tiny_llama_config(**{**COMMON, "vocab_size": 60}))
    with pytest.raises(ValueError, match="vocab_size 60 != base vocab_size 48"):
        DartModel(base, DartDraftModel(DartDraftConfig.from_target_config(other_vocab.config)))
    cfg = DartDraftConfig.from_target_config(base.config, target_hidden_size=64)
    with pytest.raises(ValueError, match="target_hidden_size 64"):
        DartModel(base, DartDraftModel(cfg))


def test_embedding_is_reshared_after_moving_the_model() -> None:
    base, head = tiny_pair()
    model = DartModel(base, head).to(torch.float64)
    assert head.embed_tokens.weight.data_ptr() == base.get_input_embeddings().weight.data_ptr()
    assert head.embed_tokens.weight.dtype == torch.float64
    prompt = torch.randint(3, 48, (1, 6))
    assert model.dart_generate(prompt, max_new_token_num=5).shape == (1, 11)


@pytest.mark.smollm2
def test_from_pretrained_with_the_embedded_model_and_a_saved_head(tmp_path: Path, smollm2_dir: str) -> None:
    from transformers import AutoConfig

    head = DartDraftModel(
        DartDraftConfig.from_target_config(AutoConfig.from_pretrained(smollm2_dir), draft_length=4)
    )
    head.save_pretrained(tmp_path / "head")
    model = DartModel.from_pretrained(
        "smollm2-135m-instruct", str(tmp_path / "head"), dtype=torch.float32, tree={"remain_total": 4}
    )
    assert model.tokenizer is not None and model.draft_model.config.aux_layer_ids == [2, 15, 27]
    prompt = model.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.dart_generate(prompt, max_new_token_num=8)
    expected = model.base_model.generate(prompt, do_sample=False, max_new_tokens=8)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="DART head=.*missing: no such directory"):  # said before any load
        DartModel.from_pretrained("smollm2-135m-instruct", str(tmp_path / "missing"))


def sharegpt_trie(tokenizer, conversations: int):
    """A 3-gram trie of ShareGPT conversations (chat template applied) and the token counts."""
    from dart_infer.data.assets import tokenizer_fingerprint
    from dart_infer.data.conversations import load_conversations
    from ngram_builder import NgramTrie

    trie = NgramTrie(3, vocab_size=len(tokenizer), tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    for conversation in load_conversations("sharegpt", split="train", limit=conversations):
        ids = tokenizer.apply_chat_template(conversation.messages, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        trie.add_tokens([*ids, tokenizer.eos_token_id])
        counts += torch.bincount(torch.tensor(ids), minlength=len(tokenizer))
    return trie, counts


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize("half", [0, 1])
def test_smollm2_greedy_is_lossless_on_mtbench(smollm2_dir: str, smollm2_tokenizer, half: int) -> None:
    """10 MT-Bench prompts x 128 new tokens, the shipped head, a trie from ShareGPT, fp32: token for
    token what `generate(do_sample=False)` produces (`assert_greedy`: one forward checks every token,
    `generate` only where that disagrees). The trained head accepts more than one draft per step, so
    deep keep-paths run on real weights, in about half the steps (and time) an untrained head needed.
    In two halves of 5 prompts, so the two test workers can share them."""
    from dart_infer.data.conversations import load_conversations

    trie, _ = sharegpt_trie(smollm2_tokenizer, 300)
    # The fp32 CPU tree as served (context n-grams and copy spans included), at a fixed size.
    model = DartModel.from_pretrained(smollm2_dir, "dart-smollm2-135m-instruct", dtype=torch.float32,
                                      tree={"remain_total": 6})
    model.trie = trie
    steps = tokens = accepted = 0
    for conversation in load_conversations("mtbench", limit=10)[5 * half: 5 * half + 5]:
        prompt = smollm2_tokenizer.apply_chat_template(
            conversation.messages[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out, stats = model.dart_generate(prompt, max_new_token_num=128, return_stats=True)
        assert_greedy(model.base_model, prompt, out, 128, conversation.id)
        steps += stats.steps
        tokens += stats.new_tokens - 1
        accepted += sum(stats.accept_lengths)
    assert tokens >= 400 and accepted > steps  # τ > 2: deep paths kept, not just roots


@pytest.mark.smollm2
def test_smollm2_rejects_a_trie_from_another_tokenizer(smollm2_dir: str, smollm2_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    from ngram_builder import NgramTrie

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    head = DartDraftModel(DartDraftConfig.from_target_config(base.config, draft_length=2))
    trie = NgramTrie(3, vocab_size=len(smollm2_tokenizer), tokenizer_fingerprint="0123456789abcdef")
    trie.add_tokens([1, 2, 3])
    with pytest.raises(ValueError, match="0123456789abcdef"):
        DartModel(base, head, smollm2_tokenizer, trie)


def test_load_trie_prefers_the_requested_size_then_the_compact_format(tmp_path: Path) -> None:
    from dart_infer.data.loaders import load_trie
    from ngram_builder import NgramTrie

    for name, docs in (("full", [[5, 6, 7, 2]]), ("small", [[8, 9, 2]])):
        trie = NgramTrie(order=3, vocab_size=48)
        for doc in docs:
            trie.add_tokens(doc)
        trie.save_dart(tmp_path / f"{name}.trie")
        if name == "full":
            trie.save(tmp_path / "full.ngt")
    assert load_trie(tmp_path).probability([5, 6], [7])[0] == [1.0]  # full.ngt
    in_memory = load_trie(tmp_path, mmap=False)  # read in with its query index, not mapped
    assert in_memory.info()["memory_mapped"] is False and in_memory.probability([5, 6], [7])[0] == [1.0]
    assert load_trie(tmp_path, is_small_ngram=True).probability([8], [9])[0] == [1.0]  # small.trie
    (tmp_path / "full.ngt").unlink()
    assert load_trie(tmp_path).num_nodes == NgramTrie.load_dart(tmp_path / "full.trie").num_nodes
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no .ngt or .trie file"):
        load_trie(empty)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_trie(tmp_path / "missing.ngt")


# ------------------------------------------------------------------- dtypes and the default tree


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny base (with a tokenizer, as from_pretrained expects) and head saved as checkpoints."""
    base, head = tiny_pair()
    root = tmp_path_factory.mktemp("saved_pair")
    base.save_pretrained(root / "base")
    smollm2_tokenizer.save_pretrained(root / "base")
    head.save_pretrained(root / "head")
    return root


def test_from_pretrained_picks_the_tree_for_its_device(saved_pair: Path) -> None:
    import dataclasses

    import yaml

    from dart_infer.common.configs import configs_dir
    from dart_infer.tree.settings import CPU_FP32_TREE, CPU_TREE, default_tree

    model = DartModel.from_pretrained(str(saved_pair / "base"), str(saved_pair / "head"))  # float32
    assert model.tree == default_tree("cpu", torch.float32) == CPU_FP32_TREE and model.tree.remain_total == 6
    assert default_tree("cpu", torch.bfloat16) == default_tree("cpu") == CPU_TREE and CPU_TREE.remain_total == 24
    assert default_tree("cuda") == TreeSearchSettings() and default_tree("cuda").remain_total == 60
    # The config groups say the same as the code (tree=cpu / cpu-fp32 / gpu; tree=auto = the device's).
    for name, device, dtype in (("cpu", "cpu", torch.bfloat16), ("cpu-fp32", "cpu", torch.float32), ("gpu", "cuda", None)):
        fields = yaml.safe_load((configs_dir() / "tree" / f"{name}.yaml").read_text())
        assert TreeSearchSettings().with_overrides(fields) == default_tree(device, dtype), name
    auto = yaml.safe_load((configs_dir() / "tree" / "auto.yaml").read_text())
    assert auto.pop("remain_total") == "auto"  # the size fitted to the machine (tests/test_fitted_tree.py)
    assert TreeSearchSettings().with_overrides(auto) == TreeSearchSettings()  # the rest null: nothing overridden
    # A mapping overrides fields of the device's default; settings given whole are kept as given.
    small = DartModel.from_pretrained(str(saved_pair / "base"), str(saved_pair / "head"), tree={"remain_total": 5})
    assert small.tree == dataclasses.replace(CPU_FP32_TREE, remain_total=5)
    small.tree = TreeSearchSettings(remain_total=7)
    assert small.tree == TreeSearchSettings(remain_total=7)
    with pytest.raises(TypeError, match="unknown tree-search settings"):
        small.tree = {"beam": 2}
    prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(0))
    _, stats = model.dart_generate(prompt, max_new_token_num=20, return_stats=True)
    assert max(stats.tree_sizes) <= CPU_FP32_TREE.remain_total + CPU_FP32_TREE.copy_span_tokens


def test_bf16_serving_loads_and_copies_consistently(saved_pair: Path) -> None:
    from dart_infer.common.dtypes import as_dtype

    base, head = str(saved_pair / "base"), str(saved_pair / "head")
    fp32 = DartModel.from_pretrained(base, head, dtype="float32")
    bf16 = DartModel.from_pretrained(base, head, dtype="bfloat16")
    assert bf16.target.dtype == torch.bfloat16 and bf16.draft_model.fc.weight.dtype == torch.bfloat16
    copy = fp32.with_dtype("bf16")
    assert copy is not fp32 and fp32.target.dtype == torch.float32  # the source is untouched
    assert fp32.with_dtype(torch.float32) is fp32
    # Casting the float32 load is loading in bfloat16: the same weights, the same outputs.
    loaded, copied = bf16.base_model.state_dict(), copy.base_model.state_dict()
    assert loaded.keys() == copied.keys() and all(torch.equal(loaded[k], copied[k]) for k in loaded)
    assert all(torch.equal(a, b) for a, b in zip(bf16.draft_model.parameters(), copy.draft_model.parameters(), strict=True))
    # ... and the same buffers: the rotary inv_freq stays float32 in target and head alike (a bf16
    # one would rotate far positions wrongly: cos off by more than 1 at position 1,500).
    assert copy.draft_model.rotary_emb.inv_freq.dtype == bf16.draft_model.rotary_emb.inv_freq.dtype == torch.float32
    for (name, ours), (_, theirs) in zip(copy.base_model.named_buffers(), bf16.base_model.named_buffers(), strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
    assert copy.draft_model.embed_tokens.weight.data_ptr() == copy.base_model.get_input_embeddings().weight.data_ptr()
    prompt = torch.randint(3, 48, (1, 9), generator=torch.Generator().manual_seed(4))
    out = bf16.dart_generate(prompt, max_new_token_num=24)
    assert torch.equal(out, copy.dart_generate(prompt, max_new_token_num=24)) and out.shape == (1, 33)
    assert torch.equal(bf16.ar_generate(prompt, max_new_token_num=24), copy.ar_generate(prompt, max_new_token_num=24))
    sampled = bf16.dart_generate(prompt, 1.0, max_new_token_num=24, generator=torch.Generator().manual_seed(1))
    assert 9 < sampled.shape[1] <= 33  # (a sampled EOS may end it early)
    # fp32 stays the exactness mode.
    expected = fp32.base_model.generate(
        prompt, do_sample=False, max_new_tokens=24, eos_token_id=list(fp32.eos_token_ids), pad_token_id=0
    )
    assert torch.equal(fp32.dart_generate(prompt, max_new_token_num=24), expected)
    assert as_dtype("torch.bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        as_dtype("int8")
    with pytest.raises(TypeError, match="once"):
        DartModel.from_pretrained(base, head, dtype="float32", torch_dtype=torch.float32)
