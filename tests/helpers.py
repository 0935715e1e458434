"""Plain helpers shared by several test modules: tiny random models, reference checks, CLI runners.

Fixtures live in conftest.py; everything here is an ordinary function or constant, imported with
`from helpers import ...` (tests/ is on sys.path under pytest). No test module imports another.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

FIXTURES = Path(__file__).parent / "fixtures"

# ------------------------------------------------------------------------------------- tiny models


def tiny_llama_config(vocab_size: int = 64, **overrides):
    """The one tiny random Llama config tests build targets from (overrides change any field)."""
    from transformers import LlamaConfig

    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaConfig(**{**fields, **overrides})


def tiny_llama(seed: int = 0, **overrides):
    """A tiny random `LlamaForCausalLM` in eval mode (`tiny_llama_config` fields as overrides)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def save_tiny_checkpoint(directory: Path, tokenizer) -> Path:
    """A tiny random Llama with `tokenizer` (and its chat template) saved in `directory` like a Hub
    model: what dart-train, the multi-rank launcher and the device check load by path."""
    model = tiny_llama(0, vocab_size=len(tokenizer), max_position_embeddings=512, tie_word_embeddings=True,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# Config fields of the tiny (base, head) pairs of the serving tests (Llama, Qwen3 and Gemma 3 alike).
COMMON = dict(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=1024,
    # Peaked random logits: no near-ties, so fp32 rounding cannot decide an argmax.
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_pair(kind: str = "llama", seed: int = 0, draft_length: int = 4, draft_vocab_size: int | None = None):
    """A tiny random base model of `kind` ("llama", "qwen3", "gemma3") and a random DART head for it."""
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from dart_infer import DartDraftConfig, DartDraftModel

    torch.manual_seed(seed)
    if kind == "llama":
        base = LlamaForCausalLM(tiny_llama_config(**COMMON, attn_implementation="sdpa"))
    elif kind == "gemma3":
        base = Gemma3ForCausalLM(tiny_gemma3_config())
    else:
        base = Qwen3ForCausalLM(Qwen3Config(**COMMON, attn_implementation="sdpa"))
    base.generation_config.eos_token_id = None  # no early stop unless a test sets one
    head = DartDraftModel(
        DartDraftConfig.from_target_config(
            base.config, draft_length=draft_length, draft_vocab_size=draft_vocab_size
        )
    )
    if draft_vocab_size is not None:
        # A non-trivial mapping: a random subset of the target vocabulary.
        subset = torch.randperm(COMMON["vocab_size"], generator=torch.Generator().manual_seed(seed))
        head.set_vocab_mapping(subset[:draft_vocab_size].sort().values)
    return base.eval(), head.eval()


def tiny_gemma3_config(sliding_window: int = 3):
    """Gemma 3's layout in small: sliding-window layers with a full-attention layer every third,
    a window narrower than the deepest draft path (4), so prompts, outputs and trees all cross it."""
    from transformers import Gemma3TextConfig

    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return Gemma3TextConfig(
        **COMMON, sliding_window=sliding_window, layer_types=layer_types, query_pre_attn_scalar=8,
        attn_implementation="sdpa",
    )


def reference(base, prompt: torch.Tensor, max_new: int) -> torch.Tensor:
    """Plain greedy decoding with transformers' `generate`: what lossless decoding must reproduce."""
    return base.generate(prompt, do_sample=False, max_new_tokens=max_new, pad_token_id=0)


def assert_greedy(base, prompt: torch.Tensor, out: torch.Tensor, max_new: int, name: object = "") -> None:
    """`out` (prompt + new tokens) is what `generate(do_sample=False, max_new_tokens=max_new)` returns.

    One forward over `out` checks every new token at once: each is the argmax after its prefix, no
    end-of-sequence token comes before the last, and it stops only at one or at `max_new`. That is
    greedy decoding's definition, and ~200x cheaper than decoding again. Only where it disagrees
    (a bug, or an fp32 near-tie the one forward rounds differently) is `generate` run, and its
    output decides, so the test is as strict as comparing with `generate` outright."""
    start = prompt.shape[1]
    new = out[0, start:]
    eos = base.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    with torch.no_grad():
        predicted = base(out).logits[0, start - 1 : -1].argmax(-1)
    stops_right = len(new) == max_new or (len(new) > 0 and int(new[-1]) in eos)
    if torch.equal(out[0, :start], prompt[0]) and torch.equal(predicted, new) and stops_right \
            and not eos & set(new[:-1].tolist()):
        return
    expected = base.generate(prompt, do_sample=False, max_new_tokens=max_new)
    assert torch.equal(out, expected), name


def bigram_machine(seed: int = 0, vocab: int = 48):
    """A tiny Llama whose greedy next token depends on the current token only (attention output
    zeroed): its text soon repeats, and every transition it makes again is in its context."""
    base, head = tiny_pair("llama", seed=seed)
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return base, head


def small_vocab_dart(vocab: int = 10):
    """A tiny DART model over `vocab` tokens, for the sampling checks' exact enumerations."""
    from dart_infer import DartDraftConfig, DartDraftModel, DartModel

    base = tiny_llama(0, vocab_size=vocab, num_hidden_layers=4, head_dim=8, max_position_embeddings=2048,
                      initializer_range=0.3, attn_implementation="sdpa")
    base.generation_config.eos_token_id = None
    head = DartDraftModel(DartDraftConfig.from_target_config(base.config, draft_length=3)).eval()
    # Every root child is a vocabulary token: acceptance happens at most steps and at depth > 1.
    return DartModel(base, head, tree={"draft_top_k": vocab, "beam_width": vocab, "remain_total": 24})


# The state-dict keys of published EAGLE-3 heads (SpecForge / EAGLE exports; vLLM's loader maps
# `midlayer.` to `layers.0.` and `d2t` to `draft_id_to_target_id`, skips `t2d`).
PUBLISHED_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}

# ------------------------------------------------------------------------------------- tree search

EOS = 2  # the EOS id of the golden search cases


def reference_beam_levels(topk_tokens, topk_probs, prompt, *, trie=None, eos=EOS, beam_width=20, ngram_weight=0.5,
                          level_weight=None, logit_weight=None, ngram_on_first_level=False):
    """dart-method.md §4's beam search written as plainly as possible (float64, Python lists): each
    level's children (path, cumulative score) in the order the search generates them."""
    levels = len(topk_tokens)
    level_weight = level_weight or [(level + 1) ** -0.7 for level in range(levels)]
    logit_weight = logit_weight or [0.9**level for level in range(levels)]
    beam: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    for level in range(levels):
        tokens = [int(t) for t in topk_tokens[level]]
        children = []
        for path, score in beam:
            use_ngram = trie is not None and ngram_weight > 0 and (level > 0 or ngram_on_first_level)
            if use_ngram:
                keep = trie.order - 1
                context = (list(prompt) + list(path))[-keep:] if keep > 0 else []
                ngram_probs, _ = trie.probability(context, tokens)
            for j, token in enumerate(tokens):
                term = logit_weight[level] * math.log(float(topk_probs[level][j]) + 1e-10)
                if use_ngram:
                    term += ngram_weight * math.log(float(ngram_probs[j]) + 1e-10)
                children.append((path + (token,), score + level_weight[level] * term))
        yield list(children)
        children.sort(key=lambda child: (child[0][-1] == eos, -child[1]))
        beam = children[:beam_width]


def golden_trie():
    """The trie of the golden search cases (tests/fixtures/golden60_docs.json: the original
    implementation's documents)."""
    from ngram_builder import NgramTrie

    spec = json.loads((FIXTURES / "golden60_docs.json").read_text())
    trie = NgramTrie(order=spec["order"])
    for doc in spec["docs"]:
        trie.add_tokens(doc)
    return trie


def node_paths(draft_tokens, tree_mask) -> list[tuple[int, ...]]:
    """Token path (root excluded) of every non-root node, read from the mask and depth order."""
    tokens = [int(t) for t in draft_tokens]
    mask = np.asarray(tree_mask, dtype=bool)
    paths = []
    for i in range(1, len(tokens)):
        ancestors = [j for j in range(1, len(tokens)) if mask[i][j]]
        paths.append(tuple(tokens[j] for j in ancestors))  # nodes are in depth order
    return paths


def check_encoding(draft_tokens, retrieve_indices, tree_mask, tree_positions, root: int) -> None:
    """Every invariant the tree verification relies on."""
    n = draft_tokens.shape[0]
    assert draft_tokens.dtype == torch.int64 and tree_positions.dtype == torch.int64
    assert retrieve_indices.dtype == torch.int64 and tree_mask.dtype == torch.bool
    assert tree_mask.shape == (n, n) and tree_positions.shape == (n,)
    assert int(draft_tokens[0]) == root and int(tree_positions[0]) == 0
    positions = tree_positions.tolist()
    assert positions == sorted(positions), "nodes must be sorted by depth"
    assert all(p >= 1 for p in positions[1:])
    mask = tree_mask.numpy()
    # Parent of node i = its ancestor at depth - 1 (exactly one), root for depth 1.
    parents = [-1]
    for i in range(1, n):
        assert mask[i][i] and mask[i][0]
        seen = [j for j in range(n) if mask[i][j]]
        assert all(j <= i for j in seen), "a node may only see earlier nodes"
        depths = sorted(positions[j] for j in seen)
        assert depths == list(range(positions[i] + 1)), "a node sees exactly one node per depth above it"
        parent = max(j for j in seen if j != i)
        assert positions[parent] == positions[i] - 1
        # Ancestors of i = parent's ancestors + i.
        assert set(seen) == {j for j in range(n) if mask[parent][j]} | {i}
        parents.append(parent)
    assert mask[0].tolist() == [True] + [False] * (n - 1)
    # No two nodes with the same token path.
    paths = node_paths(draft_tokens, tree_mask)
    assert len(set(paths)) == len(paths)
    # retrieve_indices: one row per leaf, root..leaf, -1 padding, width max_depth + 1.
    max_depth = max(positions)
    leaves = set(range(1, n)) - set(parents)
    assert retrieve_indices.shape == (len(leaves), max_depth + 1)
    row_leaves = []
    for row in retrieve_indices.tolist():
        valid = [x for x in row if x >= 0]
        assert row == valid + [-1] * (len(row) - len(valid)), "padding only at the end"
        assert valid[0] == 0
        for depth, node in enumerate(valid):
            assert positions[node] == depth
            if depth > 0:
                assert parents[node] == valid[depth - 1]
        row_leaves.append(valid[-1])
    assert sorted(row_leaves) == sorted(leaves)


# ------------------------------------------------------------------------------ sampling statistics


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells with small expectation are pooled into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    total = counts.sum()
    expected = probs * total
    if (counts[probs == 0] > 0).any():
        return 0.0  # a token the target never emits was emitted
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def exact_joint(model: Any, prompt: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """p(x1, x2, x3 | prompt) of the target after temperature/top-k/top-p, by enumeration."""
    import itertools

    from dart_infer.decoding.sampling import Sampler

    base, sampler = model.base_model, Sampler(temperature, top_p, top_k)
    vocab = base.config.vocab_size
    pairs = torch.tensor(list(itertools.product(range(vocab), repeat=2)))
    with torch.no_grad():
        p1 = sampler.probs(base(prompt).logits[0, -1])
        seqs = torch.cat([prompt.expand(pairs.shape[0], -1), pairs], dim=1)
        logits = base(seqs).logits
    p2 = sampler.probs(logits[::vocab, -2])  # [x1, x2]: rows with x2 = 0 share the x1 context
    p3 = sampler.probs(logits[:, -1]).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


def check_first_step_follows_the_target(model: Any, generate: Any, temperature: float, top_k: int, top_p: float) -> None:
    """Tokens 2 and 3 come from the first verification step (accepted draft tokens or bonus): their
    joint distribution, over all first tokens, must be the target's. `generate`: a speculative
    method of `model` with `dart_generate`'s arguments (DART's, EAGLE-3's)."""
    vocab = model.base_model.config.vocab_size
    prompt = torch.tensor([[1, 4, 7, 2]])
    expected = exact_joint(model, prompt, temperature, top_k, top_p).sum(0)
    generator = torch.Generator().manual_seed(11)
    counts = torch.zeros(vocab, vocab)
    accepted = 0
    draws = 2000
    for _ in range(draws):
        out, stats = generate(
            prompt, temperature, top_p, top_k, max_new_token_num=3, generator=generator, return_stats=True
        )
        x2, x3 = out[0, 5:].tolist()
        counts[x2, x3] += 1
        accepted += sum(stats.accept_lengths)
    assert accepted > draws // 2  # draft tokens were accepted, not only bonus tokens sampled
    p_value = chi_square_p_value(counts, expected)
    assert p_value > 1e-3
    # Negative control: the same counts reject the distribution at a slightly different temperature.
    shifted = exact_joint(model, prompt, temperature * 1.25, top_k, top_p).sum(0)
    assert chi_square_p_value(counts, shifted) < 1e-3


# ----------------------------------------------------------------------------------------- dart-eval


def run_dart_eval(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The `dart-eval` console script with `args`, as a user runs it; eager decoding unless `args` say
    `compile=...` (the default, auto, compiles on CPUs: minutes these tests do not test)."""
    script = str(Path(sys.executable).parent / "dart-eval")
    if not any(arg.startswith("compile=") for arg in args):
        args = (*args, "compile=false")
    return subprocess.run([script, *args], capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"})


# ---------------------------------------------------------------------------------------- dart-train

TRAIN_CONVERSATIONS = [
    {"messages": [
        {"role": "user", "content": f"Count from {i} to {i + 5}, please."},
        {"role": "assistant", "content": " ".join(str(k) for k in range(i, i + 6)) + ". Done counting!"},
        {"role": "user", "content": "And the square of the first number?"},
        {"role": "assistant", "content": f"The square of {i} is {i * i}."},
    ]}
    for i in range(12)
]


def train_overrides(checkpoint: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """A CI-sized dart-train run (3 steps on CPU) of `checkpoint` on the conversations in `data`."""
    return [
        "model=custom", f"model.name_or_path={checkpoint}",
        "data=jsonl", f"data.source={data}",
        "trainer=cpu", "trainer.max_steps=3", "trainer.grad_accum=1", "trainer.max_tokens=512",
        "trainer.save_every=1", "trainer.max_anchors=16",
        "preprocess.max_length=96", "draft.draft_length=4", "draft.draft_vocab_size=512",
        f"train_eval.source={data}", "train_eval.split=null", "train_eval.limit=3", "train_eval.every=2",
        "logging.wandb.enabled=false", "logging.progress=false", "logging.log_every=1",
        f"output_dir={out}", f"output_root={out.parent / 'artifacts'}", *extra,
    ]


def run_train_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`dart-train <args>` in a fresh process."""
    # A fresh single-process world: drop the rendezvous variables earlier in-process tests set.
    dist_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    code = "from dart_train.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args, f"hydra.run.dir={cwd / 'hydra'}"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )


def compose_train(*extra: str):
    """The `train` config composed with `extra` overrides, as dart-train would see it."""
    from hydra import compose, initialize_config_dir

    from dart_infer.common.configs import configs_dir

    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        return compose(config_name="train", overrides=list(extra))


# The training engine's tiny world (conftest's `tiny_target` / `tiny_dataset`): a 64-token vocabulary.
ENGINE_VOCAB = 64


def make_head(target, dataset, draft_length: int = 4):
    """A random DART head for the engine's tiny target, sharing its embedding, 48 draft tokens."""
    from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel
    from dart_train.data.vocab import build_vocab_mapping

    torch.manual_seed(2)
    cfg = DartDraftConfig.from_target_config(target.model.config, draft_length=draft_length, draft_vocab_size=48)
    head = DartDraftModel(cfg)
    head.set_target_embedding(target.embedding_weight)
    head.set_vocab_mapping(build_vocab_mapping(dataset.sequences, ENGINE_VOCAB, 48))
    return head


def make_trainer(target, dataset, run_dir: Path, **overrides):
    """A `DartTrainer` of 6 steps (a checkpoint every 2, the last 2 kept); `overrides`: TrainSettings fields."""
    from dart_train.data.batching import LengthBucketBatchSampler, ResumableLoader
    from dart_train.states.online import OnlineStateSource
    from dart_train.trainer.engine import DartTrainer, TrainSettings

    settings = dict(
        lr=3e-3, max_steps=6, grad_accum=2, warmup_steps=2, max_anchors=6, seed=3, log_every=1,
        save_every=2, keep_last=2, progress=False,
    )
    settings.update(overrides)
    loader = ResumableLoader(dataset, LengthBucketBatchSampler(dataset.lengths, batch_size=2, seed=5))
    source = OnlineStateSource(target, topk=16, hidden_dtype=torch.float32)
    return DartTrainer(make_head(target, dataset), source, loader, TrainSettings(**settings), run_dir)


def losses(run_dir: Path) -> list[float]:
    """The training losses a run logged, in order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models' ops on one thread: a second one only waits (30x slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_target(target_dir: Path):
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None  # fixed-length outputs, as vLLM's ignore_eos
    return base
