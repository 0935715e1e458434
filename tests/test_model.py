"""The DART draft head: config derivation, checkpoint layout (ours and the authors'), KV cache, masks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama, tiny_llama_config
from safetensors.torch import load_file, save_file
from transformers import Gemma3TextConfig, Qwen3Config

from dart_infer.methods.dart.model import (
    CHECKPOINT_KEYS,
    DartDraftConfig,
    DartDraftModel,
    DraftKVCache,
    causal_mask,
)
from dart_infer.methods.loading import load_draft_model

# The heads' target: tiny_llama fields, with the sizes, RoPE base and norm epsilon the config tests check.
TARGET = dict(vocab_size=101, intermediate_size=48, head_dim=8, max_position_embeddings=256, rope_theta=5000.0,
              rms_norm_eps=1e-5)


def tiny_head(draft_length: int = 4, draft_vocab_size: int | None = None, seed: int = 0) -> DartDraftModel:
    target = tiny_llama(seed, **TARGET)
    head = DartDraftModel(
        DartDraftConfig.from_target_config(
            target.config, draft_length=draft_length, draft_vocab_size=draft_vocab_size
        )
    )
    head.set_target_embedding(target.get_input_embeddings().weight)
    return head


def test_config_follows_llama_and_qwen3_targets() -> None:
    llama = tiny_llama_config(**TARGET)
    cfg = DartDraftConfig.from_target_config(llama, draft_vocab_size=64)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        32,
        48,
        4,
        2,
    )
    assert cfg.head_dim == 8 and cfg.rms_norm_eps == 1e-5 and cfg.rope_parameters["rope_theta"] == 5000.0
    assert cfg.vocab_size == 101 and cfg.draft_vocab_size == 64 and cfg.target_hidden_size == 32
    assert cfg.draft_length == 8 and cfg.num_hidden_layers == 1
    assert cfg.aux_layer_ids == [2, 3, 3]

    qwen = Qwen3Config(
        vocab_size=150,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # Qwen3 decouples head_dim from hidden/heads
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
    )
    cfg = DartDraftConfig.from_target_config(qwen, draft_length=6)
    assert cfg.head_dim == 32 and cfg.num_key_value_heads == 2
    assert cfg.rope_parameters["rope_theta"] == 1_000_000.0
    assert cfg.aux_layer_ids == [2, 14, 25] and cfg.draft_length == 6 and cfg.draft_vocab_size == 150


def test_bad_configs_are_rejected() -> None:
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DartDraftConfig.from_target_config(tiny_llama_config(**TARGET), draft_vocab_size=500)
    with pytest.raises(ValueError, match="draft_length"):
        DartDraftConfig.from_target_config(tiny_llama_config(**TARGET), draft_length=0)
    with pytest.raises(ValueError, match="at least 3 decoder layers"):
        DartDraftConfig.from_target_config(tiny_llama_config(**TARGET, num_hidden_layers=2))


def test_a_hybrid_target_gives_the_head_its_full_attention_rope() -> None:
    """Gemma 3 keeps RoPE settings per layer type (local 10k, global 1M): the head, one layer over the
    whole prefix, takes the full-attention set, not a nested dict with a default theta beside it."""
    target = Gemma3TextConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, sliding_window=4,
    )
    assert set(target.rope_parameters) == {"full_attention", "sliding_attention"}
    config = DartDraftConfig.from_target_config(target)
    assert config.rope_parameters["rope_theta"] == target.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert "full_attention" not in config.rope_parameters


def test_state_dict_has_exactly_the_authors_keys_and_round_trips(tmp_path: Path) -> None:
    head = tiny_head(draft_vocab_size=50)
    head.set_vocab_mapping(torch.arange(0, 100, 2))
    assert sorted(head.state_dict()) == sorted(CHECKPOINT_KEYS)
    # The shared embedding is neither saved nor trained by this module.
    assert all(p is not head.embed_tokens.weight for p in head.parameters())
    head.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(saved) == sorted(CHECKPOINT_KEYS)
    assert saved["t2d"].dtype == torch.bool and saved["d2t"].dtype == torch.int64
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (
        config["draft_length"] == 3  # the authors' meaning on disk: mask positions (d - 1)
        and config["draft_vocab_size"] == 50
        and config["target_hidden_size"] == 32
    )
    assert config["rope_theta"] == 5000.0  # legacy field, read by transformers-4.x loaders

    loaded = load_draft_model(tmp_path)
    assert loaded.config.rope_parameters == head.config.rope_parameters
    assert loaded.config.aux_layer_ids == [2, 3, 3] and loaded.config.draft_length == 4
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.embed_tokens is None  # attached from the target, never from the checkpoint


def test_loads_a_checkpoint_in_the_authors_layout(tmp_path: Path) -> None:
    """config.json as their heads ship it (Llama fields, legacy rope keys, no aux_layer_ids) and a
    safetensors file with their keys plus an `embed_tokens.weight` that must be ignored."""
    hidden, heads, kv, head_dim, inter, vocab, draft_vocab = 32, 4, 2, 8, 48, 101, 40
    config = {
        "architectures": ["LlamaForCausalLMDart"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "draft_length": 7,  # their layer appends 7 masks: 8 logit rows per forward
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(1)
    draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {
        "fc.weight": torch.randn(hidden, 3 * hidden, generator=g),
        "midlayer.mask_rep": torch.randn(2 * hidden, generator=g),
        "midlayer.hidden_norm.weight": torch.rand(hidden, generator=g),
        "midlayer.input_layernorm.weight": torch.rand(hidden, generator=g),
        "midlayer.post_attention_layernorm.weight": torch.rand(hidden, generator=g),
        "midlayer.self_attn.q_proj.weight": torch.randn(heads * head_dim, 2 * hidden, generator=g),
        "midlayer.self_attn.k_proj.weight": torch.randn(kv * head_dim, 2 * hidden, generator=g),
        "midlayer.self_attn.v_proj.weight": torch.randn(kv * head_dim, 2 * hidden, generator=g),
        "midlayer.self_attn.o_proj.weight": torch.randn(hidden, heads * head_dim, generator=g),
        "midlayer.mlp.gate_proj.weight": torch.randn(inter, hidden, generator=g),
        "midlayer.mlp.up_proj.weight": torch.randn(inter, hidden, generator=g),
        "midlayer.mlp.down_proj.weight": torch.randn(hidden, inter, generator=g),
        "norm.weight": torch.rand(hidden, generator=g),
        "lm_head.weight": torch.randn(draft_vocab, hidden, generator=g),
        "t2d": t2d,
        "d2t": draft_ids - torch.arange(draft_vocab),
        "embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    head = load_draft_model(tmp_path, dtype=torch.float32)
    assert head.config.draft_vocab_size == draft_vocab and head.config.rope_parameters["rope_theta"] == 1e6
    assert head.config.aux_layer_ids is None  # derived from the target when paired with it
    state = head.state_dict()
    assert "embed_tokens.weight" not in state
    for key in CHECKPOINT_KEYS:
        assert torch.equal(state[key], tensors[key].to(state[key].dtype)), key
    assert torch.equal(head.draft_to_target(torch.arange(draft_vocab)), draft_ids)
    assert head.config.draft_length == 8

    # Their attention input is cat(input_layernorm(embedding), hidden_norm(fc(aux))), in that order.
    embedding = torch.randn(vocab, hidden, generator=g)
    head.set_target_embedding(embedding)
    aux, next_ids = torch.randn(1, 5, 3 * hidden, generator=g), torch.randint(0, vocab, (1, 5), generator=g)
    residual, attn_in = head.prefix_inputs(aux, next_ids)
    layer = head.midlayer
    with torch.no_grad():
        assert torch.allclose(attn_in[..., :hidden], layer.input_layernorm(embedding[next_ids]))
        assert torch.allclose(attn_in[..., hidden:], layer.hidden_norm(head.fc(aux)))
        assert torch.allclose(residual, head.fc(aux))

    # Their inference norms the final hidden state twice (forward, then compute_logits): loading
    # their file reproduces that, and saving keeps the flag.
    assert head.config.double_final_norm
    _assert_final_norms(head, residual, attn_in, expected=2)
    head.save_pretrained(tmp_path / "resaved")
    assert load_draft_model(tmp_path / "resaved").config.double_final_norm


def _assert_final_norms(head: DartDraftModel, residual: torch.Tensor, attn_in: torch.Tensor, expected: int) -> None:
    """`decode`'s logits are lm_head(norm^expected(h)), h the layer output before the final norm."""
    positions = torch.arange(residual.shape[1])[None]
    with torch.no_grad():
        logits, normed = head.decode(residual, attn_in, positions, None, return_hidden=True)
        layer = head.midlayer
        h = residual + layer.self_attn(attn_in, head.rotary_emb(attn_in, positions), None, None)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        for _ in range(expected):
            h = head.norm(h)
        assert torch.allclose(normed, h, atol=1e-5) and torch.allclose(logits, head.lm_head(h), atol=1e-4)


