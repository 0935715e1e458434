"""What `dart-app` runs behind its page, without Gradio: the methods a loaded model offers, one
streamed answer per call, and the HTML the page shows for it.

Every method streams through the one decoding loop of `dart_infer.decoding.loop` (`dart_generate_stream`
of a `DartModel` with a head of that method, `ar_generate_stream`), one step per iteration; `Engine.stream` checks a stop request before every step, and `throttle` caps how often
the page is updated without batching the steps themselves.
"""

from __future__ import annotations

import dataclasses
import html
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dart_infer.decoding.stats import StepOutput

__all__ = ["AR", "DART", "DART_NO_TRIE", "EAGLE3", "Answer", "Decoding", "Engine", "load_eagle3_stream", "throttle"]

DART, DART_NO_TRIE, AR, EAGLE3 = "DART", "DART (no trie)", "AR (plain)", "EAGLE-3"

MAX_BARS = 400  # per-step bars shown at most

# A method: (prompt ids [T], settings, sampling RNG) -> its steps, the first being the prefill's token.
StreamFn = Callable[[torch.Tensor, "Decoding", torch.Generator], Iterator[StepOutput]]


@dataclass(frozen=True)
class Decoding:
    """The page's decoding controls. 0 turns temperature (greedy), top-p and top-k off."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    tree_size: int | None = None  # draft nodes verified per step (DART's remain_total); None = the model's
    max_new_tokens: int = 256
    seed: int = 0

    @classmethod
    def from_controls(
        cls, temperature: Any, top_p: Any, top_k: Any, tree_size: Any, max_new_tokens: Any, seed: int = 0
    ) -> Decoding:
        """Settings from the page's raw values; a bad one raises ValueError naming the control."""

        def number(name: str, value: Any, kind: type) -> Any:
            if value is None or value == "":
                raise ValueError(f"{name} is empty: enter a number")
            try:
                out = kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"{name} must be a number, got {value!r}") from None
            if kind is int and float(value) != out:
                raise ValueError(f"{name} must be a whole number, got {value!r}")
            return out

        settings = cls(
            temperature=number("temperature", temperature, float),
            top_p=number("top-p", top_p, float),
            top_k=number("top-k", top_k, int),
            tree_size=number("tree size", tree_size, int),
            max_new_tokens=number("max new tokens", max_new_tokens, int),
            seed=seed,
        )
        settings.check()
        return settings

    def check(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN and inf too
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top-p must be in [0, 1] (0 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if self.tree_size is not None and self.tree_size < 1:
            raise ValueError(f"tree size must be >= 1 draft node, got {self.tree_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max new tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Answer:
    """One streamed answer so far: its tokens (which came from accepted drafts), steps and time.

    Its tokens are the prompt forward's first token, then per verification step the accepted draft
    tokens that were kept and the target's own token: `len(tokens) == prefill_tokens + sum(emitted)` and
    `sum(emitted) == drafted_tokens + target_tokens`. A step cut at EOS or at the token budget keeps
    only what it emitted (its target token, and maybe some of its accepted drafts, are dropped).
    """

    method: str
    tokens: list[int] = field(default_factory=list)
    segments: list[tuple[str, bool]] = field(default_factory=list)  # (text, from an accepted draft)
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens kept per verification step
    emitted: list[int] = field(default_factory=list)  # tokens kept per verification step (drafts + target's)
    seconds: float = 0.0  # decoding time only (not the page's)
    finished: bool = False
    stopped: bool = False  # stopped on request before the end
    text: str = ""

    @property
    def steps(self) -> int:
        return len(self.emitted)

    @property
    def tau(self) -> float:
        """Tokens per verification step, bonus included (the paper's compression ratio τ)."""
        return sum(self.emitted) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def drafted_tokens(self) -> int:
        """Tokens that came from accepted drafts (all of them emitted)."""
        return sum(self.accept_lengths)

    @property
    def target_tokens(self) -> int:
        """Tokens of the verification steps that the target chose itself (the bonus / correction token)."""
        return sum(self.emitted) - self.drafted_tokens

    @property
    def prefill_tokens(self) -> int:
        """The token of the prompt's forward (1 once the answer has begun; it is no verification step)."""
        return len(self.tokens) - sum(self.emitted)


def _decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    if tokenizer is None:  # a bare model: show token ids
        return lambda ids: "".join(f"[{i}]" for i in ids)
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


class Engine:
    """A loaded `DartModel` and the methods it offers, by display name: its head's method (DART, with
    or without a trie, or another method's name) when it has a head, plain decoding, and EAGLE-3 on the
    same target when `eagle3` is given (`load_eagle3_stream`).

    `notices` are what the page says at the top about what was (not) loaded: a missing head or trie,
    an EAGLE-3 head that cannot be served yet. `stream` runs one method on a conversation.
    """

    def __init__(
        self,
        model: Any,
        *,
        eagle3: StreamFn | None = None,
        notices: Sequence[str] = (),
        max_length: int = 2048,
        defaults: Decoding | None = None,
        update_interval: float = 0.1,
    ) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.decode = _decoder(self.tokenizer)
        self.max_length = max_length
        self.notices = list(notices)
        self.defaults = defaults or Decoding()
        self.update_interval = update_interval  # seconds between page updates of a streamed answer
        self.draft_length = model.draft_depth  # 0 without a head: the page's tree-size control is off
        self.methods: dict[str, StreamFn] = {}
        method = model.method
        if method is not None:
            name = (DART if model.trie is not None else DART_NO_TRIE) if method.uses_trie else method.display_name
            self.methods[name] = self._dart
        self.methods[AR] = self._ar
        if eagle3 is not None:
            self.methods[EAGLE3] = eagle3

    @property
    def method_names(self) -> list[str]:
        return list(self.methods)

    @property
    def tree_size(self) -> int:
        """The page's tree-size control: the head's verified nodes per step; without a head (the control
        is off) the size DART would use on this device."""
        from dart_infer.methods import get_method

        method, target = self.model.method, self.model.target
        if method is None:
            return int(get_method("dart").default_tree(target.device, target.dtype).remain_total)
        return int(getattr(self.model.tree, method.tree_size_field))

    def warm_up(self) -> None:
        """A few tokens through every method, so the first request's tokens/s is not the first call's."""
        for name in self.methods:
            for _ in self.stream(name, [{"role": "user", "content": "Hi"}], Decoding(max_new_tokens=4)):
                pass

    def _dart(self, ids: torch.Tensor, d: Decoding, generator: torch.Generator) -> Iterator[StepOutput]:
        tree = None if d.tree_size is None else {self.model.method.tree_size_field: d.tree_size}
        return self.model.dart_generate_stream(
            ids, d.temperature, d.top_p, d.top_k, d.max_new_tokens, self.max_length, generator=generator, tree=tree
        )

    def _ar(self, ids: torch.Tensor, d: Decoding, generator: torch.Generator) -> Iterator[StepOutput]:
        return self.model.ar_generate_stream(
            ids, d.temperature, d.top_p, d.top_k, d.max_new_tokens, self.max_length, generator=generator
        )

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> torch.Tensor:
        """Token ids of a conversation under the model's chat template, ready for the answer."""
        from dart_infer.data.conversations import chat_prompt

        ids = chat_prompt(self.tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
        if ids.numel() >= self.max_length:
            raise ValueError(
                f"the conversation is {ids.numel()} tokens, at or over max_length={self.max_length}: "
                "press Clear to start a new one"
            )
        return ids

    def stream(
        self,
        method: str,
        messages: Sequence[Mapping[str, str]],
        settings: Decoding,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[Answer]:
        """Yield the growing answer of `method` to `messages` after every step (the same object).

        `stop` is asked before every step; once it says True decoding ends there (the decoding loop
        is closed) and the answer is yielded once more with `stopped` set. Bad settings, an unknown
        method or an over-long conversation raise ValueError before the first token.
        """
        if method not in self.methods:
            raise ValueError(f"method {method!r} is not loaded here; choose one of {self.method_names}")
        settings.check()
        if self.draft_length == 0:  # no head: the tree-size control is off, every method uses its own tree
            settings = dataclasses.replace(settings, tree_size=None)
        ids = self.prompt_ids(messages)
        generator = torch.Generator().manual_seed(settings.seed)
        steps = self.methods[method](ids, settings, generator)  # arguments are checked here
        answer = Answer(method)
        text_at = {0: ""}  # decoded text of the first n tokens, at segment boundaries
        while True:
            if stop is not None and stop():
                steps.close()
                answer.stopped = answer.finished = True
                yield answer
                return
            start = time.perf_counter()
            step = next(steps, None)
            answer.seconds += time.perf_counter() - start
            if step is None:
                answer.finished = True
                yield answer
                return
            first = not answer.tokens and not answer.emitted
            # The accepted drafts this step kept: an EOS or budget cut keeps fewer than it accepted.
            drafted = 0 if first else min(step.accept_length, len(step.tokens))
            if not first:  # the prefill's token is not a verification step
                answer.accept_lengths.append(drafted)
                answer.emitted.append(len(step.tokens))
            for run, is_draft in ((step.tokens[:drafted], True), (step.tokens[drafted:], False)):
                if run:
                    self._append(answer, run, is_draft, text_at)
            answer.text = text_at[len(answer.tokens)]
            answer.finished = step.finished
            yield answer
            if step.finished:
                return

    def _append(self, answer: Answer, run: list[int], is_draft: bool, text_at: dict[int, str]) -> None:
        before = text_at[len(answer.tokens)]
        answer.tokens.extend(run)
        after = self.decode(answer.tokens)
        text_at[len(answer.tokens)] = after
        # A token that completes a multi-byte character changes the text before it: keep what the
        # earlier segments showed and put the difference in this one.
        piece = after[len(before):] if after.startswith(before) else self.decode(run)
        answer.segments.append((piece, is_draft))


def throttle(answers: Iterator[Answer], interval: float) -> Iterator[Answer]:
    """The first, the last, and at most one answer per `interval` seconds in between: a small model
    decodes hundreds of steps a second, more page updates than a browser renders. Steps still run one
    by one, and a caller that stops iterating stops decoding within `interval` plus one step."""
    last = None
    for answer in answers:
        now = time.monotonic()
        if last is None or answer.finished or now - last >= interval:
            last = now
            yield answer


def load_eagle3_stream(model: Any, path: str, max_length: int = 2048) -> StreamFn:
    """The EAGLE-3 method: the EAGLE-3 head at `path` on `model`'s base model (shared, not copied),
    decoding through the same loop as DART; the page's tree size is its method's tree-size field.
    Raises with the reason when the head cannot be loaded, is not an EAGLE-3 head or does not fit."""
    from dart_infer.methods import load_head

    head, method = load_head(path)
    if method.name != "eagle3":
        raise ValueError(f"{path} is a {method.display_name} head, not an EAGLE-3 head")
    eagle3 = model.with_head(head)

    def stream(ids: torch.Tensor, d: Decoding, generator: torch.Generator) -> Iterator[StepOutput]:
        tree = None if d.tree_size is None else {method.tree_size_field: d.tree_size}
        return eagle3.dart_generate_stream(
            ids, d.temperature, d.top_p, d.top_k, d.max_new_tokens, max_length, generator=generator,
            tree=tree,
        )

    return stream


# ------------------------------------------------------------------------------------- rendering


def tokens_html(answer: Answer) -> str:
    """The answer with the tokens that came from accepted drafts highlighted."""
    parts = [
        f'<span class="drafted">{html.escape(text)}</span>' if drafted else html.escape(text)
        for text, drafted in answer.segments
    ]
    return f'<div class="answer">{"".join(parts)}</div>'


def stats_line(answer: Answer) -> str:
    """tokens/s, τ and where the tokens came from, as the page's readout (plain text), in parts that add up:

    `τ 1.86 tokens/step (1.00 accepted drafts + 0.86 from the target) · 14 tokens = 1 from the prompt's
    forward + 13 in 7 verification steps`: τ = 13 / 7, the drafts kept per step plus the target's own
    tokens per step make τ (the target's share is printed as τ minus the drafts' share, both rounded,
    so the printed numbers add up too), and the prompt forward's token plus the steps' make the total.
    """
    steps = answer.steps
    tau = round(answer.tau * 100)  # in hundredths, as printed
    drafts = round(answer.drafted_tokens / steps * 100) if steps else 0
    state = "stopped" if answer.stopped else "done" if answer.finished else "generating…"
    return (
        f"{answer.tokens_per_second:.1f} tokens/s · τ {tau / 100:.2f} tokens/step ({drafts / 100:.2f} accepted "
        f"drafts + {(tau - drafts) / 100:.2f} from the target) · {len(answer.tokens)} tokens = "
        f"{answer.prefill_tokens} from the prompt's forward + {sum(answer.emitted)} in {steps} verification "
        f"steps · {answer.seconds:.2f} s · {state}"
    )


def stats_html(answer: Answer | None, elem_class: str = "stats") -> str:
    if answer is None:
        return f'<div class="{elem_class}">tokens/s –  · τ –</div>'
    return f'<div class="{elem_class}">{html.escape(stats_line(answer))}</div>'


def steps_html(answer: Answer | None, draft_length: int) -> str:
    """One bar per verification step, as tall as the accepted draft tokens it kept (of `draft_length`):
    the same counts as the readout's accepted drafts (`stats_line`), so the bars sum to its drafts."""
    if answer is None or not answer.steps:
        return '<div class="steps"><div class="steps-caption">accepted draft tokens per step: –</div></div>'
    top = max(draft_length, max(answer.accept_lengths), 1)
    # The newest MAX_BARS steps: a long answer's bars would outgrow the row (the histogram counts all).
    first = max(0, answer.steps - MAX_BARS)
    kept = zip(answer.accept_lengths[first:], answer.emitted[first:], strict=True)
    bars = "".join(
        f'<div class="step-bar" title="step {i + 1}: {n} accepted drafts, {e - n} from the target" '
        f'data-accepted="{n}" data-emitted="{e}" style="height:{4 + 56 * n / top:.0f}px"></div>'
        for i, (n, e) in enumerate(kept, start=first)
    )
    shown = f"; the last {MAX_BARS} shown" if first else ""
    counts = [answer.accept_lengths.count(k) for k in range(top + 1)]
    histogram = " · ".join(f"{k}: {c}" for k, c in enumerate(counts) if c)
    return (
        f'<div class="steps"><div class="steps-caption">accepted draft tokens kept per step '
        f"({answer.steps} verification steps{shown}, {answer.drafted_tokens} drafts in all; "
        f"how many steps kept k: {histogram})</div>"
        f'<div class="step-bars">{bars}</div></div>'
    )


def panel_html(answer: Answer | None, method: str, draft_length: int) -> str:
    """One side of the side-by-side view: method, readout, answer, per-step bars."""
    body = tokens_html(answer) if answer is not None else '<div class="answer"></div>'
    return (
        f'<div class="panel"><div class="panel-method">{html.escape(method)}</div>'
        f"{stats_html(answer)}{body}{steps_html(answer, draft_length)}</div>"
    )
