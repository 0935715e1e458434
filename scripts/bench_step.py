"""The fixed cost of one decoding step, piece by piece, and where whole generations spend their time.

Part 1, micro-benchmarks (each piece alone, the context rewound after every call so every repeat
sees the same cache; median and best of `--repeats`): the target's AR step (`next_logits`), a tree
verification of `--nodes` nodes (`verify`), the cache bookkeeping after it (`keep_path`), the draft
head's step (`draft_step`, n accepted positions + its masks) and the draft-vocabulary lm_head.
Part 2, `profile=True` generations (AR and DART interleaved over `--prompts` MT-Bench first turns):
ms per step and per phase, tokens/s; the target's forward split into attention, MLP and lm_head
(forward hooks on its modules) and everything else in it (embedding, norms, masks, dispatch).
Part 1 also splits the AR step and the verification into attention, MLP, lm_head and the rest with
torch.profiler (it sees the oneDNN linears and attention inside a compiled graph, `--compile`).
Both parts print each number beside **the floor measured in the same run**: the time one forward
needs just to read the target's weights at this machine's memory bandwidth (`--floor-gib` of bf16
summed by torch on the same threads), since a batch-1 decoding step is bound by that read.

Only public APIs are used, so the same script measures another checkout (run it from there) for
before/after numbers, back to the one that added `dart_infer.data.resolve` (`--trie` and `--dtype` are
resolved as the commands resolve `ngram_model` and `serve_dtype`).

    python scripts/bench_step.py --threads 2 --dtype bfloat16 --prompts 4     # the shipped head + default trie
    OMP_NUM_THREADS=1 python scripts/bench_step.py --threads 1 --dtype float32 --head random --trie none
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """(median wall, best wall, median CPU) seconds of `fn` over `repeats` calls after two warm-ups.

    CPU time is the calling thread's (`time.thread_time`): with one torch thread it is what the work
    cost, whatever else the machine runs; wall times on a shared machine include waiting for a core.
    """
    fn()
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpus.append(time.thread_time() - start_cpu)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), min(walls), statistics.median(cpus)


def memory_bandwidth(gib: float, repeats: int = 5) -> float:
    """Bytes/s this process reads: the best of `repeats` bf16 sums over `gib` GiB (torch's threads)."""
    data = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16)
    data.sum()
    best = min(timed_once(data.sum) for _ in range(repeats))
    return data.numel() * 2 / best


def timed_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weights one forward reads: every parameter storage once (tied embeddings are one
    matrix, read by the lm_head; the embedding lookup itself reads one row)."""
    from dart_infer.target.bf16_weights import Bf16WeightLinear

    packed = [m for m in module.modules() if isinstance(m, Bf16WeightLinear)]  # they read their bf16 copy
    read_packed = {m.weight.untyped_storage().data_ptr() for m in packed}
    seen: dict[int, int] = {}
    for param in module.parameters():
        if param.untyped_storage().data_ptr() not in read_packed:
            seen[param.untyped_storage().data_ptr()] = param.untyped_storage().nbytes()
    return sum(seen.values()) + sum(m.packed.untyped_storage().nbytes() for m in packed)


class ForwardSplit:
    """Wall time inside the target's attention, MLP and lm_head modules (forward hooks), per call."""

    KINDS = ("attention", "mlp", "lm_head")

    def __init__(self, model: torch.nn.Module, enabled: bool = True) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[int, float] = {}
        self._handles = []
        for name, module in model.named_modules() if enabled else ():
            kind = ("attention" if name.endswith("self_attn") else "mlp" if name.endswith(".mlp")
                    else "lm_head" if name.endswith("lm_head") else None)
            if kind is None:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(lambda m, a, o, kind=kind: self._post(m, kind)))

    def _pre(self, module: torch.nn.Module, args: object) -> None:
        self._started[id(module)] = time.perf_counter()

    def _post(self, module: torch.nn.Module, kind: str) -> None:
        self.seconds[kind] += time.perf_counter() - self._started.pop(id(module))

    def take(self) -> dict[str, float]:
        out = {kind: self.seconds.get(kind, 0.0) for kind in self.KINDS}
        self.seconds.clear()
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def linear_kinds(model: torch.nn.Module) -> dict[tuple[int, int], str]:
    """Weight shape -> attention / mlp / lm_head for the target's linears (for SmolLM2 and most decoders
    the shapes do not collide across kinds; a shape seen first wins)."""
    from dart_infer.target.bf16_weights import Bf16WeightLinear

    kinds: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, Bf16WeightLinear)):
            kind = "lm_head" if name.endswith("lm_head") else "mlp" if ".mlp." in name else "attention"
            kinds.setdefault(tuple(module.weight.shape), kind)
    return kinds


