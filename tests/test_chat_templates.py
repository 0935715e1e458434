"""Chat templates for base models without one (`model.chat_template`, `dart_infer.data.loaders.load_tokenizer`):
the built-ins' exact renderings and loss masks (golden), the ways to name a template, the errors without
one, and the setting reaching the tokenizer in every tool (dart-ngram, dart-train, dart-eval, dart-app,
dart-demo). Real tokenizers: SmolLM2's, on which `<start_of_turn>` is ordinary text (several tokens), and
the same with Gemma's turn markers added as special tokens."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_llama

from dart_infer.data.chat_templates import (
    BUILTIN_CHAT_TEMPLATES,
    builtin_chat_template,
    resolve_chat_template,
)
from dart_infer.data.conversations import chat_prompt
from dart_infer.data.loaders import load_tokenizer
from dart_train.data.template import ChatTemplateError, check_chat_template, tokenize_conversation

pytestmark = pytest.mark.smollm2  # SmolLM2's real tokenizer throughout

MODEL = "smollm2-135m-instruct"

# Two exchanges after a system message; the whitespace around the second user and assistant contents
# is trimmed by both templates.
CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "  Another one?\n"},
        {"role": "assistant", "content": "Blue.\n"},
    ]
}

# SmolLM2's bos_token is <|im_start|>: gemma-turns writes the tokenizer's BOS first, whatever it is.
GEMMA_TURNS_TEXT = (
    "<|im_start|>"
    "<start_of_turn>user\nYou are terse.\n\nName a primary colour.<end_of_turn>\n"
    "<start_of_turn>model\nRed.<end_of_turn>\n"
    "<start_of_turn>user\nAnother one?<end_of_turn>\n"
    "<start_of_turn>model\nBlue.<end_of_turn>\n"
)
GEMMA_TURNS_TRAINED = ["Red.<end_of_turn>", "Blue.<end_of_turn>"]

# SmolLM2's eos_token is <|im_end|>. The generation prompt ends at the colon: the space is the answer's.
PLAIN_TEXT = (
    "System: You are terse.\n\n"
    "User: Name a primary colour.\n\n"
    "Assistant: Red.<|im_end|>\n\n"
    "User: Another one?\n\n"
    "Assistant: Blue.<|im_end|>"
)
PLAIN_TRAINED = [" Red.<|im_end|>", " Blue.<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    """SmolLM2's tokenizer with each built-in template, loaded as every tool loads it."""
    return {name: load_tokenizer(MODEL, name) for name in BUILTIN_CHAT_TEMPLATES}


def _trained_runs(tokenizer: Any, sequence: dict[str, torch.Tensor]) -> list[list[int]]:
    """The loss mask's runs of consecutive trained tokens (one per assistant turn)."""
    runs: list[list[int]] = []
    previous = False
    for token, trained in zip(sequence["input_ids"].tolist(), sequence["loss_mask"].tolist(), strict=True):
        if trained and not previous:
            runs.append([])
        if trained:
            runs[-1].append(token)
        previous = trained
    return runs


def _golden(tokenizer: Any, text: str, trained: list[str]) -> list[list[int]]:
    assert tokenizer.apply_chat_template(CONVERSATION["messages"], tokenize=False) == text
    [sequence] = tokenize_conversation(tokenizer, CONVERSATION, 4096)
    ids = sequence["input_ids"].tolist()
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # the ids round-trip to the rendered text
    runs = _trained_runs(tokenizer, sequence)
    assert [tokenizer.decode(run) for run in runs] == trained
    return runs


# ------------------------------------------------------------------------------------ golden renderings


def test_gemma_turns_golden_text_and_loss_mask(tokenizers) -> None:
    _golden(tokenizers["gemma-turns"], GEMMA_TURNS_TEXT, GEMMA_TURNS_TRAINED)


def test_plain_golden_text_and_loss_mask(tokenizers) -> None:
    tokenizer = tokenizers["plain"]
    runs = _golden(tokenizer, PLAIN_TEXT, PLAIN_TRAINED)
    assert all(run[-1] == tokenizer.eos_token_id for run in runs)  # every answer is trained to stop


