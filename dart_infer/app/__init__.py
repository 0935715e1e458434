"""`dart-app`: a web page to chat with DART, plain decoding and EAGLE-3 on one base model, and to run
one prompt through two methods side by side (`engine`: methods, streaming, HTML; `ui`: the Gradio page;
the command is `dart_infer.cli.app`)."""

from dart_infer.app.engine import AR, DART, DART_NO_TRIE, EAGLE3, Answer, Decoding, Engine

__all__ = ["AR", "DART", "DART_NO_TRIE", "EAGLE3", "Answer", "Decoding", "Engine"]
