"""The target adapter through transformers' own code: aux states, one-forward tree verify, keep-path."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama_config
from transformers import LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dart_infer.target.adapter import TargetModel, aux_layer_ids

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)


def tiny_base(kind: str, attn: str = "sdpa", seed: int = 0):
    """A tiny random Llama or Qwen3 (`COMMON` fields) in eval mode."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(tiny_llama_config(**COMMON, attn_implementation=attn))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, attn_implementation=attn))
    return model.eval()


def chain_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens[None]).logits[0]


def hand_tree():
    """root(0) → a(1), b(2); a → c(3), d(4); c → e(5); b → f(6). Nodes in depth order."""
    parents = [-1, 0, 0, 1, 1, 3, 2]
    depth = torch.tensor([0, 1, 1, 2, 2, 3, 2])
    mask = torch.zeros(7, 7, dtype=torch.bool)
    for node, _ in enumerate(parents):
        walk = node
        while walk >= 0:
            mask[node, walk] = True
            walk = parents[walk]
    return parents, depth, mask


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_aux_layer_ids() -> None:
    assert aux_layer_ids(30) == (2, 15, 27)
    assert aux_layer_ids(36) == (2, 18, 33)
    assert aux_layer_ids(3) == (2, 1, 0)
    with pytest.raises(ValueError, match="at least 3"):
        aux_layer_ids(2)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_states_are_the_inputs_of_layers_2_mid_and_l_minus_3(kind: str) -> None:
    model = tiny_base(kind)
    target = TargetModel(model)
    assert target.aux_layer_ids == (2, 3, 4)
    ids = torch.randint(0, 97, (2, 9))
    aux, logits = target.states(ids)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    expected = torch.cat([out.hidden_states[2], out.hidden_states[3], out.hidden_states[4]], dim=-1)
    assert aux.shape == (2, 9, 96) and torch.equal(aux, expected)
    assert torch.equal(logits, out.logits)
    # hidden_states[i] is the input of decoder layer i.
    captured = {}

    def grab(module, args, kwargs) -> None:
        captured["x"] = args[0] if args else kwargs["hidden_states"]

    handle = model.model.layers[4].register_forward_pre_hook(grab, with_kwargs=True)
    target.states(ids)
    handle.remove()
    assert torch.equal(captured["x"], aux[..., 64:])


@pytest.mark.parametrize(("kind", "attn"), [("llama", "sdpa"), ("qwen3", "sdpa"), ("llama", "eager")])
def test_tree_verify_in_one_forward_equals_each_path_alone(kind: str, attn: str) -> None:
    model = tiny_base(kind, attn)
    target = TargetModel(model)
    prompt = torch.randint(0, 97, (12,))
    aux_prompt, last, cache = target.prefill(prompt[None])
    assert aux_prompt.shape == (1, 12, 96) and cache.get_seq_length() == 12
    assert torch.allclose(last, chain_logits(model, prompt)[-1], atol=1e-5)

    parents, depth, mask = hand_tree()
    tokens = torch.tensor([40, 5, 6, 7, 8, 9, 10])
    tree_aux, tree_logits = target.verify(tokens, depth, mask, cache)
    assert tree_logits.shape == (7, 97) and tree_aux.shape == (7, 96)
    assert cache.get_seq_length() == 19
    for node in range(7):
        path = tokens[path_to(parents, node)]
        expected = chain_logits(model, torch.cat([prompt, path]))[-1]
        assert torch.allclose(tree_logits[node], expected, atol=1e-5), node


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_keep_path_leaves_exactly_the_accepted_entries(kind: str) -> None:
    model = tiny_base(kind)
    target = TargetModel(model)
    prompt = torch.randint(0, 97, (10,))
    _, _, cache = target.prefill(prompt[None])
    parents, depth, mask = hand_tree()
    tokens = torch.tensor([40, 5, 6, 7, 8, 9, 10])
    tree_aux, _ = target.verify(tokens, depth, mask, cache)
    accepted = path_to(parents, 5)  # root → a → c → e
    # Reference K/V: the accepted path computed as a plain chain.
    _, _, reference = target.prefill(torch.cat([prompt, tokens[accepted]])[None])
    target.keep_path(cache, 10, torch.tensor(accepted))
    assert cache.get_seq_length() == 14
    for ours, theirs in zip(cache.layers, reference.layers, strict=True):
        assert torch.allclose(ours.keys, theirs.keys, atol=1e-5)
        assert torch.allclose(ours.values, theirs.values, atol=1e-5)
    # Decoding continues from the kept path exactly as from a recomputed prefix.
    aux_next, logits_next, _ = target.prefill(torch.tensor([[11]]), cache)
    full = torch.cat([prompt, tokens[accepted], torch.tensor([11])])
    assert torch.allclose(logits_next, chain_logits(model, full)[-1], atol=1e-5)
    aux_full, _ = target.states(full[None])
    assert torch.allclose(aux_next[0, -1], aux_full[0, -1], atol=1e-5)
    assert torch.allclose(tree_aux[accepted], aux_full[0, 10:14], atol=1e-5)


def test_keep_path_with_only_the_root_and_bad_indices() -> None:
    target = TargetModel(tiny_base("llama"))
    _, _, cache = target.prefill(torch.randint(0, 97, (1, 6)))
    _, depth, mask = hand_tree()
    target.verify(torch.arange(7), depth, mask, cache)
    target.keep_path(cache, 6, [0])
    assert cache.get_seq_length() == 7
    target.verify(torch.arange(7), depth, mask, cache)
    with pytest.raises(IndexError):
        target.keep_path(cache, 7, [0, 9])


def test_verify_rejects_bad_shapes_and_unsupported_backends() -> None:
    target = TargetModel(tiny_base("llama"))
    _, _, cache = target.prefill(torch.randint(0, 97, (1, 4)))
    with pytest.raises(ValueError, match="tree shapes disagree"):
        target.verify(torch.arange(3), torch.arange(3), torch.ones(2, 2, dtype=torch.bool), cache)
    with pytest.raises(ValueError, match="empty prompt"):
        target.prefill(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="aux layer ids"):
        TargetModel(tiny_base("llama"), layer_ids=(2, 3, 7))
    flash = tiny_base("llama")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="4D mask"):
        TargetModel(flash).verify(torch.arange(1), torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), cache)


@pytest.mark.smollm2
def test_smollm2_tree_verify_matches_paths(smollm2_dir: str, smollm2_tokenizer) -> None:
    model = LlamaForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    target = TargetModel(model)
    assert target.aux_layer_ids == (2, 15, 27)
    prompt = smollm2_tokenizer("The capital of France is", return_tensors="pt").input_ids[0]
    _, last, cache = target.prefill(prompt[None])
    parents, depth, mask = hand_tree()
    tokens = torch.tensor([int(last.argmax()), 11, 12, 13, 14, 15, 16])
    _, tree_logits = target.verify(tokens, depth, mask, cache)
    for node in range(7):
        expected = chain_logits(model, torch.cat([prompt, tokens[path_to(parents, node)]]))[-1]
        assert torch.allclose(tree_logits[node], expected, atol=1e-4), node
