"""What the other parts load: embedded models, datasets and heads (`assets`; the shipped head in
`heads/`), chat templates (`chat_templates`, `templates/`), conversation and prompt files with the
held-out split (`conversations`), tokenizer/trie loaders and their checks (`loaders`), and what a trie
setting (auto / null / a path) resolves to (`resolve`).

May import: `common`, `tree`.
"""
