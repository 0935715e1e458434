"""Chains (`TreeSearchSettings(shape="chain")`, `dart_infer.tree.chain.best_chain`): the tree
search's best path, what an engine that verifies only a chain (vLLM) can take.

- a chain is a path of depth min(K, d) (K = remain_total), encoded as the loop's trees are;
- with a trie it is the best path the search reaches: against a plain Python beam search, and the
  best depth-K path of the tree (shape="tree") that the same search keeps;
- draft_top_k=1 is the argmax chain (vLLM's own proposer's draft), trie or not;
- greedy float32 decoding with a chain equals the base model's `generate(do_sample=False)`;
- the node counts a compiled target pads to, the config group `tree=chain`, and bad values.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import EOS, FIXTURES, check_encoding, golden_trie, reference, reference_beam_levels, tiny_pair

from dart_infer import DartModel, TreeSearchSettings
from dart_infer.methods.dart import METHOD
from dart_infer.tree.chain import best_chain, best_path, chain_search_nodes
from dart_infer.tree.search import tree_search
from dart_infer.tree.settings import draft_trees
from ngram_builder import NgramTrie


@pytest.fixture(scope="module")
def golden_cases() -> list[dict]:
    with open(FIXTURES / "golden60_search.jsonl") as f:
        return [json.loads(line) for line in f][:12]


@pytest.fixture(scope="module", name="golden_trie")
def golden_trie_fixture():
    return golden_trie()


def reference_best_path(topk_tokens, topk_probs, prompt, *, trie, levels, beam_width, ngram_weight=0.5,
                        eos=EOS) -> tuple[int, ...]:
    """dart-method.md §4's beam search written plainly (`helpers.reference_beam_levels`), then its best
    path at depth `levels`: the highest-scoring child of the last level (the first generated among equal
    scores)."""
    *_, last = reference_beam_levels(topk_tokens[:levels], topk_probs[:levels], prompt, trie=trie, eos=eos,
                                     beam_width=beam_width, ngram_weight=ngram_weight)
    return max(last, key=lambda child: child[1])[0]  # max keeps the first of equals


def random_rows(rng: np.random.Generator, levels: int, k: int, vocab: int = 60):
    tokens = np.stack([rng.choice(np.arange(3, vocab), size=k, replace=False) for _ in range(levels)])
    probs = torch.softmax(torch.tensor(rng.normal(0, 2.0, size=(levels, k))), dim=-1).to(torch.float32)
    prompt = torch.tensor(rng.integers(3, vocab, size=int(rng.integers(1, 6))), dtype=torch.int64)
    return torch.tensor(tokens, dtype=torch.int64), probs, prompt


def chain_settings(**fields) -> TreeSearchSettings:
    return TreeSearchSettings(shape="chain", **fields)


# ----------------------------------------------------------------------------------------------
# The chain itself


@pytest.mark.parametrize("use_trie", [False, True], ids=["no_trie", "trie"])
def test_a_chain_is_a_path_of_depth_at_most_k(use_trie: bool, golden_trie) -> None:
    base, head = tiny_pair(draft_length=4, draft_vocab_size=40)
    trie = NgramTrie(3, vocab_size=48) if use_trie else None
    if trie is not None:
        trie.add_tokens(torch.randint(3, 48, (400,), generator=torch.Generator().manual_seed(3)).tolist())
    logits = torch.randn(3, 4, 40, generator=torch.Generator().manual_seed(1)) * 3
    histories = [torch.tensor([5, 9, 11]), torch.tensor([7]), torch.tensor([1, 2, 30, 31, 4])]
    for k_top, beam, length in [(8, 4, 1), (8, 4, 3), (40, 20, 4), (5, 1, 9), (1, 1, 2)]:
        settings = chain_settings(draft_top_k=k_top, beam_width=beam, remain_total=length)
        trees = draft_trees(logits, head, histories, trie=trie, settings=settings, eos_token_ids=[EOS])
        for history, tree in zip(histories, trees, strict=True):
            n = 1 + min(length, 4)  # the root + min(K, d) nodes
            check_encoding(tree.tokens, tree.retrieve_indices, tree.mask, tree.positions, root=int(history[-1]))
            assert tree.parents.tolist() == list(range(-1, n - 1)) and tree.positions.tolist() == list(range(n))
            assert tree.retrieve_indices.tolist() == [list(range(n))]
            assert torch.equal(tree.mask, torch.ones(n, n, dtype=torch.bool).tril())
            assert METHOD.max_tree_nodes(settings) >= n


def test_without_a_trie_the_search_keeps_every_node_it_generates() -> None:
    rng = np.random.default_rng(0)
    for levels, k, beam in [(1, 7, 3), (4, 5, 3), (6, 4, 1), (3, 2, 40)]:
        tokens, probs, prompt = random_rows(rng, levels, k)
        total = chain_search_nodes(levels, k, beam)
        everything = tree_search(tokens, probs, None, prompt, eos_token_id=EOS, beam_width=beam, remain_total=10**6)
        assert everything[0].numel() == 1 + total


def test_with_a_trie_the_chain_is_the_best_path_of_the_search(golden_cases, golden_trie) -> None:
    """Against a plain Python beam search, and against the tree of shape="tree": wherever that tree
    (its best 60 nodes of all the search generated) reaches depth K, its best node there ends the chain."""
    checked = 0
    for case in golden_cases:
        tokens, probs, prompt = (torch.tensor(case[key]) for key in ("topk_tokens", "topk_probs", "prompt"))
        depth = tokens.shape[0]
        tree = tree_search(tokens, probs, golden_trie, prompt, eos_token_id=EOS, return_parents=True)
        for length in (1, 3, depth):
            settings = chain_settings(beam_width=20, remain_total=length)
            chain = best_chain(tokens, probs, golden_trie, prompt, settings=settings, eos_token_id=EOS)
            assert len(chain) == length
            expected = reference_best_path(case["topk_tokens"], case["topk_probs"], case["prompt"], trie=golden_trie,
                                           levels=length, beam_width=20)
            assert tuple(chain) == expected, (case["prompt"], length)
            positions = tree[3].tolist()
            if length <= max(positions):
                node = positions.index(length)  # the tree's best node at depth K
                path = best_path(tree[4][: node + 1], tree[3][: node + 1])
                assert tree[0][path[1:]].tolist() == chain
                checked += 1
    assert checked >= len(golden_cases)  # the tree reached depth 1 and 3 at least


def test_top_k_1_is_the_argmax_chain_trie_or_not(golden_trie) -> None:
    base, head = tiny_pair(draft_length=4, draft_vocab_size=40)  # a non-trivial d2t mapping
    trie = NgramTrie(3, vocab_size=48)
    trie.add_tokens(torch.randint(3, 48, (400,), generator=torch.Generator().manual_seed(4)).tolist())
    logits = torch.randn(4, 4, 40, generator=torch.Generator().manual_seed(2)) * 3
    histories = [torch.tensor([5, 9, int(t)]) for t in (11, 12, 13, 14)]
    argmax = head.draft_to_target(logits.argmax(-1))  # [N, d]: vLLM's proposer's tokens
    for length in (1, 3, 4, 8):
        for with_trie in (None, trie):
            settings = chain_settings(draft_top_k=1, beam_width=1, remain_total=length, ngram_weight=2.0)
            trees = draft_trees(logits, head, histories, trie=with_trie, settings=settings, eos_token_ids=[EOS])
            for i, tree in enumerate(trees):
                assert tree.tokens[1:].tolist() == argmax[i, :length].tolist()
        # Without a trie (and no EOS to put last) the best path is the argmax chain for any top-k.
        wide = chain_settings(draft_top_k=16, beam_width=4, remain_total=length)
        trees = draft_trees(logits, head, histories, trie=None, settings=wide, eos_token_ids=[])
        assert [t.tokens[1:].tolist() for t in trees] == argmax[:, :length].tolist()


# ----------------------------------------------------------------------------------------------
# Decoding with chains


CHAINS = [
    chain_settings(draft_top_k=8, beam_width=4, remain_total=4),  # K = d
    chain_settings(draft_top_k=48, beam_width=8, remain_total=2),  # K < d
    chain_settings(draft_top_k=1, beam_width=1, remain_total=8),  # the argmax chain, K > d
]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("tree", CHAINS, ids=["k_is_d", "short", "argmax"])
def test_greedy_output_with_a_chain_is_identical_to_generate(kind: str, tree: TreeSearchSettings) -> None:
    base, head = tiny_pair(kind, draft_vocab_size=40 if kind == "qwen3" else None)
    model = DartModel(base, head, tree=tree)
    assert model.draft_depth == min(4, tree.remain_total)
    for i in range(6):
        prompt = torch.randint(3, 48, (1, 3 + 4 * i), generator=torch.Generator().manual_seed(i))
        out, stats = model.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(out, reference(base, prompt, 40)), i
        assert stats.new_tokens == 40 and set(stats.tree_sizes) == {min(4, tree.remain_total)}
        assert max(stats.accept_lengths) <= min(4, tree.remain_total)


def test_a_trie_chosen_chain_is_lossless_and_accepts_more() -> None:
    base, head = tiny_pair()
    prompts = [torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(50 + i)) for i in range(4)]
    expected = [reference(base, p, 40) for p in prompts]
    trie = NgramTrie(3, vocab_size=48)
    for sequence in expected:  # the target's own continuations, as prompt lookup would find them
        trie.add_tokens(sequence[0].tolist())
    chain = chain_settings(draft_top_k=48, beam_width=8, remain_total=4, ngram_weight=2.0, ngram_on_first_level=True)
    with_trie, without = DartModel(base, head, trie=trie, tree=chain), DartModel(base, head, tree=chain)
    for prompt, want in zip(prompts, expected, strict=True):
        out, stats = with_trie.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(out, want)
        _, plain = without.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert stats.tau > 2.0 and stats.tau > plain.tau


# ----------------------------------------------------------------------------------------------
# Sizes, configs, errors


def test_a_compiled_target_pads_a_chain_to_its_own_size() -> None:
    _, head = tiny_pair(draft_length=4)
    for length in (1, 4, 6):
        chain = chain_settings(remain_total=length)
        assert METHOD.max_tree_nodes(chain) == 1 + length and METHOD.padded_tree_sizes(chain) == {1 + length}
        assert METHOD.max_depth(head, chain) == min(4, length)
    tree = TreeSearchSettings(remain_total=6, copy_span_tokens=3)
    assert METHOD.padded_tree_sizes(tree) == {7, 10} and METHOD.max_depth(head, tree) == 4


def test_tree_chain_is_a_config_group_option_the_checks_accept() -> None:
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from dart_infer.cli.checks import check_config
    from dart_infer.common.configs import configs_dir

    fields = yaml.safe_load((configs_dir() / "tree" / "chain.yaml").read_text())
    chain = TreeSearchSettings().with_overrides(fields)
    assert chain == chain_settings(draft_top_k=16, beam_width=4, remain_total=8)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(configs_dir()), version_base="1.3"):
            for overrides in (["tree=chain"], ["tree=chain", "tree.remain_total=3"], ["tree=gpu", "tree.shape=chain"]):
                cfg = compose(config_name="eval", overrides=overrides)
                check_config("dart-eval", cfg, compose(config_name="eval", overrides=overrides[:1]))
                settings = TreeSearchSettings().with_overrides(OmegaConf.to_container(cfg.tree, resolve=True))
                assert settings.shape == "chain"
            cfg = compose(config_name="train", overrides=["tree@train_eval.tree=chain"])
            assert TreeSearchSettings().with_overrides(OmegaConf.to_container(cfg.train_eval.tree)) == chain
    finally:
        GlobalHydra.instance().clear()


def test_a_bad_shape_and_chain_extras_are_one_line_errors() -> None:
    for make in (lambda: TreeSearchSettings(shape="star"), lambda: TreeSearchSettings().with_overrides({"shape": "Tree"})):
        with pytest.raises(ValueError, match=r"^shape must be one of tree, chain, got '(star|Tree)'$") as err:
            make()
        assert "\n" not in str(err.value)
    base, head = tiny_pair()
    with pytest.raises(ValueError, match="shape must be one of tree, chain"):
        DartModel(base, head, tree={"shape": "star"})
    for extra in ({"context_ngram_weight": 0.3}, {"copy_span_tokens": 10}):
        with pytest.raises(ValueError, match="shape=chain .*set context_ngram_weight=0 and copy_span_tokens=0") as err:
            chain_settings(**extra)
        assert "\n" not in str(err.value)
    # The CPU trees have both: choosing a chain on top of one says what to change.
    model = DartModel(base, head)  # float32 on a CPU: CPU_FP32_TREE
    with pytest.raises(ValueError, match="copy_span_tokens=0"):
        model.dart_generate(torch.tensor([[5, 6, 7]]), max_new_token_num=4, tree={"shape": "chain"})



def test_sampling_with_a_chain_runs_through_the_tree_rule() -> None:
    """A chain is a tree of one path: sampling takes the same lossless rule (tested on trees in
    test_sampling.py); here it runs, stays in budget and repeats under the same seed."""
    base, head = tiny_pair()
    model = DartModel(base, head, tree=CHAINS[0])
    prompt = torch.randint(3, 48, (1, 7), generator=torch.Generator().manual_seed(0))
    outs = [model.dart_generate(prompt, 1.0, 0.9, 0, max_new_token_num=30, generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert outs[0].shape == (1, 37) and torch.equal(outs[0], outs[1])
