"""The training objectives of the draft methods, and the one forward that dispatches between them.

- `dart`: DART's prefix-shared layout (all anchors of a sequence in one forward), `dart_forward`,
  the annealed KL loss and α_j;
- `eagle3`: EAGLE-3's training-time test over the same layout (`ttt_forward`);
- `methods`: each method's training hooks (`TrainMethod`) and `draft_forward`, which runs a head's own.

Order inside: dart < eagle3 < methods. May import `dart_train.common`, `dart_train.data` and
`dart_infer`; the trainer imports this package's names from here.
"""

from dart_train.objectives.dart import (
    ObjectiveOutput,
    PrefixSharedLayout,
    annealed_kl_loss,
    build_layout,
    dart_forward,
    target_to_draft_index,
)
from dart_train.objectives.methods import TrainMethod, draft_forward, get_train_method, train_method_of

__all__ = [
    "ObjectiveOutput",
    "PrefixSharedLayout",
    "TrainMethod",
    "annealed_kl_loss",
    "build_layout",
    "dart_forward",
    "draft_forward",
    "get_train_method",
    "target_to_draft_index",
    "train_method_of",
]