def profiled_split(fn: Callable[[], object], model: torch.nn.Module, repeats: int, wall: float) -> dict[str, float]:
    """Seconds per call of `fn` inside the target's attention (SDPA and the q/k/v/o linears), MLP
    linears and lm_head, from torch.profiler's per-op self times, which also sees into a compiled
    graph (its oneDNN linears and attention are ops; the fused elementwise kernels are not): `rest`
    is what is left of `wall`, the call's median without the profiler (whose own cost, ~40% more
    here, falls between ops): fused norms, RoPE, SiLU, residual adds, cache writes, Python."""
    from torch.profiler import ProfilerActivity, profile

    kinds = linear_kinds(model)
    fn()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(repeats):
            fn()
    out = dict.fromkeys(ForwardSplit.KINDS, 0.0)
    for event in prof.key_averages(group_by_input_shape=True):
        name, seconds = event.key.lower(), event.self_cpu_time_total / 1e6 / repeats
        if any(word in name for word in ("scaled_dot_product", "flash_attention", "decode_attention")) \
                or name == "aten::bmm":
            out["attention"] += seconds
        elif any(word in name for word in ("linear", "addmm", "aten::mm", "matmul")):
            kind = "unclassified linear"  # the weight is the 2-D input, either orientation
            # (with bf16 weights, the packed [N/16, K, 16] panels of an N x K weight)
            shapes = [tuple(shape) if len(shape) == 2 else (shape[0] * shape[2], shape[1])
                      for shape in event.input_shapes if len(shape) == 2 or (len(shape) == 3 and shape[2] == 16)]
            for shape in shapes:
                if shape in kinds or shape[::-1] in kinds:
                    kind = kinds.get(shape) or kinds[shape[::-1]]
                    break
            out[kind] = out.get(kind, 0.0) + seconds
    out["rest"] = wall - sum(out.values())
    out["wall"] = wall
    return out


