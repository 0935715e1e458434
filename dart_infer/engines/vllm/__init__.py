"""vLLM: `plugin` (loaded by vLLM in its own venv through the `vllm.general_plugins` entry point;
imports only `dart_infer.tree` and `ngram_builder` of this project, for the trie-chosen chain), `runner` (vLLM engines as dart-eval methods, in a subprocess of
vLLM's venv) and `worker` (the script that subprocess runs).
"""
