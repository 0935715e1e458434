"""The draft-method registry: a head maps to its method by class and by config.json, `load_head`
loads either method's head, and `DartModel` serves a head of any method — or none (plain decoding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import reference, tiny_pair

from dart_infer.decoding.dart_model import DartModel
from dart_infer.methods import get_method, load_head, method_for_config, method_names, method_of
from dart_infer.methods.dart.model import AUTHORS_ARCHITECTURE, DartDraftModel
from dart_infer.methods.eagle3 import Eagle3DraftConfig, Eagle3DraftModel


def eagle3_head(base) -> Eagle3DraftModel:
    torch.manual_seed(1)
    return Eagle3DraftModel(Eagle3DraftConfig.from_target_config(base.config)).eval()


def test_a_head_maps_to_its_method_by_class_and_by_config() -> None:
    base, dart = tiny_pair()
    assert method_names()[:2] == ["dart", "eagle3"]
    assert method_of(dart) is get_method("dart") and method_of(eagle3_head(base)) is get_method("eagle3")
    with pytest.raises(TypeError, match="no draft method serves a Linear"):
        method_of(torch.nn.Linear(2, 2))
    with pytest.raises(KeyError, match="no draft method 'medusa'"):
        get_method("medusa")
    assert method_for_config({"architectures": ["LlamaForCausalLMEagle3"]}).name == "eagle3"
    for config in ({"architectures": ["DartDraftModel"]}, {"architectures": [AUTHORS_ARCHITECTURE]}, {}):
        assert method_for_config(config).name == "dart"  # the authors' layout and ours; unnamed: DART


def test_load_head_loads_either_method_from_its_config(tmp_path: Path) -> None:
    base, dart = tiny_pair()
    dart.save_pretrained(tmp_path / "dart")
    eagle3_head(base).save_pretrained(tmp_path / "eagle3")
    head, method = load_head(tmp_path / "dart", dtype=torch.float32)
    assert isinstance(head, DartDraftModel) and method.name == "dart"
    head, method = load_head(str(tmp_path / "eagle3"))
    assert isinstance(head, Eagle3DraftModel) and method.name == "eagle3"
    assert json.loads((tmp_path / "eagle3" / "config.json").read_text())["architectures"] == list(method.architectures)
    with pytest.raises(FileNotFoundError, match="DART head directory .* has no config.json"):
        (tmp_path / "empty").mkdir()
        load_head(tmp_path / "empty")


def test_dart_generate_drafts_with_the_heads_method() -> None:
    """One loop, one entry point: the same `dart_generate` on a DART and an EAGLE-3 head, both greedy-lossless."""
    base, dart = tiny_pair()
    prompt = torch.tensor([[3, 9, 27, 11]])
    expected = reference(base, prompt, 16)
    for head, tree in ((dart, {"remain_total": 6}), (eagle3_head(base), {"total_tokens": 6})):
        model = DartModel(base, head, tree=tree)
        out, stats = model.dart_generate(prompt, max_new_token_num=16, return_stats=True)
        assert torch.equal(out, expected), model.method.name
        assert max(stats.tree_sizes) <= 6 and model.draft_depth >= 1


def test_a_model_without_a_head_decodes_plainly() -> None:
    base, dart = tiny_pair()
    model = DartModel(base)
    prompt = torch.tensor([[5, 17, 33, 8]])
    assert model.method is None and model.tree is None and model.draft_depth == 0
    assert torch.equal(model.ar_generate(prompt, max_new_token_num=12), reference(base, prompt, 12))
    assert [len(s.tokens) for s in model.ar_generate_stream(prompt, max_new_token_num=3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="no draft head"):
        model.dart_generate(prompt)
    with pytest.raises(ValueError, match="without a draft head uses no n-gram trie"):
        DartModel(base, None, trie=object())
    copy = model.with_dtype("bfloat16")
    assert copy.draft_model is None and copy.target.dtype == torch.bfloat16
    # The same target with a head attached later: lossless DART on it.
    with_head = model.with_head(dart, tree={"remain_total": 4})
    assert with_head.base_model is base and with_head.method.name == "dart"
    assert torch.equal(with_head.dart_generate(prompt, max_new_token_num=12), reference(base, prompt, 12))
