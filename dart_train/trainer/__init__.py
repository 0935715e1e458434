"""The DeepSpeed training loop and what it runs on: `engine` (DartTrainer, one step), `settings`
(the structured trainer/optim/logging config), `schedule`, `memory` (the step's memory estimate),
`metrics`, `checkpoints` (selection, resume checks, signals), `checkpointed` (the trainer's save,
resume, best and export), `run_dir` (resume modes of an output directory), `simulated_tau` (held-out τ
during training).

May import: `common`, `data`, `states`, `objectives`.
"""
