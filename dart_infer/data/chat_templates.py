"""Chat templates shipped in `dart_infer/data/templates/` and what a `chat_template` setting names.

Imports nothing else of dart_infer: assets (converting a GGUF model) and loaders (a tokenizer)
both read them."""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUILTIN_CHAT_TEMPLATES", "builtin_chat_template", "resolve_chat_template"]

# Chat templates shipped in dart_infer/data/templates/<name>.jinja (their header comments say exactly
# what they render): for base models whose tokenizer has no chat template.
TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"


BUILTIN_CHAT_TEMPLATES = ("gemma-turns", "plain")


def builtin_chat_template(name: str) -> str:
    """The Jinja source of a built-in chat template (`BUILTIN_CHAT_TEMPLATES`), e.g. to write into a
    converted checkpoint's tokenizer."""
    if name not in BUILTIN_CHAT_TEMPLATES:
        raise ValueError(f"no built-in chat template named {name!r}; built-ins: {', '.join(BUILTIN_CHAT_TEMPLATES)}")
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def resolve_chat_template(spec: str) -> str:
    """The Jinja source a `chat_template` setting names: a built-in name, a `.jinja` file's contents,
    or the setting itself when it is a Jinja string (holds `{%` or `{{`)."""
    spec = str(spec)
    if spec in BUILTIN_CHAT_TEMPLATES:
        return builtin_chat_template(spec)
    if "{%" in spec or "{{" in spec:
        return spec
    path = Path(spec).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a name too long to be a path
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    where = f"no such file {str(path.resolve())!r}" if spec.endswith(".jinja") else "not a built-in name"
    raise ValueError(
        f"chat_template={spec!r}: {where}. Give a built-in ({', '.join(BUILTIN_CHAT_TEMPLATES)}), "
        "the path of a .jinja file, or a Jinja string."
    )

