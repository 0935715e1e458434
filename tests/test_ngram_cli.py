"""`dart-ngram`: build from several sources with a real (tiny, local) fast tokenizer, capped build,
convert, inspect, bad input. One optional test uses the real SmolLM2 tokenizer on ShareGPT."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from dart_infer.cli.ngram import run
from dart_infer.common.configs import configs_dir
from dart_infer.data.assets import tokenizer_fingerprint
from ngram_builder import NgramTrie
from ngram_builder.build import MalformedLineError

FIX = Path(__file__).parent / "fixtures"
WORDS = (["the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "house", "big", "small", "red", "blue", "green", "def", "return", "if", "else", "for", "in", "import", "print", "x", "y", "z", "is", "was"])


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    d = tmp_path_factory.mktemp("tiny_tok")
    fast.save_pretrained(d)
    return d


@pytest.fixture()
def corpus(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS, size=int(rng.integers(3, 30))))

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"meta": {"body": sentence()}}) for _ in range(40)) + "\n")
    long_jsonl = tmp_path / "long.jsonl"
    long_jsonl.write_text("\n".join(json.dumps({"text": sentence() * 3}) for _ in range(300)) + "\n")
    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(sentence() for _ in range(10)))
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "a.py").write_text("def x ( ) : return y if x else z\n")
    (tree / "pkg" / "b.py").write_text("import x\nfor y in x : print y\n")
    (tree / "pkg" / "skip.bin").write_bytes(b"\x00\xff")
    return {"jsonl": jsonl, "text": text, "tree": tree, "long": long_jsonl}


def _sources_override(c: dict[str, Path], jsonl_weight: float = 1.0) -> str:
    return ("ngram.sources=["
            f"{{kind:jsonl,path:'{c['jsonl']}',text_field:meta.body,weight:{jsonl_weight}}},"
            f"{{kind:text,path:'{c['text']}',split:paragraph}},"
            f"{{kind:tree,root:'{c['tree']}',include:['*.py']}}]")


def _cfg(tok_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        return compose("ngram", overrides=["model=custom", f"model.name_or_path={tok_dir}", "progress=false",
                                           "ngram.name=test", *overrides])


def _docs_by_hand(tok_dir: Path, c: dict[str, Path]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    texts = [json.loads(line)["meta"]["body"] for line in c["jsonl"].read_text().splitlines()]
    texts += [p for p in c["text"].read_text().split("\n\n") if p.strip()]
    texts += [(c["tree"] / "pkg" / n).read_text() for n in ("a.py", "b.py")]
    return [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]


def test_build_several_sources(tiny_tokenizer_dir: Path, corpus: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = _cfg(tiny_tokenizer_dir, _sources_override(corpus), f"out_dir={out}", "write_dart=true", "min_count=2")
    report = run(cfg)["report"]
    assert report.documents == 52 and report.tokens > 0
    assert set(report.per_source) == {f"jsonl:{corpus['jsonl']}", f"text:{corpus['text']}", f"tree:{corpus['tree']}"}
    full = NgramTrie.load(out / "full.ngt", verify=True)
    from transformers import AutoTokenizer

    assert full.tokenizer_fingerprint == tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)))
    ref = NgramTrie(3, vocab_size=full.vocab_size, tokenizer_fingerprint=full.tokenizer_fingerprint)
    for d in _docs_by_hand(tiny_tokenizer_dir, corpus):
        ref.add_tokens(d)
    ref.save(tmp_path / "ref.ngt")
    assert (tmp_path / "ref.ngt").read_bytes() == (out / "full.ngt").read_bytes()
    small = NgramTrie.load(out / "small.ngt", verify=True)
    assert small.num_nodes < full.num_nodes
    ref.prune(2).save(tmp_path / "ref_small.ngt")
    assert (tmp_path / "ref_small.ngt").read_bytes() == (out / "small.ngt").read_bytes()
    assert NgramTrie.load_dart(out / "full.trie").num_nodes == full.num_nodes
    saved = json.loads((out / "build_report.json").read_text())
    assert saved["outputs"]["full"]["nodes"] == full.num_nodes
    # Outputs are never overwritten silently.
    with pytest.raises(FileExistsError):
        run(cfg)
    run(_cfg(tiny_tokenizer_dir, _sources_override(corpus), f"out_dir={out}", "overwrite=true"))


def test_capped_build_is_byte_identical(tiny_tokenizer_dir: Path, corpus: dict[str, Path], tmp_path: Path) -> None:
    sources = _sources_override(corpus)[:-1] + f",{{kind:jsonl,path:'{corpus['long']}'}}]"
    run(_cfg(tiny_tokenizer_dir, sources, f"out_dir={tmp_path / 'mem'}"))
    # 32 KB: far below what the in-memory build holds, so several sorted runs and the builder
    # columns spill to disk and are merged from there.
    report = run(_cfg(tiny_tokenizer_dir, sources, f"out_dir={tmp_path / 'cap'}", "memory_cap_mb=0.03125"))["report"]
    assert report.tokens > 3 * 4096  # > 3 runs of the minimum chunk size
    for name in ("full.ngt", "small.ngt"):
        assert (tmp_path / "mem" / name).read_bytes() == (tmp_path / "cap" / name).read_bytes()
    assert not (tmp_path / "cap" / "tmp").exists()


def test_weights_and_caps(tiny_tokenizer_dir: Path, corpus: dict[str, Path], tmp_path: Path) -> None:
    one = run(_cfg(tiny_tokenizer_dir, _sources_override(corpus), f"out_dir={tmp_path / 'a'}"))["report"]
    two = run(_cfg(tiny_tokenizer_dir, _sources_override(corpus, 2.0), f"out_dir={tmp_path / 'b'}"))["report"]
    key = f"jsonl:{corpus['jsonl']}"
    assert two.per_source[key]["tokens"] == 2 * one.per_source[key]["tokens"]
    capped = run(_cfg(tiny_tokenizer_dir, f"ngram.sources=[{{kind:jsonl,path:'{corpus['jsonl']}',"
                      "text_field:meta.body,max_docs:5}]", f"out_dir={tmp_path / 'c'}"))["report"]
    assert capped.documents == 5


def test_bad_corpora(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        run(_cfg(tiny_tokenizer_dir, f"ngram.sources=[{{kind:jsonl,path:'{empty}'}}]", f"out_dir={tmp_path / 'o'}"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat"}\n{"text": oops\n')
    with pytest.raises(MalformedLineError, match="bad.jsonl:2"):
        run(_cfg(tiny_tokenizer_dir, f"ngram.sources=[{{kind:jsonl,path:'{bad}'}}]", f"out_dir={tmp_path / 'o2'}"))
    report = run(_cfg(tiny_tokenizer_dir, f"ngram.sources=[{{kind:jsonl,path:'{bad}',skip_malformed:true}}]",
                      f"out_dir={tmp_path / 'o3'}"))["report"]
    assert report.documents == 1
    with pytest.raises(FileNotFoundError):
        run(_cfg(tiny_tokenizer_dir, f"ngram.sources=[{{kind:jsonl,path:'{tmp_path / 'nope.jsonl'}'}}]",
                 f"out_dir={tmp_path / 'o4'}"))
    with pytest.raises(ValueError, match="unknown kind"):
        run(_cfg(tiny_tokenizer_dir, "ngram.sources=[{kind:csv,path:x}]", f"out_dir={tmp_path / 'o5'}"))
    with pytest.raises(ValueError, match="unknown action"):
        run(_cfg(tiny_tokenizer_dir, "action=explode"))


def test_convert_and_inspect(tiny_tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    compact = tmp_path / "g.ngt"
    run(_cfg(tiny_tokenizer_dir, "action=convert", f"input={FIX / 'golden60.trie'}", f"output={compact}",
             "vocab_size=49152", "fingerprint=smollm2"))
    t = NgramTrie.load(compact, verify=True)
    assert (t.num_nodes, t.vocab_size, t.tokenizer_fingerprint) == (87_893, 49152, "smollm2")
    back = tmp_path / "back.trie"
    run(_cfg(tiny_tokenizer_dir, "action=convert", f"input={compact}", f"output={back}"))
    assert NgramTrie.load_dart(back).num_nodes == 87_893
    with pytest.raises(FileExistsError):
        run(_cfg(tiny_tokenizer_dir, "action=convert", f"input={compact}", f"output={back}"))
    capsys.readouterr()
    res = run(_cfg(tiny_tokenizer_dir, "action=inspect", f"input={compact}", "context=[359,260]", "top_k=3",
                   "decode=false"))
    text = capsys.readouterr().out
    assert "num_nodes: 87893" in text and "smollm2" in text
    assert res["top"][0] == (43126, 5, pytest.approx(5 / 19))


def test_console_script_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dart_infer.cli.ngram", "action=inspect", f"input={FIX / 'golden60.trie'}", "decode=false",
         "context=[359,260]", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "num_nodes: 87893" in proc.stdout


@pytest.mark.smollm2
def test_sharegpt_build_reproduces_golden_trie(tmp_path: Path) -> None:
    """The first 60 ShareGPT train conversations, SmolLM2 tokenizer: the original's golden trie."""
    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        cfg = compose("ngram", overrides=["progress=false", f"out_dir={tmp_path}", "ngram.sources.0.max_docs=60"])
    report = run(cfg)["report"]
    assert report.documents == 60 and report.tokens == 89_597
    built = NgramTrie.load(tmp_path / "full.ngt", verify=True)
    assert built.num_nodes == 87_893
    golden = NgramTrie.load_dart(FIX / "golden60.trie", vocab_size=built.vocab_size,
                                 tokenizer_fingerprint=built.tokenizer_fingerprint)
    golden.save(tmp_path / "golden.ngt")
    assert (tmp_path / "golden.ngt").read_bytes() == (tmp_path / "full.ngt").read_bytes()