def test_gemma_turns_with_gemmas_turn_markers_as_special_tokens(tokenizers) -> None:
    """As with Gemma's own tokenizer: <end_of_turn> is one token, the last of each trained run."""
    tokenizer = copy.deepcopy(tokenizers["gemma-turns"])
    tokenizer.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    runs = _golden(tokenizer, GEMMA_TURNS_TEXT, GEMMA_TURNS_TRAINED)
    assert [run[-1] for run in runs] == [end_of_turn, end_of_turn]
    assert [tokenizer.decode(run[:-1]) for run in runs] == ["Red.", "Blue."]


@pytest.mark.parametrize(("name", "prompt_end"), [("gemma-turns", "<start_of_turn>model\n"), ("plain", "Assistant:")])
def test_serving_prompts_are_the_tokens_training_saw(tokenizers, name: str, prompt_end: str) -> None:
    """`chat_prompt` (dart-eval, dart-app) renders the history exactly as the training sequence holds it,
    up to where the assistant's trained answer begins."""
    tokenizer = tokenizers[name]
    messages = CONVERSATION["messages"]
    [sequence] = tokenize_conversation(tokenizer, CONVERSATION, 4096)
    for turn in (2, 4):  # the assistant turns
        prompt = chat_prompt(tokenizer, messages[:turn]).tolist()
        assert tokenizer.decode(prompt).endswith(prompt_end)
        assert prompt == sequence["input_ids"][: len(prompt)].tolist()
        assert sequence["loss_mask"][len(prompt)] and not sequence["loss_mask"][len(prompt) - 1]


def test_roles_need_not_alternate_and_a_lone_system_message_is_a_user_turn(tokenizers) -> None:
    """Unlike Gemma's own template, gemma-turns renders what training data holds instead of raising."""
    render = tokenizers["gemma-turns"].apply_chat_template
    messages = [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"},
                {"role": "user", "content": "U1"}, {"role": "user", "content": "U2"}]
    assert render(messages, tokenize=False) == (
        "<|im_start|><start_of_turn>user\nS<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
        "<start_of_turn>user\nU1<end_of_turn>\n<start_of_turn>user\nU2<end_of_turn>\n"
    )
    assert tokenizers["plain"].apply_chat_template(messages[2:3], tokenize=False, add_generation_prompt=True) == (
        "User: U1\n\nAssistant:"
    )


# ------------------------------------------------------------------------------- naming a template


def test_load_tokenizer_takes_a_builtin_a_file_or_a_jinja_string(tmp_path: Path, smollm2_tokenizer) -> None:
    own = smollm2_tokenizer.chat_template
    assert own and load_tokenizer(MODEL).chat_template == own  # None: the tokenizer's own
    assert load_tokenizer(MODEL, "").chat_template == own
    for name in BUILTIN_CHAT_TEMPLATES:
        assert load_tokenizer(MODEL, name).chat_template == builtin_chat_template(name)
        assert (Path(__file__).parents[1] / "dart_infer" / "data" / "templates" / f"{name}.jinja").read_text() == (
            builtin_chat_template(name)
        )
    literal = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert load_tokenizer(MODEL, literal).chat_template == literal
    file = tmp_path / "mine.jinja"
    file.write_text(literal)
    tokenizer = load_tokenizer(MODEL, str(file))
    assert tokenizer.chat_template == literal
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi\n"


def test_unknown_template_names_the_builtins() -> None:
    with pytest.raises(ValueError, match="not a built-in name") as err:
        load_tokenizer(MODEL, "gemma")
    assert all(name in str(err.value) for name in BUILTIN_CHAT_TEMPLATES)
    with pytest.raises(ValueError, match="no such file") as err:
        resolve_chat_template("missing/template.jinja")
    assert all(name in str(err.value) for name in BUILTIN_CHAT_TEMPLATES)
    with pytest.raises(ValueError, match="gemma-turns, plain"):
        builtin_chat_template("chatml")


# ------------------------------------------------------------------------------- no template at all


