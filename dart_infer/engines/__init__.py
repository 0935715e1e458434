"""Other serving engines: heads written in their formats (`export`: vLLM speculators, SGLang) and
vLLM itself (`vllm`: the plugin it loads, and vLLM engines run as dart-eval methods).

May import: `common`, `tree`, `data`, `target`, `methods`.
"""
