"""The compiled target (`dart_infer.compiled_target`): static cache, fixed-shape frozen inductor steps.
Lossless like the eager adapter (fp32 greedy DART and AR equal `generate`), across cache growth and
keep-path gathers, with no recompilation from one request to the next; one-line refusals otherwise."""

from __future__ import annotations

import pytest
import torch
from helpers import reference, tiny_pair

from dart_infer import DartModel, TreeSearchSettings
from dart_infer.compiled_target import CompiledTarget, compile_decoding
from dart_infer.target import TargetModel

WIDE = TreeSearchSettings(draft_top_k=48, beam_width=20, remain_total=40)


def test_compiled_greedy_equals_generate_through_growth_and_reuse() -> None:
    torch.set_num_threads(1)
    base, head = tiny_pair("qwen3", draft_vocab_size=40)
    model = compile_decoding(DartModel(base, head, tree=WIDE), capacity=64)
    target = model.target
    assert isinstance(target, CompiledTarget) and target.tree_sizes == (41,)
    accepted = 0
    for i in range(4):
        # Prompt lengths 3..243: the last ones outgrow the 256-position cache (it doubles, contents kept).
        prompt = torch.randint(3, 48, (1, 3 + 80 * i), generator=torch.Generator().manual_seed(i))
        expected = reference(base, prompt, 40)
        out, stats = model.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(out, expected), i
        assert torch.equal(model.ar_generate(prompt, max_new_token_num=40), expected), i
        accepted += sum(stats.accept_lengths)
    assert target.capacity == 512 and accepted > 0
    # A second round of the same sizes reuses the compiled graphs: nothing is compiled again.
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for i in range(2):
        prompt = torch.randint(3, 48, (1, 5 + i), generator=torch.Generator().manual_seed(10 + i))
        assert torch.equal(model.dart_generate(prompt, max_new_token_num=24), reference(base, prompt, 24))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_compiled_decoding_refuses_what_it_cannot_run() -> None:
    base, head = tiny_pair("gemma3")
    with pytest.raises(ValueError, match="sliding-window"):
        compile_decoding(DartModel(base, head))
    base, head = tiny_pair("llama")
    target = CompiledTarget(base, head.config.aux_layer_ids, tree_sizes=(2, 4))
    cache = target.prefill(torch.tensor([[3, 4, 5]]))[2]
    eager = TargetModel(base, head.config.aux_layer_ids)
    for n in (2, 3):  # padded to 2 and to 4 nodes: the rows of a tree are the eager adapter's
        chain, depth, mask = torch.arange(6, 6 + n), torch.arange(n), torch.tril(torch.ones(n, n, dtype=torch.bool))
        eager_cache = eager.prefill(torch.tensor([[3, 4, 5]]))[2]
        expected = eager.verify(chain, depth, mask, eager_cache)[1]
        assert torch.allclose(target.verify(chain, depth, mask, cache)[1], expected, atol=1e-4)
        target.keep_path(cache, 3, [])
    tree = torch.arange(6)
    with pytest.raises(ValueError, match="does not fit the compiled tree size 4"):
        target.verify(tree, torch.zeros(6, dtype=torch.long), torch.eye(6, dtype=torch.bool), cache)
