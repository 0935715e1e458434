"""`DartModel`: a base (target) model + an optional draft head (DART's, EAGLE-3's: any method of
`dart_infer.methods`) + an optional n-gram trie, with lossless speculative decoding and the
autoregressive baseline on the same code path.

This module is the public API (`DartModel.from_pretrained`, `dart_generate`, `dart_generate_stream`,
`ar_generate`, `ar_generate_stream`); the work is done by
- `dart_infer.decoding.loop`: the one decoding loop (one step is described there);
- `dart_infer.methods`: the draft methods — each head's tree settings and drafter;
- `dart_infer.tree.settings`: DART's tree settings and the draft logits → token tree path shared with training;
- `dart_infer.decoding.sampling`: the target distribution (temperature / top-k / top-p) and acceptance rules;
- `dart_infer.data.loaders`: head / trie loaders, compatibility checks, the EOS set;
- `dart_infer.decoding.stats`: step outputs, generation statistics, the phase timer.

Everything here handles batch size 1.

Serving dtypes: float32 is the exactness mode (greedy output identical to the base model's
`generate`); bfloat16 is the fast mode where it measures faster (`bf16_is_faster`: CUDA, CPUs with
AVX512-BF16/AMX), and like every bf16 decoder its outputs depend on how many tokens a forward
processes. `DartModel.from_pretrained(..., dtype="bfloat16")` loads either; `with_dtype` copies a
loaded model into another dtype (the baselines of `dart-eval` in every dtype).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dart_infer.common.dtypes import as_dtype, cast_parameters, dtype_name, resolve_dtype
from dart_infer.data.loaders import check_trie_matches_tokenizer, eos_token_ids, load_tokenizer, load_trie
from dart_infer.decoding.loop import decode_steps
from dart_infer.decoding.request import as_prompt, checked_request
from dart_infer.decoding.sampling import Sampler
from dart_infer.decoding.stats import GenerationStats, StepOutput
from dart_infer.methods import Drafter, DraftMethod, load_head, method_of
from dart_infer.methods.loading import check_head_matches_target
from dart_infer.target.adapter import TargetModel
from dart_infer.target.attention import use_decode_attention
from dart_infer.target.bf16_weights import resolve_bf16_weights, use_bf16_weights, uses_bf16_weights
from dart_infer.target.fused_blocks import use_fused_blocks
from dart_infer.target.step_cost import use_fast_matmul_layout

log = logging.getLogger(__name__)


class DartModel(nn.Module):
    """A base (target) model + an optional draft head + an optional n-gram trie.

    Mirrors the authors' API (`from_pretrained`, `.tokenizer`, `.dart_generate`). The head may be of
    any registered draft method (`dart_infer.methods`: DART, EAGLE-3); `dart_generate` drafts with that
    method, `ar_generate` decodes plainly, and a model without a head decodes plainly only. Batch
    size 1: `input_ids` is one prompt, [1,T] or [T]. Outputs are prompt + new tokens, like `generate()`.
    """

    def __init__(
        self,
        base_model: Any,
        draft_model: Any = None,
        tokenizer: Any = None,
        trie: Any = None,
        *,
        tree: Any = None,
        profile: bool = False,
    ) -> None:
        super().__init__()
        # The head's method (None: no head, plain decoding only); an unknown head type fails here.
        self.method: DraftMethod | None = method_of(draft_model) if draft_model is not None else None
        if trie is not None and (self.method is None or not self.method.uses_trie):
            what = f"{self.method.display_name} decoding" if self.method else "a model without a draft head"
            raise ValueError(f"{what} uses no n-gram trie")
        self.base_model = base_model
        self.draft_model = draft_model
        self.tokenizer = tokenizer
        self.trie = trie
        self.profile = profile
        self.target = TargetModel(base_model, draft_model.config.aux_layer_ids if draft_model is not None else None)
        self.tree = tree
        if draft_model is not None:
            check_head_matches_target(draft_model, self.target, self.method.display_name)
        if trie is not None:
            check_trie_matches_tokenizer(trie, tokenizer, self.target.vocab_size)
        self.eos_token_ids = eos_token_ids(base_model, tokenizer)
        self.last_stats: GenerationStats | None = None
        self._attach_embedding()

    @property
    def tree(self) -> Any:
        """The head's tree settings (its method's settings class): the ones given, or the method's
        default for the device and dtype the model is on now (e.g. `dart_infer.tree.settings.default_tree`),
        with a mapping given as `tree` overriding fields of that default. None without a head.

        `tree="auto"` (or `remain_total="auto"` in a mapping) fits DART's tree size to this machine on
        a CPU: measured the first time it is needed (seconds), cached per machine, model, head, trie
        and dtype (`dart_infer.decoding.fitted_tree`). On a GPU, or for other methods, it is the default."""
        if self.method is None:
            return None
        settings = self.method.resolve_tree(self._tree_spec, self.target.device, self.target.dtype)
        if self._fit_tree_size and self.target.device.type == "cpu" and self.method.name == "dart" \
                and settings.shape == "tree":
            fit = self.fitted_tree()
            if fit is not None:
                settings = settings.with_overrides({"remain_total": fit.remain_total})
        return settings

    @tree.setter
    def tree(self, value: Any) -> None:
        # "auto" asks for the size fitted here; the rest is checked now (unknown names, bad values), and
        # without a head there is nothing to check against.
        self._fit_tree_size = value == "auto" or (isinstance(value, dict) and value.get("remain_total") == "auto")
        if value == "auto":
            value = None
        elif self._fit_tree_size:
            value = {k: v for k, v in value.items() if k != "remain_total"}
        self._tree_spec = self.method.check_tree(value) if self.method is not None else value
        self._tree_fits: dict[Any, Any] = {}

    def fitted_tree(self) -> Any:
        """The `TreeFit` of this model's tree size on this machine (`tree="auto"`; measured once,
        then cached): the chosen `remain_total` and each candidate size's τ, step time and predicted
        speedup over plain decoding. None where the fit's prompts (the ShareGPT asset) are missing."""
        from dart_infer.decoding.fitted_tree import model_tree_fit

        if self.method is None or self.method.name != "dart":
            raise ValueError("only a DART head's tree size is fitted (tree='auto')")
        return model_tree_fit(self, self.method.resolve_tree(self._tree_spec, self.target.device, self.target.dtype))

    @property
    def draft_depth(self) -> int:
        """The deepest draft level a step can accept (0 without a head)."""
        return self.method.max_depth(self.draft_model, self.tree) if self.method is not None else 0

    def _attach_embedding(self) -> None:
        # Weights first take the layout their matmuls run fastest in on this device (see
        # `use_fast_matmul_layout`; `generate()` on the base model gets it too), then the head shares
        # the target's embedding tensor.
        use_fast_matmul_layout(self.base_model)
        if self.draft_model is not None:
            use_fast_matmul_layout(self.draft_model)
            self.draft_model.set_target_embedding(self.target.model.get_input_embeddings().weight)
        self.target.embedding_weight = self.target.model.get_input_embeddings().weight

    @classmethod
    def from_pretrained(
        cls,
        base_model_name_or_path: str,
        dart_model_name_or_path: str | None,
        ngram_model_name_or_path: str | None = None,
        is_small_ngram: bool = False,
        *,
        dtype: torch.dtype | str | None = None,
        ngram_mmap: bool = True,
        ngram_verify: bool = False,
        tree: Any = None,
        profile: bool = False,
        chat_template: str | None = None,
        bf16_weights: bool | str = False,
        **kwargs: Any,
    ) -> DartModel:
        """Load base model, tokenizer, head and trie. The head is any draft method's (its config.json
        says which: `dart_infer.methods.load_head`); None loads no head (plain decoding only). `dtype`
        (a torch dtype, a name: "float32", "bfloat16", ..., or "auto": bfloat16 where it measures
        faster on this machine, else float32, as dart-eval's `model.dtype=auto`) is the serving dtype
        of target and head (default: the loader's); other kwargs such as `device_map` go to the base model's loader.
        `tree`: the method's settings or field overrides of its default for the device the model
        lands on (None: that default; for DART e.g. the CPU trees on a CPU, the paper's 60-node tree on
        a GPU). Names go through `dart_infer.data.assets.resolve_model`, so the embedded
        "smollm2-135m-instruct" works offline. `ngram_mmap=False` reads the trie into memory with its
        query index (faster trie queries, slower load; see `NgramTrie.load`); `ngram_verify=True` also
        checks its payload checksum (a structural check always runs). `chat_template`: the tokenizer's
        chat template, for base models without one (a built-in name such as "gemma-turns", a .jinja
        path or a Jinja string; None: the tokenizer's own; see `dart_infer.data.loaders.load_tokenizer`),
        as the head was trained with. `bf16_weights`: float32 over weights read as bf16 (CPUs without bf16;
        "auto": where dtype="auto" chose float32 on one; `dart_infer.target.bf16_weights`)."""
        from transformers import AutoModelForCausalLM

        from dart_infer.data.assets import resolve_model

        base_path = resolve_model(base_model_name_or_path)
        tokenizer = load_tokenizer(base_path, chat_template)  # first: a bad template fails before the model loads
        if dtype is not None:
            if "torch_dtype" in kwargs:
                raise TypeError("give the dtype once: dtype= or torch_dtype=, not both")
            kwargs["dtype"] = resolve_dtype(dtype)  # "auto": bfloat16 where it measures faster here
        kwargs.setdefault("attn_implementation", "sdpa")
        base_model = AutoModelForCausalLM.from_pretrained(base_path, **kwargs)
        draft = None
        if dart_model_name_or_path is not None:
            draft, _ = load_head(dart_model_name_or_path)
            trained_for = getattr(draft.config, "base_model", None)
            if trained_for and base_path != resolve_model(trained_for, convert=False):
                # Shapes may still fit (e.g. a fine-tune of the same base): allowed, but τ will likely suffer.
                log.warning("the head '%s' was trained for the base model '%s', not '%s'",
                            dart_model_name_or_path, trained_for, base_model_name_or_path)
            weight = base_model.get_input_embeddings().weight
            draft = cast_parameters(draft.to(device=weight.device), weight.dtype)
        trie = None
        if ngram_model_name_or_path is not None:
            trie = load_trie(resolve_model(ngram_model_name_or_path), is_small_ngram, mmap=ngram_mmap,
                             verify=ngram_verify)
        model = cls(base_model, draft, tokenizer, trie, tree=tree, profile=profile)
        if resolve_bf16_weights(bf16_weights, dtype, model.target.dtype, model.target.device):
            model.use_bf16_weights()
        return model.eval()

    def use_bf16_weights(self) -> DartModel:
        """Serve target and head as fitted for CPUs without bf16 arithmetic, in place: their linears read
        bf16 weights with float32 arithmetic (`dart_infer.target.bf16_weights`), norms and gated MLPs run
        fused (`dart_infer.target.fused_blocks`), the target's steps attend through the decode kernel
        (`dart_infer.target.attention.use_decode_attention`); returns `self`."""
        for module in (self.base_model, self.draft_model):
            if module is not None:
                use_bf16_weights(use_fused_blocks(module))
        use_decode_attention(self.base_model)
        return self

    def with_head(self, draft_model: Any, *, tree: Any = None) -> DartModel:
        """The same target (shared, not copied), tokenizer and profiling with another head (of any
        method; None: none) and no trie, e.g. to time EAGLE-3 next to DART on one loaded target."""
        if draft_model is not None:
            weight = self.base_model.get_input_embeddings().weight
            draft_model = cast_parameters(draft_model.to(device=weight.device), weight.dtype).eval()
        return type(self)(self.base_model, draft_model, self.tokenizer, tree=tree, profile=self.profile).eval()

    def with_dtype(self, dtype: torch.dtype | str) -> DartModel:
        """This model in `dtype`: copies of target and head cast to it (this model is untouched), the
        tokenizer, trie and tree settings shared; `self` when it already is in `dtype`.

        Cast from float32 the copy holds what loading the checkpoint in `dtype` gives (the same
        rounding); cast up from a lower precision it holds that precision's rounded weights, so make
        copies from the widest dtype you need (dart-eval loads float32 when it times several).
        """
        dtype = as_dtype(dtype)
        if dtype == self.target.dtype:
            return self
        if uses_bf16_weights(self.base_model):
            raise ValueError("a model with bf16 weights (float32 arithmetic) cannot be cast: load it in "
                             f"{dtype_name(dtype)} instead")
        base = cast_parameters(copy.deepcopy(self.base_model), dtype)
        base.config.dtype = dtype
        draft = None
        if self.draft_model is not None:
            # The head's attached embedding is the target's tensor: leave it out of the copy.
            memo = {id(self.draft_model.__dict__.get("_target_embedding")): None}
            draft = cast_parameters(copy.deepcopy(self.draft_model, memo), dtype)
        spec = self._tree_spec
        if self._fit_tree_size:  # the copy fits its own dtype's size
            spec = "auto" if spec is None else {**spec, "remain_total": "auto"}
        copied = type(self)(base, draft, self.tokenizer, self.trie, tree=spec, profile=self.profile)
        return copied.train(self.training)

    # ------------------------------------------------------------------------------ plumbing
    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> DartModel:
        # .to()/.cuda()/.half() replace the target's embedding tensor: re-share it with the head
        # (and re-pick the weights' layout for the new device/dtype).
        super()._apply(fn, *args, **kwargs)
        self._attach_embedding()
        return self

    def _start(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float,
        top_p: float,
        top_k: int,
        max_new_token_num: int,
        max_length: int,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, int, Sampler]:
        """Checked prompt, new-token budget and sampler of one generation (either method)."""
        prompt, budget = checked_request(input_ids, max_new_token_num, max_length, self.target.vocab_size)
        return prompt, budget, Sampler(temperature, top_p, top_k, generator)

    def _stream(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float,
        top_p: float,
        top_k: int,
        max_new_token_num: int,
        max_length: int,
        generator: torch.Generator | None,
        profile: bool | None,
        drafting: bool,
        tree: Any = None,
    ) -> Iterator[StepOutput]:
        """The one generation path: arguments checked, then the loop with the head's drafter
        (`drafting`) or none (plain decoding)."""
        prompt, budget, sampler = self._start(
            input_ids, temperature, top_p, top_k, max_new_token_num, max_length, generator
        )
        drafter = self._drafter(tree) if drafting else None
        return decode_steps(self, prompt, budget, sampler, drafter, self.profile if profile is None else profile)

    def _drafter(self, tree: Any) -> Drafter:
        if self.method is None:
            raise ValueError("this model has no draft head: decode with ar_generate, or load one "
                             "(DartModel.from_pretrained(base, head))")
        spec = self.method.check_tree(tree)
        settings = spec if isinstance(spec, self.method.tree_settings_class) else self.tree.with_overrides(spec)
        return self.method.drafter(self, settings)

    # ------------------------------------------------------------------------- speculative decoding
    def dart_generate_stream(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        tree: Any = None,
        profile: bool | None = None,
    ) -> Iterator[StepOutput]:
        """Yield each step's emitted tokens and acceptance length. Arguments as `dart_generate`;
        they are checked before the first token is computed. Stats land in `self.last_stats`."""
        return self._stream(input_ids, temperature, top_p, top_k, max_new_token_num, max_length, generator,
                            profile, True, tree)

    def dart_generate(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        tree: Any = None,
        profile: bool | None = None,
        return_stats: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, GenerationStats]:
        """Speculative decoding of ONE prompt with the head's method (DART, EAGLE-3, ...) →
        LongTensor [1, prompt + new] (batch size 1).

        temperature < 1e-5 is greedy (identical to the base model's greedy decoding in fp32);
        otherwise tokens follow the target's distribution after temperature, top_k (0 = off) and
        top_p (0 = off). Stops at EOS, after `max_new_token_num` new tokens, or at `max_length`
        total tokens. `tree` overrides the method's tree settings for this call (DART: e.g.
        {"remain_total": 16}; EAGLE-3: {"total_tokens": 16}).
        `return_stats` also returns the GenerationStats (τ, acceptance lengths, timings).
        """
        steps = self.dart_generate_stream(
            input_ids, temperature, top_p, top_k, max_new_token_num, max_length,
            generator=generator, tree=tree, profile=profile,
        )
        return self._collect(input_ids, steps, return_stats)

    # --------------------------------------------------------------------- autoregressive baseline
    def ar_generate_stream(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        profile: bool | None = None,
    ) -> Iterator[StepOutput]:
        """Plain autoregressive decoding through the same target adapter (one token per forward)."""
        return self._stream(input_ids, temperature, top_p, top_k, max_new_token_num, max_length, generator,
                            profile, False)

    def ar_generate(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        profile: bool | None = None,
        return_stats: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, GenerationStats]:
        """Autoregressive baseline with the same arguments and output as `dart_generate`."""
        steps = self.ar_generate_stream(
            input_ids, temperature, top_p, top_k, max_new_token_num, max_length, generator=generator, profile=profile
        )
        return self._collect(input_ids, steps, return_stats)

    def _collect(
        self, input_ids: torch.Tensor | list[int], steps: Iterator[StepOutput], return_stats: bool
    ) -> torch.Tensor | tuple[torch.Tensor, GenerationStats]:
        prompt = as_prompt(input_ids)
        new: list[int] = []
        for step in steps:
            new.extend(step.tokens)
        out = torch.cat([prompt, torch.tensor(new, dtype=torch.long)])[None]
        device = input_ids.device if isinstance(input_ids, torch.Tensor) else torch.device("cpu")
        out = out.to(device)
        if return_stats:
            assert self.last_stats is not None
            return out, self.last_stats
        return out