def test_our_heads_apply_the_final_norm_once(tmp_path: Path) -> None:
    head = tiny_head()
    head.norm.weight.data.uniform_(0.5, 2.0)  # norm(norm(h)) != norm(h) unless the weight is all ones
    head.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["double_final_norm"] is False
    loaded = load_draft_model(tmp_path)
    assert not loaded.config.double_final_norm
    loaded.set_target_embedding(torch.randn(101, 32))
    aux, ids = torch.randn(1, 5, 96), torch.randint(0, 101, (1, 5))
    residual, attn_in = loaded.prefix_inputs(aux, ids)
    _assert_final_norms(loaded, residual, attn_in, expected=1)


def test_missing_and_corrupt_checkpoints_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_draft_model(tmp_path)
    head = tiny_head()
    head.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    full = load_file(weights)
    del full["midlayer.mask_rep"]
    save_file(full, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mask_rep"):
        load_draft_model(tmp_path)
    weights.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="cannot load the DART head"):
        load_draft_model(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_draft_model(tmp_path)


def test_vocab_mapping_fills_t2d_and_d2t() -> None:
    head = tiny_head(draft_vocab_size=5)
    ids = torch.tensor([3, 7, 8, 50, 100])
    head.set_vocab_mapping(ids)
    assert torch.equal(head.draft_to_target(torch.arange(5)), ids)
    assert head.t2d.sum() == 5 and bool(head.t2d[50]) and not bool(head.t2d[4])
    with pytest.raises(ValueError, match="duplicates"):
        head.set_vocab_mapping(torch.tensor([3, 3, 8, 50, 100]))
    with pytest.raises(ValueError, match=r"\[0, 101\)"):
        head.set_vocab_mapping(torch.tensor([3, 7, 8, 50, 101]))
    with pytest.raises(ValueError, match="need 5"):
        head.set_vocab_mapping(torch.arange(4))


def test_embedding_must_match_and_be_attached() -> None:
    head = DartDraftModel(DartDraftConfig.from_target_config(tiny_llama_config(**TARGET), draft_length=3))
    aux, ids = torch.randn(1, 4, 96), torch.randint(0, 101, (1, 4))
    with pytest.raises(RuntimeError, match="set_target_embedding"):
        head.prefix_inputs(aux, ids)
    with pytest.raises(ValueError, match="expects"):
        head.set_target_embedding(torch.randn(101, 16))
    head.set_target_embedding(torch.randn(101, 32))
    with pytest.raises(ValueError, match="3 x target_hidden_size"):
        head.prefix_inputs(torch.randn(1, 4, 64), ids)


def full_forward_reference(head: DartDraftModel, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The d logits of a prefix computed in one cache-free call (prefix + masks, causal)."""
    n, masks = aux.shape[1], head.config.draft_length - 1
    res_p, in_p = head.prefix_inputs(aux, ids)
    res_m, in_m = head.mask_inputs(1, masks)
    seq = n + masks
    return head.decode(
        torch.cat([res_p, res_m], 1),
        torch.cat([in_p, in_m], 1),
        torch.arange(seq)[None],
        causal_mask(seq, seq),
        keep=torch.arange(n - 1, seq)[None],
    )[0]


def test_draft_step_with_cache_equals_a_cache_free_forward() -> None:
    head = tiny_head(draft_length=5).eval()
    torch.manual_seed(3)
    aux, ids = torch.randn(1, 11, 96), torch.randint(0, 101, (1, 11))
    cache = DraftKVCache()
    with torch.no_grad():
        first = head.draft_step(aux[:, :6], ids[:, :6], cache)
        assert first.shape == (5, 101) and cache.length == 6
        assert torch.allclose(first, full_forward_reference(head, aux[:, :6], ids[:, :6]), atol=1e-5)
        second = head.draft_step(aux[:, 6:9], ids[:, 6:9], cache)
        third = head.draft_step(aux[:, 9:], ids[:, 9:], cache)
        assert cache.length == 11
        assert torch.allclose(second, full_forward_reference(head, aux[:, :9], ids[:, :9]), atol=1e-5)
        assert torch.allclose(third, full_forward_reference(head, aux, ids), atol=1e-5)
        # Mask positions never stay in the cache: cropping back and redoing a step is exact.
        cache.crop(9)
        assert torch.allclose(head.draft_step(aux[:, 9:], ids[:, 9:], cache), third, atol=1e-6)


def test_cache_grows_past_its_initial_capacity() -> None:
    head = tiny_head(draft_length=2).eval()
    aux, ids = torch.randn(1, 300, 96), torch.randint(0, 101, (1, 300))
    cache = DraftKVCache()
    with torch.no_grad():
        head.draft_step(aux[:, :250], ids[:, :250], cache)
        last = head.draft_step(aux[:, 250:], ids[:, 250:], cache)
        assert torch.allclose(last, full_forward_reference(head, aux, ids), atol=1e-5)


def test_keep_selects_positions_and_masks_see_only_their_prefix() -> None:
    """decode() on a batch with a dense prefix-shared mask: every anchor's mask block equals a
    separate draft forward of that anchor's prefix (the training layout)."""
    head = tiny_head(draft_length=3).eval()
    torch.manual_seed(5)
    T, d = 6, 3
    aux, ids = torch.randn(1, T, 96), torch.randint(0, 101, (1, T))
    res_p, in_p = head.prefix_inputs(aux, ids)
    res_m, in_m = head.mask_inputs(1, T * (d - 1))
    seq = T + T * (d - 1)
    allowed = torch.zeros(seq, seq, dtype=torch.bool)
    allowed[:T, :T] = torch.tril(torch.ones(T, T, dtype=torch.bool))
    positions = torch.cat([torch.arange(T), torch.zeros(T * (d - 1), dtype=torch.long)])
    keep = []
    for t in range(T):
        block = T + t * (d - 1) + torch.arange(d - 1)
        allowed[block, : t + 1] = True
        allowed[block[:, None], block[None, :]] = torch.tril(torch.ones(d - 1, d - 1, dtype=torch.bool))
        positions[block] = t + 1 + torch.arange(d - 1)
        keep += [t, *block.tolist()]
    with torch.no_grad():
        logits = head.decode(
            torch.cat([res_p, res_m], 1),
            torch.cat([in_p, in_m], 1),
            positions[None],
            allowed[None, None],
            keep=torch.tensor(keep)[None],
        )[0].view(T, d, -1)
        for t in range(T):
            expected = full_forward_reference(head, aux[:, : t + 1], ids[:, : t + 1])
            assert torch.allclose(logits[t], expected, atol=1e-5), t


def test_flex_attention_block_mask_matches_dense_mask() -> None:
    from torch.nn.attention import flex_attention as flex  # torch>=2.6 (pyproject) always has it

    head = tiny_head(draft_length=4).eval()
    T = 16
    aux, ids = torch.randn(2, T, 96), torch.randint(0, 101, (2, T))
    res, attn_in = head.prefix_inputs(aux, ids)
    positions = torch.arange(T)[None].expand(2, -1)
    block = flex.create_block_mask(lambda b, h, q, kv: kv <= q, None, None, T, T, device="cpu")
    with torch.no_grad():
        dense = head.decode(res, attn_in, positions, causal_mask(T, T))
        sparse = head.decode(res, attn_in, positions, block)
    assert torch.allclose(dense, sparse, atol=1e-5)


def test_gradients_reach_trainable_parts_only() -> None:
    head = tiny_head(draft_length=3)
    aux, ids = torch.randn(1, 5, 96), torch.randint(0, 101, (1, 5))
    res_p, in_p = head.prefix_inputs(aux, ids)
    res_m, in_m = head.mask_inputs(1, 2)
    logits = head.decode(
        torch.cat([res_p, res_m], 1), torch.cat([in_p, in_m], 1), torch.arange(7)[None], causal_mask(7, 7)
    )
    logits.logsumexp(-1).sum().backward()
    for name, param in head.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert head.embed_tokens.weight.grad is None
