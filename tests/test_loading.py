"""Loading: one EOS set for serving and regeneration (the generation config's ids, then the tokenizer's EOS),
and `DartModel.from_pretrained`'s dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig

from dart_infer.data.loaders import eos_token_ids

# Llama-3 ids: <|end_of_text|> 128001, <|eom_id|> 128008, <|eot_id|> 128009 (the chat turn end).
END_OF_TEXT, EOM, EOT = 128001, 128008, 128009


def _model(generation_eos, config_eos=END_OF_TEXT):
    config = LlamaConfig(vocab_size=128256, eos_token_id=config_eos)
    generation_config = None if generation_eos == "absent" else GenerationConfig(eos_token_id=generation_eos)
    return SimpleNamespace(config=config, generation_config=generation_config)


def test_llama3_style_generation_config_and_tokenizer_are_united() -> None:
    tokenizer = SimpleNamespace(eos_token_id=EOT)
    # Llama-3.1-Instruct: the generation config already lists the tokenizer's EOS.
    assert eos_token_ids(_model([END_OF_TEXT, EOM, EOT]), tokenizer) == (END_OF_TEXT, EOM, EOT)
    # A fine-tune that kept only the base model's <|end_of_text|>: the chat turn end still stops.
    assert eos_token_ids(_model(END_OF_TEXT), tokenizer) == (END_OF_TEXT, EOT)
    # The first id (what the tree search ranks last) is the generation config's.
    assert eos_token_ids(_model([EOT, END_OF_TEXT]), SimpleNamespace(eos_token_id=END_OF_TEXT)) == (EOT, END_OF_TEXT)


def test_sources_and_their_absence() -> None:
    # No generation config: the model config's EOS stands in for it.
    assert eos_token_ids(_model("absent", config_eos=[END_OF_TEXT, EOT])) == (END_OF_TEXT, EOT)
    # A generation config with its EOS switched off and no tokenizer: no EOS stop at all.
    assert eos_token_ids(_model(None)) == ()
    assert eos_token_ids(_model(None), SimpleNamespace(eos_token_id=None)) == ()
    assert eos_token_ids(_model(None), SimpleNamespace(eos_token_id=EOT)) == (EOT,)


def test_regenerate_stops_at_the_serving_eos_set(monkeypatch, tmp_path) -> None:
    """`dart_train.data.regenerate` asks the same resolver, so it ends answers where serving does."""
    import torch

    from dart_train.data import regenerate as regen

    seen: dict[str, object] = {}

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.config = LlamaConfig(eos_token_id=END_OF_TEXT)
            self.generation_config = GenerationConfig(eos_token_id=END_OF_TEXT)

        def generate(self, input_ids, eos_token_id, **kwargs):
            seen["eos"] = list(eos_token_id)
            return torch.cat([input_ids, torch.full((input_ids.shape[0], 1), EOT)], dim=1)

    class Tokenizer:
        eos_token_id = EOT
        pad_token_id = None
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, **kwargs):
            return " ".join(m["content"] for m in messages)

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1, 2, 3]}

        def decode(self, ids, skip_special_tokens=True):
            return "ok"

    monkeypatch.setattr("dart_train.data.template.check_chat_template", lambda tokenizer: None)
    conversation = SimpleNamespace(id="c", messages=[{"role": "user", "content": "hi"}], source="t", meta={})
    stats = regen.regenerate(Model(), Tokenizer(), [conversation], tmp_path / "out.jsonl", max_new_tokens=4)
    assert seen["eos"] == list(eos_token_ids(Model(), Tokenizer())) == [END_OF_TEXT, EOT]
    assert stats.answers == 1 and stats.truncated_answers == 0  # 128009 ended the answer



def test_from_pretrained_takes_dtype_auto_as_the_machine_measured_one(tiny_checkpoint) -> None:
    """dtype="auto" is dart-eval's model.dtype=auto: bfloat16 where it measures faster here, else float32."""
    from dart_infer import DartModel
    from dart_infer.common.dtypes import bf16_is_faster

    model = DartModel.from_pretrained(str(tiny_checkpoint), None, dtype="auto")
    expected = torch.bfloat16 if bf16_is_faster("cpu") else torch.float32
    assert {p.dtype for p in model.base_model.parameters()} == {expected}
    with pytest.raises(ValueError, match="unknown dtype"):
        DartModel.from_pretrained(str(tiny_checkpoint), None, dtype="fp33")