def test_a_tokenizer_without_a_template_is_an_error_that_names_the_setting(smollm2_tokenizer) -> None:
    from omegaconf import OmegaConf

    from dart_infer.cli.ngram import make_sources

    bare = copy.deepcopy(smollm2_tokenizer)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match=r"model\.chat_template=gemma-turns\|plain\|<file\.jinja>"):
        check_chat_template(bare)
    with pytest.raises(ValueError, match=r"no chat template.*model\.chat_template=gemma-turns\|plain"):
        chat_prompt(bare, [{"role": "user", "content": "hi"}])
    cfg = OmegaConf.create({"conversation_text": "chat_template",
                            "ngram": {"sources": [{"kind": "conversations", "source": "mtbench", "limit": 1}]}})
    [source] = make_sources(cfg, bare)
    with pytest.raises(ValueError, match=r"model\.chat_template"):
        next(iter(source.texts()))


# ------------------------------------------------------------------- the setting reaches every tool


@pytest.fixture(scope="module")
def saved_tiny_pair(tmp_path_factory, smollm2_tokenizer) -> tuple[Path, Path]:
    """A tiny random Llama saved with SmolLM2's tokenizer (its own template), and a head for it."""
    from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel

    base = tiny_llama(0, vocab_size=len(smollm2_tokenizer), head_dim=8, max_position_embeddings=512,
                      bos_token_id=smollm2_tokenizer.bos_token_id, eos_token_id=smollm2_tokenizer.eos_token_id)
    root = tmp_path_factory.mktemp("tiny_pair")
    base.save_pretrained(root / "base")
    smollm2_tokenizer.save_pretrained(root / "base")
    head = DartDraftModel(DartDraftConfig.from_target_config(base.config, draft_length=2, draft_vocab_size=16))
    head.set_vocab_mapping(torch.arange(16))
    head.save_pretrained(root / "head")
    return root / "base", root / "head"


def _hydra():
    from hydra import initialize_config_dir

    from dart_infer.common.configs import configs_dir

    return initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3")


def _compose(name: str, *overrides: str):
    from hydra import compose

    with _hydra():
        return compose(config_name=name, overrides=list(overrides))


def test_every_config_has_the_setting_and_null_keeps_the_tokenizers_own() -> None:
    for name in ("train", "eval", "app", "ngram", "demo"):
        assert _compose(name).model.chat_template is None
    assert _compose("ngram", "model=custom", "model.name_or_path=x").model.chat_template is None


def test_dart_ngram_and_dart_demo_pass_the_setting_on(tmp_path: Path) -> None:
    from dart_infer.cli.ngram import load_tokenizer as ngram_tokenizer
    from dart_train.demo import _compose as demo_stage

    cfg = _compose("ngram", "model.chat_template=plain", "conversation_text=chat_template")
    assert ngram_tokenizer(cfg).chat_template == builtin_chat_template("plain")
    demo = _compose("demo", f"out_dir={tmp_path}", "model.chat_template=gemma-turns")
    with _hydra():  # the demo composes each stage's own config
        stages = [demo_stage(name, demo, []) for name in ("ngram", "train", "eval")]
    assert [stage.model.chat_template for stage in stages] == ["gemma-turns"] * 3


def test_dart_train_eval_and_app_load_the_configured_template(saved_tiny_pair, smollm2_tokenizer) -> None:
    from dart_infer.cli.app import load_model as app_model
    from dart_infer.cli.eval import load_model as eval_model
    from dart_train.builders import load_target

    base, head = saved_tiny_pair
    plain = builtin_chat_template("plain")
    _, tokenizer, _ = load_target(_compose("train", f"model.name_or_path={base}", "model.chat_template=plain"))
    assert tokenizer.chat_template == plain
    _, tokenizer, _ = load_target(_compose("train", f"model.name_or_path={base}"))
    assert tokenizer.chat_template == smollm2_tokenizer.chat_template
    served = [f"model.name_or_path={base}", f"draft_model={head}", "ngram_model=null", "hardware=cpu"]
    model = eval_model(_compose("eval", *served, "model.chat_template=plain"), None)
    assert model.tokenizer.chat_template == plain
    model, has_head, notices = app_model(_compose("app", *served, "model.chat_template=plain"), "float32")
    assert has_head and model.tokenizer.chat_template == plain and not notices
    with pytest.raises(ValueError, match="not a built-in name"):  # before any model loads
        eval_model(_compose("eval", *served, "model.chat_template=plane"), None)
