"""What the head's training step will need in memory, printed before training starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryEstimate", "estimate_step_memory"]


@dataclass
class MemoryEstimate:
    """Peak memory of the head's training forward + backward for the largest micro-batch (bytes).

    slots = T + A(d-1) per row (T padded tokens, A anchors, d draft length). Attention: the dense
    mask path (CPU) and eager flex_attention hold B·H·S² scores and probabilities (+ a B·S² mask);
    compiled flex attention (CUDA) holds only B·H·S·head_dim blocks (q, k, v, output and their
    gradients) and a block mask. Logits: B·A·d·draft_vocab fp32 rows, their log-probs and gradient."""

    rows: int
    tokens: int
    anchors: int
    slots: int
    attention: int
    logits: int
    kind: str

    @property
    def total(self) -> int:
        return self.attention + self.logits

    def describe(self) -> str:
        gib = 1024**3
        return (f"peak memory estimate of the head's step ({self.kind} attention), largest micro-batch "
                f"{self.rows} row(s) x {self.tokens} tokens + {self.anchors} anchors = {self.slots} slots: attention "
                f"{self.attention / gib:.3g} GiB, logits {self.logits / gib:.3g} GiB, together {self.total / gib:.3g} GiB")


def estimate_step_memory(
    batches: Any,
    lengths: list[int],
    loss_tokens: list[int],
    *,
    draft_config: Any,
    max_anchors: int | None,
    compiled_flex: bool,
    activation_bytes: int = 4,
) -> MemoryEstimate:
    """`MemoryEstimate` of the largest of `batches` (a sampler's batches: lists of dataset indices, or
    of rows of indices when packed), with the anchors `build_layout` would keep per row."""
    d = int(draft_config.draft_length)
    heads, head_dim = int(draft_config.num_attention_heads), int(draft_config.head_dim)
    vocab = int(draft_config.draft_vocab_size)
    best: MemoryEstimate | None = None
    for batch in batches:
        rows = [row if isinstance(row, list) else [row] for row in batch]
        tokens = max(sum(lengths[i] for i in row) for row in rows)
        anchors = max(sum(loss_tokens[i] for i in row) for row in rows)
        anchors = min(anchors, max_anchors) if max_anchors is not None else anchors
        b, slots = len(rows), tokens + anchors * (d - 1)
        if compiled_flex:
            blocks = -(-slots // 128)
            attention = 8 * b * heads * slots * head_dim * activation_bytes + b * heads * slots * 4 + 2 * b * blocks**2 * 4
        else:
            attention = 2 * b * heads * slots * slots * activation_bytes + b * slots * slots
        logits = 3 * b * anchors * d * vocab * 4
        estimate = MemoryEstimate(b, tokens, anchors, slots, attention, logits,
                                  "compiled flex" if compiled_flex else "dense-mask")
        if best is None or estimate.total > best.total:
            best = estimate
    if best is None:
        raise ValueError("no batch to estimate")
    return best
