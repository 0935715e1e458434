"""dart_train.states.online and state_cache_*: online vs offline target states, resumable + verified offline cache."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_llama

from dart_infer.target.adapter import TargetModel
from dart_train.data.batching import LengthBucketBatchSampler, ResumableLoader, collate
from dart_train.data.dataset import TokenizedDataset
from dart_train.states.cache import StateCacheError, cache_bytes_per_token
from dart_train.states.cache_reader import OfflineStateSource
from dart_train.states.cache_writer import precompute_states
from dart_train.states.online import OnlineStateSource

VOCAB, HIDDEN, TOPK = 97, 32, 8


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel(tiny_llama(0, vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=256))


@pytest.fixture(scope="module")
def dataset() -> TokenizedDataset:
    gen = torch.Generator().manual_seed(1)
    sequences = []
    for _ in range(11):
        n = int(torch.randint(3, 40, (), generator=gen))
        ids = torch.randint(0, VOCAB, (n,), generator=gen)
        sequences.append({"input_ids": ids, "loss_mask": torch.rand(n, generator=gen) < 0.6})
    return TokenizedDataset(sequences)


def batches(dataset, batch_size=4):
    return list(ResumableLoader(dataset, LengthBucketBatchSampler(dataset.lengths, batch_size=batch_size, seed=5)))


def test_online_states(target, dataset):
    source = OnlineStateSource(target, topk=TOPK)
    batch = collate([dataset[i] for i in (0, 1, 2)])
    out = source(batch)
    rows, width = batch["input_ids"].shape
    assert out["aux_hidden"].shape == (rows, width, 3 * HIDDEN) and out["aux_hidden"].dtype == torch.bfloat16
    assert out["target_topk_logprobs"].shape == (rows, width, TOPK)
    assert out["target_topk_ids"].dtype == torch.long
    pad = ~batch["attention_mask"]
    assert pad.any() and not out["aux_hidden"][pad].any() and not out["target_topk_logprobs"][pad].any()
    # Exact top-k of the full log-softmax, at real positions, and the same as running one sequence alone.
    full = OnlineStateSource(target, topk=None, hidden_dtype=torch.float32)(batch)
    assert full["target_topk_ids"] is None
    real = batch["attention_mask"]
    assert torch.allclose(full["target_topk_logprobs"][real].logsumexp(-1), torch.zeros(int(real.sum())), atol=1e-5)
    values, ids = full["target_topk_logprobs"].topk(TOPK, dim=-1)
    assert torch.equal(ids[real], out["target_topk_ids"][real])
    assert torch.equal(values[real], out["target_topk_logprobs"][real])
    for row in range(rows):
        n = int(batch["lengths"][row])
        alone = source(collate([dataset[int(batch["indices"][row])]]))
        torch.testing.assert_close(alone["aux_hidden"][0].float(), out["aux_hidden"][row, :n].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(alone["target_topk_logprobs"][0], out["target_topk_logprobs"][row, :n], rtol=1e-4, atol=1e-4)
    assert not any(p.requires_grad for p in target.model.parameters())  # frozen


def test_offline_equals_online(target, dataset, tmp_path):
    # max_tokens=1: every forward holds one unpadded sequence, exactly like the online call below.
    manifest = precompute_states(target, dataset, tmp_path / "cache", topk=TOPK, shard_size=4, max_tokens=1)
    assert manifest["complete"] and len(manifest["shards"]) == 3
    offline = OfflineStateSource(tmp_path / "cache", dataset)
    online = OnlineStateSource(target, topk=TOPK)
    for index in range(len(dataset)):
        single = collate([dataset[index]])
        a, b = offline(single), online(single)
        for key in ("aux_hidden", "target_topk_logprobs", "target_topk_ids"):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key  # bit for bit
    # Padded, bucketed batches through the loader: same structure, equal up to batching numerics.
    for batch in batches(dataset):
        a, b = offline(batch), online(batch)
        assert set(a) == set(b)
        torch.testing.assert_close(a["aux_hidden"].float(), b["aux_hidden"].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(a["target_topk_logprobs"], b["target_topk_logprobs"], rtol=1e-4, atol=1e-4)
        assert (a["target_topk_ids"][..., 0] == b["target_topk_ids"][..., 0]).float().mean() > 0.95
    # Compact storage: bf16 hidden + k (fp32 logprob + int32 id) + int32 id + bool mask per token.
    per_token = 2 * 3 * HIDDEN + 8 * TOPK + 5
    assert per_token <= cache_bytes_per_token(manifest) < per_token + 300


def test_kill_and_resume(target, dataset, tmp_path):
    reference = precompute_states(target, dataset, tmp_path / "ref", topk=TOPK, shard_size=3, max_tokens=64)
    cache = tmp_path / "cache"
    partial = precompute_states(target, dataset, cache, topk=TOPK, shard_size=3, max_tokens=64, max_shards=2)
    assert not partial["complete"] and sorted(partial["shards"]) == ["0", "1"]
    with pytest.raises(StateCacheError, match="incomplete"):
        OfflineStateSource(cache, dataset)
    # A run killed after writing shard 2 but before recording it, and one killed mid-write.
    (cache / "shard-00002.safetensors").write_bytes(b"half-written garbage")
    (cache / ".shard-00003.safetensors.tmp-999").write_bytes(b"partial")
    before = {k: (cache / v["file"]).stat().st_mtime_ns for k, v in partial["shards"].items()}
    resumed = precompute_states(target, dataset, cache, topk=TOPK, shard_size=3, max_tokens=64)
    assert resumed["complete"]
    assert {k: (cache / v["file"]).stat().st_mtime_ns for k, v in resumed["shards"].items() if k in before} == before
    # The resumed cache is byte-identical to an uninterrupted one.
    assert {k: v["sha256"] for k, v in resumed["shards"].items()} == {k: v["sha256"] for k, v in reference["shards"].items()}
    source = OfflineStateSource(cache, dataset)
    for batch in batches(dataset):
        assert source(batch)["aux_hidden"].shape[-1] == 3 * HIDDEN


def test_corrupt_shard_and_mismatches(target, dataset, tmp_path, caplog):
    cache = tmp_path / "cache"
    precompute_states(target, dataset, cache, topk=TOPK, shard_size=4, max_tokens=64)
    shard = cache / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside the tensor data
    shard.write_bytes(bytes(data))
    source = OfflineStateSource(cache, dataset)
    source(collate([dataset[0]]))  # shard 0 is fine
    with pytest.raises(StateCacheError, match="corrupt"):
        source(collate([dataset[5]]))
    # Resuming recomputes the damaged shard; then it reads fine.
    with caplog.at_level("WARNING", logger="dart_train"):
        precompute_states(target, dataset, cache, topk=TOPK, shard_size=4, max_tokens=64)
    assert "shard-00001.safetensors is missing or corrupt" in caplog.text
    OfflineStateSource(cache, dataset)(collate([dataset[5]]))
    # Other settings or other data → clear errors, never silent reuse.
    with pytest.raises(StateCacheError, match="other settings"):
        precompute_states(target, dataset, cache, topk=TOPK + 1, shard_size=4)
    other = TokenizedDataset([{**dataset.sequences[0], "input_ids": dataset.sequences[0]["input_ids"].flip(0)}])
    with pytest.raises(StateCacheError, match="other training data"):
        OfflineStateSource(cache, other)
    with pytest.raises(StateCacheError, match="do(es)? not match"):
        OfflineStateSource(cache)(collate([other[0]]))
    (cache / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(StateCacheError, match="unknown cache format"):
        OfflineStateSource(cache)
    with pytest.raises(StateCacheError, match="no state cache"):
        OfflineStateSource(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="topk"):
        precompute_states(target, dataset, tmp_path / "x", topk=None)



@pytest.mark.smollm2
def test_offline_equals_online_on_smollm2(smollm2_dir, smollm2_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from dart_infer.data.conversations import Conversation
    from dart_train.data.dataset import build_dataset

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa")
    real = TargetModel(model.eval())
    conversations = [
        Conversation(id="q1", source="test", messages=[
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."}]),
        Conversation(id="q2", source="test", messages=[
            {"role": "user", "content": "Name three primary colors."},
            {"role": "assistant", "content": "Red, yellow and blue are the three primary colors."}]),
    ]
    data = build_dataset(conversations, smollm2_tokenizer, 96)
    manifest = precompute_states(real, data, tmp_path / "cache", topk=64, shard_size=1, max_tokens=1)
    assert cache_bytes_per_token(manifest) < 2 * 3 * 576 + 8 * 64 + 5 + 300  # ~3973 B/token + header
    offline, online = OfflineStateSource(tmp_path / "cache", data), OnlineStateSource(real, topk=64)
    for index in range(len(data)):
        batch = collate([data[index]])
        a, b = offline(batch), online(batch)
        for key in ("aux_hidden", "target_topk_logprobs", "target_topk_ids"):
            assert torch.equal(a[key], b[key]), key
        # A trained chat model puts most next-token mass on answer positions into its top 64.
        assert a["target_topk_logprobs"].float().exp().sum(-1)[batch["loss_mask"]].mean() > 0.8


def test_ranks_share_one_cache(target, dataset, tmp_path, monkeypatch):
    reference = precompute_states(target, dataset, tmp_path / "ref", topk=TOPK, shard_size=2, max_tokens=64)
    cache = tmp_path / "cache"
    half = precompute_states(target, dataset, cache, topk=TOPK, shard_size=2, max_tokens=64, rank=1, world_size=2)
    assert sorted(half["shards"], key=int) == ["1", "3", "5"] and not half["complete"]
    full = precompute_states(target, dataset, cache, topk=TOPK, shard_size=2, max_tokens=64, rank=0, world_size=2)
    assert full["complete"]
    assert {k: v["sha256"] for k, v in full["shards"].items()} == {k: v["sha256"] for k, v in reference["shards"].items()}
    # Not enough disk for what is left → a clear error before any work.
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(StateCacheError, match="GB more"):
        precompute_states(target, dataset, tmp_path / "small-disk", topk=TOPK, shard_size=2)


def test_packed_rows_equal_sequences_alone(target, dataset, tmp_path):
    """A packed row gives each sequence exactly the target states, draft logits and losses it gets alone."""
    from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel
    from dart_train.data.batching import PackedBatchSampler, collate_packed
    from dart_train.objectives import annealed_kl_loss, build_layout, draft_forward

    sampler = PackedBatchSampler(dataset.lengths, row_tokens=64, max_tokens=128, seed=2)
    packed_batches = sampler.batches(0)
    assert sorted(i for batch in packed_batches for row in batch for i in row) == list(range(len(dataset)))
    assert all(sum(dataset.lengths[i] for i in row) <= 64 for batch in packed_batches for row in batch)
    assert any(len(row) > 1 for batch in packed_batches for row in batch)
    source = OnlineStateSource(target, topk=TOPK, hidden_dtype=torch.float32)
    torch.manual_seed(4)
    head_config = DartDraftConfig.from_target_config(target.model.config, draft_length=3, draft_vocab_size=VOCAB)
    head = DartDraftModel(head_config).eval()
    head.set_target_embedding(target.embedding_weight)
    head.set_vocab_mapping(torch.arange(VOCAB))

    def draft_loss(states):
        layout = build_layout(states["loss_mask"], 3, position_ids=states["position_ids"],
                              document_ids=states["document_ids"])
        logits = draft_forward(head, states["aux_hidden"], states["input_ids"], layout)
        out = annealed_kl_loss(logits, layout, head.d2t, target_logprobs=states["target_topk_logprobs"],
                               target_ids=states["target_topk_ids"])
        return out, logits, layout

    precompute_states(target, dataset, tmp_path / "cache", topk=TOPK, shard_size=4)
    offline = OfflineStateSource(tmp_path / "cache", dataset)
    checked = 0
    for batch_rows in packed_batches:
        batch = collate_packed([[dataset[i] for i in row] for row in batch_rows])
        states = source(batch)
        packed_out, packed_logits, packed_layout = draft_loss(states)
        kl_sum = torch.zeros(3)
        for row, start, index in batch["segments"].tolist():
            alone = source(collate([dataset[index]]))
            n = dataset.lengths[index]
            for key in ("aux_hidden", "target_topk_logprobs"):
                torch.testing.assert_close(states[key][row, start:start + n], alone[key][0], rtol=1e-5, atol=1e-5)
            assert torch.equal(states["target_topk_ids"][row, start:start + n], alone["target_topk_ids"][0])
            alone_out, alone_logits, alone_layout = draft_loss(alone)
            kl_sum += alone_out.kl_sum
            # Every anchor of the sequence alone is an anchor of the packed row, with the same logits.
            for a, anchor in enumerate(alone_layout.anchors[0][alone_layout.anchor_valid[0]].tolist()):
                match = (packed_layout.anchors[row] == start + anchor) & packed_layout.anchor_valid[row]
                assert int(match.sum()) == 1
                torch.testing.assert_close(packed_logits[row, int(match.nonzero())], alone_logits[0, a],
                                           rtol=1e-4, atol=1e-4)
                checked += 1
        torch.testing.assert_close(packed_out.kl_sum, kl_sum, rtol=1e-4, atol=1e-4)
        # The offline cache fills packed rows from the same per-sequence records.
        cached = offline(batch)
        torch.testing.assert_close(cached["target_topk_logprobs"], source(batch)["target_topk_logprobs"],
                                   rtol=1e-4, atol=1e-4)
    assert checked > 50


def test_labels_only_gives_the_same_loss_and_alphas(target, dataset):
    from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel
    from dart_train.objectives import annealed_kl_loss, build_layout, draft_forward
    from dart_train.states.source import label_positions

    batch = collate([dataset[i] for i in range(6)])
    full = OnlineStateSource(target, topk=TOPK, hidden_dtype=torch.float32)(batch)
    some = OnlineStateSource(target, topk=TOPK, hidden_dtype=torch.float32, labels_only=True)(batch)
    where = label_positions(batch["loss_mask"])
    assert 0 < int(where.sum()) < int(batch["attention_mask"].sum())
    for key in ("target_topk_logprobs", "target_topk_ids"):
        assert torch.equal(some[key][where], full[key][where]) and not some[key][~where].any()
    torch.manual_seed(4)
    head = DartDraftModel(DartDraftConfig.from_target_config(target.model.config, draft_length=3,
                                                             draft_vocab_size=VOCAB)).eval()
    head.set_target_embedding(target.embedding_weight)
    head.set_vocab_mapping(torch.arange(VOCAB))
    layout = build_layout(batch["loss_mask"], 3)
    logits = draft_forward(head, full["aux_hidden"], batch["input_ids"], layout)
    a, b = (annealed_kl_loss(logits, layout, head.d2t, target_logprobs=s["target_topk_logprobs"],
                             target_ids=s["target_topk_ids"]) for s in (full, some))
    assert torch.equal(a.loss, b.loss) and torch.equal(a.correct, b.correct) and torch.equal(a.rows, b.rows)


def test_compiled_target_gives_the_states_of_the_eager_one(target, dataset):
    """`states.compile=true`: the same states from torch.compile'd weights, one compile per batch shape."""
    from dart_train.data.batching import PackedBatchSampler

    sampler = PackedBatchSampler(dataset.lengths, row_tokens=64, max_tokens=128, seed=2)
    loader = ResumableLoader(dataset, sampler)
    eager = OnlineStateSource(target, topk=TOPK, hidden_dtype=torch.float32, labels_only=True)
    compiled = OnlineStateSource(target, topk=TOPK, hidden_dtype=torch.float32, labels_only=True, compile=True)
    assert compiled.target.model is not target.model and eager.target is target
    for batch in loader:
        assert batch["input_ids"].shape[1] == 64  # full-width rows: static shapes
        a, b = eager(batch), compiled(batch)
        torch.testing.assert_close(b["aux_hidden"], a["aux_hidden"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b["target_topk_logprobs"], a["target_topk_logprobs"], rtol=1e-4, atol=1e-4)


def test_cache_dir_is_keyed_by_everything_that_shapes_it(target, dataset, tmp_path):
    from dart_train.states.cache_writer import cache_header, keyed_cache_dir

    root = tmp_path / "root"
    first = keyed_cache_dir(root, cache_header(target, dataset, topk=TOPK, shard_size=2))
    precompute_states(target, dataset, first, topk=TOPK, shard_size=2, max_tokens=64)
    assert first.parent == root
    assert keyed_cache_dir(root, cache_header(target, dataset, topk=TOPK, shard_size=2)) == first
    # Other data, other k: another cache next to the first one, which stays as it is.
    fewer = TokenizedDataset(dataset.sequences[:-1])
    others = {keyed_cache_dir(root, cache_header(target, fewer, topk=TOPK, shard_size=2)),
              keyed_cache_dir(root, cache_header(target, dataset, topk=TOPK + 1, shard_size=2))}
    assert len(others) == 2 and first not in others
    second = others.pop()
    assert OfflineStateSource(first, dataset).manifest["complete"] and not second.exists()
    # A cache written straight into a root (the former layout) is still found when it matches.
    precompute_states(target, dataset, tmp_path / "legacy", topk=TOPK, shard_size=2, max_tokens=64)
    assert keyed_cache_dir(tmp_path / "legacy", cache_header(target, dataset, topk=TOPK, shard_size=2)) == (
        tmp_path / "legacy")
    assert keyed_cache_dir(tmp_path / "legacy", cache_header(target, fewer, topk=TOPK, shard_size=2)).parent == (
        tmp_path / "legacy")