def micro_benchmarks(model: object, context: int, args: argparse.Namespace, floor: float,
                     dtype: torch.dtype) -> dict[str, float]:
    """Part 1 at one context length (`context` random cached tokens): each piece's table row, then the
    profiler's split of the AR step and the verification. Returns each piece's median seconds."""
    from dart_infer.methods.dart.model import DraftKVCache

    target, draft = model.target, model.draft_model
    generator = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=generator)
    aux, _, cache = target.prefill(prompt)
    past = cache.get_seq_length()
    print(f"\n{past} cached tokens:")
    n = args.nodes
    tokens = torch.randint(0, vocab, (n,), generator=generator)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))  # a chain costs what any n-node tree costs
    positions = torch.arange(n)
    accepted = [0, 2, 5] if n > 5 else list(range(min(3, n)))  # root + 2 nodes of a branching tree

    def ar_step() -> None:
        target.next_logits(torch.tensor([[1]]), cache)
        target.keep_path(cache, past, [])

    def verify() -> None:
        target.verify(tokens, positions, mask, cache)
        target.keep_path(cache, past, [])

    # The cache side of a DART step without the forward: n new entries per layer (what a verify
    # appends), then keep_path keeps the accepted ones.
    kv_heads = cache.layers[0].keys.shape[1]
    new_kv = torch.randn(1, kv_heads, n, cache.layers[0].keys.shape[-1], dtype=dtype)

    def grow() -> None:
        for layer in cache.layers:
            layer.update(new_kv, new_kv)

    def grow_and_keep() -> None:
        grow()
        target.keep_path(cache, past, accepted)
        target.keep_path(cache, past, [])

    draft_cache = DraftKVCache()
    draft.draft_step(aux, torch.randint(0, vocab, prompt.shape, generator=generator), draft_cache)
    draft_past = draft_cache.length
    step_aux = aux[:, :3]
    step_ids = prompt[:, :3]

    def draft_step() -> None:
        draft.draft_step(step_aux, step_ids, draft_cache)
        draft_cache.crop(draft_past)

    rows = torch.randn(1, draft.config.draft_length, draft.config.hidden_size, dtype=dtype)

    def draft_lm_head() -> None:
        draft.lm_head(rows)

    medians: dict[Callable[[], None], float] = {}
    named: dict[str, float] = {}
    if args.repeats > 0:
        print("| piece | CPU ms (median) | wall ms (median) | wall ms (best) | × floor (median) |\n|---|---|---|---|---|")
    for name, fn, reps in (
        ("target AR step (1 token)", ar_step, args.repeats),
        (f"target verify ({n} nodes)", verify, max(20, args.repeats // 4)),
        (f"cache append ({n} entries) + keep_path (3 kept)", grow_and_keep, args.repeats),
        ("draft_step (3 new positions)", draft_step, args.repeats),
        (f"draft lm_head ({draft.config.draft_length} rows)", draft_lm_head, args.repeats),
    ) if args.repeats > 0 else ():
        median, best, cpu = timed(fn, reps)
        medians[fn] = median
        named[name] = median
        print(f"| {name} | {cpu * 1e3:.2f} | {median * 1e3:.2f} | {best * 1e3:.2f} | {median / floor:.2f} |",
              flush=True)
    if args.repeats > 0:  # where a target forward's time goes (the profiler sees into compiled graphs too)
        print("\n| target forward | wall ms | attention (SDPA + q/k/v/o) | MLP | lm_head | other linears | rest "
              "(fused elementwise, cache writes, Python) | × floor |\n|---|---|---|---|---|---|---|---|")
        for name, fn in (("AR step (1 token)", ar_step), (f"verify ({n} nodes)", verify)):
            part = profiled_split(fn, target.model, max(10, args.repeats // 10), medians[fn])
            print(f"| {name} | {part['wall'] * 1e3:.2f} | " + " | ".join(
                f"{part.get(k, 0.0) * 1e3:.2f}" for k in (*ForwardSplit.KINDS, "unclassified linear", "rest"))
                + f" | {part['wall'] / floor:.2f} |", flush=True)

    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--chat-template", default=None,
                        help="for a base model without one: gemma-turns | plain | a .jinja file (as model.chat_template)")
    parser.add_argument("--head", default="dart-smollm2-135m-instruct",
                        help="a DART head name or directory, or `random` (a random head of the demo's shape)")
    parser.add_argument("--trie", default="auto", help="a trie file; auto: dart-eval's default trie when built "
                        "and fitting the model (runs/ngram/sharegpt/full.ngt); none")
    parser.add_argument("--tree", default="default", help="default: the device's serving tree for the dtype; "
                        "nodes: the micro-benchmark's --nodes tree (top-8, beam 6)")
    parser.add_argument("--floor-gib", type=float, default=1.0, help="GiB read to measure the memory bandwidth")
    parser.add_argument("--dtype", default="bfloat16", help="a dtype name, or auto: bfloat16 where it measures faster, else float32")
    parser.add_argument("--context", type=int, nargs="+", default=[300],
                        help="cached tokens for the micro-benchmarks; several (e.g. 100 1000 3000): one table each, "
                        "then how each piece grows with the context")
    parser.add_argument("--nodes", type=int, default=13, help="tree nodes (root included) to verify")
    parser.add_argument("--repeats", type=int, default=200, help="micro-benchmark calls (0: skip them)")
    parser.add_argument("--prompts", type=int, default=2, help="generations per method (0: micro-benchmarks only)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--stock-attention", action="store_true", help="transformers' own SDPA path (its copy of "
                        "the cache per key/value group) instead of dart_infer.target.attention's packed one: the A/B")
    parser.add_argument("--bf16-weights", action="store_true", help="float32 target and head with their linears' "
                        "weights in bf16 (dart_infer.target.bf16_weights: half the bytes a step reads, for CPUs without "
                        "bf16), the target's steps attending through the decode kernel, as served")
    parser.add_argument("--compile", action="store_true", help="decode through dart_infer.target.compiled (static "
                        "cache, frozen inductor graphs); the forward's attention/MLP split is then not observable")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stock_attention:  # the target's calls then run transformers' SDPA path unchanged
        import contextlib

        import dart_infer.target.adapter
        import dart_infer.target.compiled

        for module in (dart_infer.target.adapter, dart_infer.target.compiled):
            module.packed_gqa = lambda model: contextlib.nullcontext()
    from dart_infer.common.dtypes import as_dtype, resolve_dtype_name

    args.dtype = resolve_dtype_name(args.dtype)
    dtype = as_dtype(args.dtype)

    from transformers import AutoConfig

    from dart_infer import DartDraftConfig, DartDraftModel, DartModel
    from dart_infer.data.assets import resolve_model
    from dart_infer.data.resolve import default_trie_path, model_vocabulary, resolve_trie
    tree = {"draft_top_k": 8, "beam_width": 6, "remain_total": args.nodes - 1} if args.tree == "nodes" else None
    head = args.head
    trie = resolve_trie(
        args.trie, vocabulary=lambda: model_vocabulary(args.model, args.chat_template), default=default_trie_path(), key="--trie"
    )
    if trie.notice:
        print(trie.notice)
    trie = trie.path
    if head == "random":  # a random head with the demo's shape (16k draft vocabulary, 8 rows)
        import tempfile

        torch.manual_seed(0)
        config = DartDraftConfig.from_target_config(
            AutoConfig.from_pretrained(resolve_model(args.model)), draft_length=8, draft_vocab_size=16384
        )
        head = tempfile.mkdtemp(prefix="bench_step_head_")
        DartDraftModel(config).save_pretrained(head)
    model = DartModel.from_pretrained(args.model, head, trie, dtype=dtype, tree=tree,
                                      chat_template=args.chat_template)
    if args.bf16_weights:
        model.use_bf16_weights()  # as served: target and head, and the decode-attention kernel
    if args.compile:
        from dart_infer.decoding.compile import compile_decoding

        compile_decoding(model, capacity=max(args.context) + max(args.max_new_tokens, args.nodes) + 64, plain=True)
    target = model.target
    bandwidth = memory_bandwidth(args.floor_gib)
    weights = weight_bytes(target.model)
    floor = weights / bandwidth
    print(f"{args.model} {args.dtype}{' (bf16 weights)' if args.bf16_weights else ''}{' compiled' if args.compile else ''}"
          f"{', stock attention' if args.stock_attention else ', packed GQA attention'}, {torch.get_num_threads()} thread(s), "
          f"{args.nodes}-node tree, {args.repeats} repeats; torch {torch.__version__}")
    print(f"floor: {weights / 1e6:.0f} MB of weights per forward at {bandwidth / 1e9:.1f} GB/s read = "
          f"{floor * 1e3:.2f} ms per forward (at most {1 / floor:.0f} plain tokens/s)\n")
    # Inference mode, as the decoding loop runs its steps: caches made in it cannot be updated outside it.
    with torch.inference_mode():
        by_context = {context: micro_benchmarks(model, context, args, floor, dtype) for context in args.context}
    if len(by_context) > 1 and args.repeats > 0:
        first = min(by_context)
        print(f"\nms per call (median) against the context; in brackets: × the {first}-token context's time\n")
        names = list(by_context[first])
        print("| cached tokens | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1))
        for context, medians in by_context.items():
            print(f"| {context} | " + " | ".join(
                f"{medians[name] * 1e3:.2f} ({medians[name] / by_context[first][name]:.2f}×)" for name in names) + " |")

    if args.prompts <= 0:
        return
    from dart_infer.data.conversations import chat_prompt, first_turn, load_conversations

    prompts = [chat_prompt(model.tokenizer, first_turn(c)) for c in load_conversations("mtbench", limit=args.prompts)]
    model.ar_generate(prompts[0], max_new_token_num=8)
    model.dart_generate(prompts[0], max_new_token_num=8)
    totals: dict[str, dict[str, float]] = {"ar": defaultdict(float), "dart": defaultdict(float)}
    split = ForwardSplit(target.model, enabled=not args.compile)  # hooks cannot time inside a compiled graph
    for i, ids in enumerate(prompts):
        for kind in ("ar", "dart") if i % 2 == 0 else ("dart", "ar"):
            generate = model.ar_generate if kind == "ar" else model.dart_generate
            split.take()
            _, stats = generate(ids, max_new_token_num=args.max_new_tokens, profile=True, return_stats=True)
            row = totals[kind]
            for part, seconds in split.take().items():
                row[part] += seconds
            row["steps"] += stats.steps
            row["tokens"] += stats.new_tokens
            row["wall"] += stats.wall_time
            row["emitted"] += sum(stats.emitted)
            for phase, seconds in stats.timings.items():
                row[phase] += seconds
    split.remove()
    phases = ("prefill", "draft", "search", "verify", "bookkeeping")
    print(f"\n{args.prompts} MT-Bench first turns x {args.max_new_tokens} new tokens, AR and DART interleaved; "
          f"ms per step (the AR loop's target forward is its 'verify'); floor {floor * 1e3:.2f} ms\n")
    print("| method | tokens/s | τ | ms/step | × floor | " + " | ".join(f"{p}" for p in phases)
          + " | target: attention | MLP | lm_head | rest of the forward |")
    print("|" + "---|" * (5 + len(phases) + 4))
    for kind, row in totals.items():
        steps = max(1.0, row["steps"])
        ms = {key: value / steps * 1e3 for key, value in row.items()}
        forward = ms.get("verify", 0.0) + ms.get("prefill", 0.0)  # what the hooks saw: every target forward
        rest = forward - sum(ms.get(k, 0.0) for k in ForwardSplit.KINDS)
        split = [f"{ms.get(k, 0.0):.2f}" for k in ForwardSplit.KINDS] + [f"{rest:.2f}"]
        if args.compile:  # hooks see nothing inside a compiled graph: the profiler split above has it
            split = ["– (above)"] * len(split)
        cells = [f"{ms.get(p, 0.0):.2f}" for p in phases] + split
        print(f"| {kind} | {row['tokens'] / row['wall']:.1f} | {row['emitted'] / steps:.2f} | {ms['wall']:.1f} | "
              f"{ms['wall'] / (floor * 1e3):.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
