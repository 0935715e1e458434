"""dart-eval on a tiny random target with the real SmolLM2 tokenizer: methods, metrics, files, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import run_dart_eval

from dart_infer import DartModel
from dart_infer.data.conversations import chat_prompt, load_conversations
from dart_infer.evaluation.evaluate import METHODS, EvalSettings, Evaluator, Sampling
from dart_infer.evaluation.results import markdown_table, save_results, summarize
from dart_infer.evaluation.tree_fit import fit_tree
from ngram_builder import NgramTrie


def test_every_method_on_two_turns(tiny_dart, tmp_path: Path) -> None:
    model, _ = tiny_dart
    evaluator = Evaluator(model, EvalSettings(methods=METHODS, max_new_tokens=12, multi_turn=True))
    evaluator.warm_up()
    conversations = load_conversations("mtbench", limit=2)
    records = evaluator.run("mtbench", conversations, progress=False)
    assert len(records) == 2 * 2 * len(METHODS)
    assert {(r.prompt_id, r.turn) for r in records} == {(c.id, t) for c in conversations for t in (0, 1)}
    # The second turn's prompt holds the first answer, so it is longer than the first.
    first, second = (next(r for r in records if r.method == "ar" and r.turn == t) for t in (0, 1))
    assert second.prompt_tokens > first.prompt_tokens + first.new_tokens
    for record in records:
        assert record.new_tokens > 0 and record.seconds > 0
        if record.method in ("hf_generate", "dart", "dart_no_trie"):
            assert record.identical_to_ar, record.method  # greedy fp32: lossless

    summary = summarize(records, draft_length=4)
    rows = summary["mtbench"]["T=0"]
    assert set(rows) == set(METHODS)
    assert rows["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    fastest = max(("ar", "hf_generate"), key=lambda m: rows[m]["tokens_per_second"])
    assert all(row["fastest_plain"] == fastest for row in rows.values())
    assert rows[fastest]["speedup_vs_fastest_plain"] == pytest.approx(1.0)
    assert rows["dart"]["speedup_vs_fastest_plain"] <= rows["dart"]["speedup_vs_ar"] + 1e-9
    for method in ("dart", "dart_no_trie"):
        assert 1.0 <= rows[method]["tau"] <= 5.0
        assert len(rows[method]["acceptance_by_position"]) == 4
        assert sum(rows[method]["accept_length_histogram"]) == sum(r.steps for r in records if r.method == method)
        assert {"draft", "search", "verify"} <= set(rows[method]["time_split"])
    assert rows["ar"]["tau"] is None and rows["prompt_lookup"]["tau"] is None

    written = save_results(tmp_path, records, summary, {"note": "test"})
    assert written.results_written and not written.failed
    paths = written.paths
    saved = json.loads(paths["json"].read_text())
    assert saved["summary"]["mtbench"]["T=0"]["dart"]["tau"] == rows["dart"]["tau"]
    assert len(saved["records"]) == len(records)
    assert "| mtbench | T=0 | dart | float32 |" in paths["markdown"].read_text()
    for key in ("speedup_plot", "acceptance_plot", "time_plot"):
        assert paths[key].read_bytes()[:4] == b"\x89PNG"


def test_fit_tree_measures_each_setting(tiny_dart) -> None:
    """Each row is that tree's own measurement (its τ and verified nodes equal DART's with that tree;
    the trees differ in nodes, so a fit that ignored the setting fails), ranked by measured speedup."""
    model, _ = tiny_dart
    prompts = [chat_prompt(model.tokenizer, c.messages[:1]) for c in load_conversations("mtbench", limit=2)]
    grid = [{"draft_top_k": 2, "beam_width": 1, "remain_total": 1},
            {"draft_top_k": 8, "beam_width": 4, "remain_total": 8}]
    results = fit_tree(model, prompts, grid, max_new_tokens=16)
    assert sorted((r["draft_top_k"], r["beam_width"], r["remain_total"]) for r in results) == [(2, 1, 1), (8, 4, 8)]
    for row in results:
        setting = {k: row[k] for k in grid[0]}
        stats = [model.dart_generate(ids, max_new_token_num=16, tree=setting, return_stats=True)[1] for ids in prompts]
        assert row["tau"] == pytest.approx(sum(sum(s.emitted) for s in stats) / sum(s.steps for s in stats))
        nodes = [n for s in stats for n in s.tree_sizes]
        assert row["tree_nodes"] == pytest.approx(sum(nodes) / len(nodes))
        assert row["tokens_per_second"] > 0 and row["speedup_vs_ar"] > 0
    # The two trees verify different numbers of nodes: a fit that ignored the setting would fail above.
    assert len({round(r["tree_nodes"], 6) for r in results}) == 2
    assert [r["speedup_vs_ar"] for r in results] == sorted((r["speedup_vs_ar"] for r in results), reverse=True)


def test_bad_settings_fail_before_any_work(tiny_dart) -> None:
    model, _ = tiny_dart
    with pytest.raises(ValueError, match="unknown method"):
        EvalSettings(methods=["ar", "medusa"])
    with pytest.raises(ValueError, match="baseline"):
        EvalSettings(methods=["dart"])
    no_trie = DartModel(model.base_model, model.draft_model, model.tokenizer, None)
    with pytest.raises(ValueError, match="needs an n-gram trie"):
        Evaluator(no_trie, EvalSettings(methods=["ar", "dart"]))


def test_cli_end_to_end(tiny_dart, tmp_path: Path) -> None:
    _, root = tiny_dart
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Write a limerick about CPUs."}\nnot json\n')
    result = run_dart_eval(
        "model=custom", f"model.name_or_path={root / 'base'}", f"draft_model={root / 'head'}",
        f"ngram_model={root / 'tiny.trie'}", f"benchmarks=[humaneval,{prompts}]", "limit=1", "max_new_tokens=8",
        f"out_dir={tmp_path / 'out'}", "tree.remain_total=4", "temperature=0", "baseline_dtypes=[]", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| humaneval | T=0 | dart | float32 |" in result.stdout
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    summary = saved["summary"]
    assert set(summary) == {"humaneval", str(prompts)}
    assert summary["humaneval"]["T=0"]["dart"]["identical_to_ar"] == 1.0
    # The float32 CPU default (the tiny model serves in fp32) with the one field overridden.
    from dart_infer.tree.settings import CPU_FP32_TREE

    assert saved["meta"]["tree"]["remain_total"] == 4
    assert saved["meta"]["tree"]["draft_top_k"] == CPU_FP32_TREE.draft_top_k
    assert saved["meta"]["tree"]["copy_span_tokens"] == CPU_FP32_TREE.copy_span_tokens
    assert "skipped 1 malformed" in result.stderr


def test_cli_rejects_unknown_benchmark_before_loading(tiny_dart, tmp_path: Path) -> None:
    _, root = tiny_dart
    result = run_dart_eval(f"draft_model={root / 'head'}", "benchmarks=[nosuchbench]", cwd=tmp_path)
    assert result.returncode != 0
    assert "Unknown conversation source 'nosuchbench'" in result.stderr


# ------------------------------------------------------------------------- dtypes and sampling


def test_bf16_serving_times_plain_decoding_in_both_dtypes_and_reports_fp32_agreement(tiny_dart) -> None:
    model, _ = tiny_dart
    bf16 = model.with_dtype("bfloat16")
    assert bf16.base_model.lm_head.weight.dtype == torch.bfloat16 and model.target.dtype == torch.float32
    methods = ["ar", "hf_generate", "dart", "dart_no_trie"]
    evaluator = Evaluator(bf16, EvalSettings(methods=methods, max_new_tokens=16), plain_models=[model])
    assert [r.label for r in evaluator.runs] == [*methods, "ar@fp32", "hf_generate@fp32"]
    conversations = load_conversations("mtbench", limit=3)
    records = evaluator.run("mtbench", conversations, progress=False)
    rows = summarize(records, draft_length=4)["mtbench"]["T=0"]
    assert {rows[label]["dtype"] for label in methods} == {"bfloat16"}
    assert rows["ar@fp32"]["dtype"] == "float32" and rows["ar@fp32"]["identical_to_fp32"] == 1.0
    # Agreement is measured against the fp32 target's greedy output, computed here independently.
    ids = [chat_prompt(model.tokenizer, c.messages[:1]) for c in conversations]
    reference = [model.ar_generate(i, max_new_token_num=16)[0, i.numel():].tolist() for i in ids]
    for label in [*methods, "hf_generate@fp32"]:
        outputs = [r.output_ids for r in records if r.label == label]
        prefixes = [next((k for k, (a, b) in enumerate(zip(o, ref, strict=False)) if a != b), min(len(o), len(ref)))
                    for o, ref in zip(outputs, reference, strict=True)]
        assert rows[label]["identical_to_fp32"] == pytest.approx(
            sum(o == ref for o, ref in zip(outputs, reference, strict=True)) / 3), label
        assert rows[label]["tokens_to_first_difference"] == pytest.approx(sum(prefixes) / 3), label
    # The fastest plain decoding is looked for in both dtypes; same-dtype ratios stay alongside.
    plain = ["ar", "hf_generate", "ar@fp32", "hf_generate@fp32"]
    fastest = max(plain, key=lambda label: rows[label]["tokens_per_second"])
    assert rows["dart"]["fastest_plain"] == fastest
    assert rows["dart"]["speedup_vs_fastest_plain"] == pytest.approx(
        rows["dart"]["tokens_per_second"] / rows[fastest]["tokens_per_second"])
    assert rows["dart"]["speedup_vs_ar"] == pytest.approx(
        rows["dart"]["tokens_per_second"] / rows["ar"]["tokens_per_second"])
    assert rows["ar@fp32"]["speedup_vs_ar"] == pytest.approx(1.0)
    table = markdown_table({"mtbench": {"T=0": rows}})
    assert "| mtbench | T=0 | ar@fp32 | float32 |" in table and f"mtbench T=0: {fastest}" in table
    with pytest.raises(ValueError, match="one model per dtype"):
        Evaluator(bf16, EvalSettings(methods=["ar"]), plain_models=[bf16])


def test_sampling_settings_reach_every_method_with_equal_seeds(tiny_dart) -> None:
    model, _ = tiny_dart
    settings = EvalSettings(
        methods=METHODS, max_new_tokens=12, seed=7,
        samplings=[Sampling(), Sampling(temperature=1.0), Sampling(temperature=1.0, top_k=1)],
    )
    records = Evaluator(model, settings).run("mtbench", load_conversations("mtbench", limit=2), progress=False)
    assert len(records) == 2 * 3 * len(METHODS)
    by = {(r.prompt_id, r.sampling, r.method): r for r in records}
    prompts = sorted({r.prompt_id for r in records})
    seeds = set()
    for prompt in prompts:
        for sampling in ("T=0", "T=1", "T=1 top_k=1"):
            group = [by[prompt, sampling, m] for m in METHODS]
            assert len({r.seed for r in group}) == 1  # one seed for every method of a prompt and setting
            seeds.add(group[0].seed)
        greedy = by[prompt, "T=0", "ar"].output_ids
        # top_k=1 leaves one token: every method, transformers' included, must decode greedily.
        assert all(by[prompt, "T=1 top_k=1", m].output_ids == greedy for m in METHODS), prompt
        # T=1 with the same seed: our AR and transformers' sampling draw the same tokens (fp32).
        assert by[prompt, "T=1", "hf_generate"].output_ids == by[prompt, "T=1", "ar"].output_ids
        assert by[prompt, "T=1", "hf_generate"].identical_to_ar
    assert len(seeds) == 6 and min(seeds) == 7
    assert any(by[p, "T=1", "ar"].output_ids != by[p, "T=0", "ar"].output_ids for p in prompts)
    # DART at T=1 reproduces from its recorded seed.
    record = by[prompts[0], "T=1", "dart"]
    ids = chat_prompt(model.tokenizer, load_conversations("mtbench", limit=2)[0].messages[:1])
    again = model.dart_generate(ids, 1.0, max_new_token_num=12, generator=torch.Generator().manual_seed(record.seed))
    assert again[0, ids.numel():].tolist() == record.output_ids
    summary = summarize(records, draft_length=4)["mtbench"]
    assert set(summary) == {"T=0", "T=1", "T=1 top_k=1"}
    assert summary["T=1"]["dart"]["tau"] >= 1.0 and summary["T=1"]["dart"]["identical_to_fp32"] is None
    with pytest.raises(ValueError, match="repeat"):
        EvalSettings(samplings=[Sampling(1.0), Sampling(1.0)])
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=2.0)


# ------------------------------------------------------------------- fresh-clone defaults (CLI)


def test_fit_tree_writes_into_out_dir_and_tree_accepts_the_file(tiny_dart, tmp_path: Path) -> None:
    from dart_infer.common.configs import configs_dir

    _, root = tiny_dart
    configs_before = sorted(p.name for p in (configs_dir() / "tree").iterdir())
    common = ["model=custom", f"model.name_or_path={root / 'base'}", f"draft_model={root / 'head'}",
              f"ngram_model={root / 'tiny.trie'}", "benchmarks=[humaneval]"]
    fit_dir = tmp_path / "fit"
    result = run_dart_eval(
        *common, "action=fit_tree", "model.dtype=bfloat16", f"out_dir={fit_dir}", "fit.prompts=1",
        "fit.max_new_tokens=6", "fit.grid.draft_top_k=[4]", "fit.grid.beam_width=[2]", "fit.grid.remain_total=[2,3]",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    fitted = yaml.safe_load((fit_dir / "fit_tree.yaml").read_text())
    assert fitted["dtype"] == "bfloat16" and fitted["device"] == "cpu" and len(fitted["all"]) == 2
    assert fitted["tree"]["draft_top_k"] == 4 and fitted["tree"]["remain_total"] in (2, 3)
    assert fitted["tree"]["ngram_weight"] == 0.5  # the whole tree, not only the searched fields
    assert sorted(p.name for p in (configs_dir() / "tree").iterdir()) == configs_before  # nothing written there

    out = tmp_path / "eval"
    result = run_dart_eval(
        *common, f"tree={fit_dir}", "tree.beam_width=3", "limit=1", "max_new_tokens=6", "temperature=0",
        "baseline_dtypes=[]", "methods=[ar,dart]", f"out_dir={out}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["tree"]["remain_total"] == fitted["tree"]["remain_total"] and meta["tree"]["draft_top_k"] == 4
    assert meta["tree"]["beam_width"] == 3  # a field given on the command line wins over the file
    assert meta["config"]["tree_file"] == str((fit_dir / "fit_tree.yaml").resolve())
    assert "was fitted in bfloat16" in result.stdout  # this run serves in float32
    missing = run_dart_eval(*common, f"tree={tmp_path / 'nope.yaml'}", "--cfg", "job", cwd=tmp_path)
    assert missing.returncode != 0 and "no such tree file" in missing.stderr


def test_tree_file_overrides_leave_group_names_alone(tmp_path: Path) -> None:
    from dart_infer.cli.tree_files import tree_file_overrides

    assert tree_file_overrides(["tree=cpu", "limit=2"]) == ["tree=cpu", "limit=2"]
    settings = tmp_path / "my_tree.yaml"
    settings.write_text("draft_top_k: 6\nlevel_weight: [1.0, 0.5]\n")  # a plain settings file works too
    out = tree_file_overrides([f"tree={settings}", "tree.draft_top_k=9"])
    assert out == ["++tree.level_weight=[1.0, 0.5]", f"tree_file={settings.resolve()}", "tree.draft_top_k=9"]
    settings.write_text("beam: 3\n")
    with pytest.raises(TypeError, match="unknown tree-search settings"):
        tree_file_overrides([f"tree={settings}"])


def test_cli_without_ngram_model_runs_dart_without_a_trie(tiny_dart, tmp_path: Path) -> None:
    _, root = tiny_dart
    common = ["model=custom", f"model.name_or_path={root / 'base'}", f"draft_model={root / 'head'}",
              "benchmarks=[humaneval]", "limit=1", "max_new_tokens=6", "temperature=0", "baseline_dtypes=[]",
              "methods=[ar,dart]"]
    result = run_dart_eval(*common, f"out_dir={tmp_path / 'none'}", cwd=tmp_path)  # no runs/ngram here
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("DART runs without a trie") == 1
    rows = json.loads((tmp_path / "none" / "results.json").read_text())["summary"]["humaneval"]["T=0"]
    assert set(rows) == {"ar", "dart_no_trie"}
    # When the default trie exists (and fits the tokenizer) it is used.
    default = tmp_path / "runs" / "ngram" / "sharegpt" / "full.ngt"
    default.parent.mkdir(parents=True)
    NgramTrie.open(root / "tiny.trie").save(default)
    result = run_dart_eval(*common, f"out_dir={tmp_path / 'default'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "using the default trie" in result.stdout
    rows = json.loads((tmp_path / "default" / "results.json").read_text())["summary"]["humaneval"]["T=0"]
    assert set(rows) == {"ar", "dart"}
    # An explicit path that does not exist fails before the model loads.
    result = run_dart_eval(*common, f"ngram_model={tmp_path / 'missing.ngt'}", cwd=tmp_path)
    assert result.returncode != 0 and "no such trie" in result.stderr


def test_cli_bf16_serving_with_fp32_baselines_at_two_temperatures(tiny_dart, tmp_path: Path) -> None:
    _, root = tiny_dart
    result = run_dart_eval(
        "model=custom", f"model.name_or_path={root / 'base'}", f"draft_model={root / 'head'}",
        f"ngram_model={root / 'tiny.trie'}", "benchmarks=[humaneval]", "limit=2", "max_new_tokens=8",
        "model.dtype=bfloat16", "baseline_dtypes=[float32,bfloat16]", "temperature=[0,1]",
        "methods=[ar,hf_generate,dart]", f"out_dir={tmp_path / 'out'}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["meta"]["serving_dtype"] == "bfloat16" and saved["meta"]["plain_dtypes"] == ["float32"]
    greedy, sampled = saved["summary"]["humaneval"]["T=0"], saved["summary"]["humaneval"]["T=1"]
    assert set(greedy) == set(sampled) == {"ar", "hf_generate", "dart", "ar@fp32", "hf_generate@fp32"}
    assert all(row["identical_to_fp32"] is not None for row in greedy.values())
    assert greedy["ar@fp32"]["identical_to_fp32"] == 1.0
    assert all(row["identical_to_fp32"] is None and row["speedup_vs_fastest_plain"] > 0 for row in sampled.values())
    assert "| humaneval | T=1 | dart | bfloat16 |" in result.stdout
