"""DART heads in vLLM: `dart-export` writes what the plugin (`dart_infer.engines.vllm.plugin`) loads, and vLLM
with the plugin drafts exactly what our `DartDraftModel` drafts, losslessly, offline and behind its
OpenAI-compatible server (`vllm` marker: runs in .venv-vllm, made by `make vllm`; fails, never
skips, when it is missing). The target is test_export's tiny random Llama vLLM CPU can load."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import ROOT, VLLM_VENV, load_target, one_thread
from safetensors.torch import load_file

from dart_infer.cli.export import main as export_main
from dart_infer.engines.export import DART_CPU_DRAFT_MAX_BATCH, SPEC_CONFIG_FILE, draft_schedule, export_head
from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel
from dart_infer.methods.draft_head import DraftKVCache

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,", "1, 2, 3, 4, 5,"]
CHAT = "Write a short poem about the sea."
ROWS = 4  # d: the last prefix position + 3 masks; vLLM drafts k = d tokens per step
FITTED_MASKS = 2  # rows 0..2 memorise the target's continuations; row 3 stays random
MAX_NEW = 32
MARGIN = 1e-3  # draft rows whose top-2 logits are closer than this are not compared (fp32 noise)


def chat_ids(tokenizer) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return list(out["input_ids"])


def greedy(base, prompt: list[int], new: int) -> list[int]:
    out = base.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def aux_states(base, head: DartDraftModel, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        states = base(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in head.config.aux_layer_ids], dim=-1)


def fit_dart_head(base, prompts: list[list[int]], steps: int = 300) -> DartDraftModel:
    """A DART head whose rows 0..FITTED_MASKS memorise the target's greedy continuations of `prompts`
    (row 0 at every prefix position, masks 1..M in a prefix-shared layout: mask (t, m) sees the prefix
    up to t and its own block's earlier masks). Served anywhere, those drafts are then accepted."""
    seqs = [p + greedy(base, p, MAX_NEW + ROWS + 1) for p in prompts]
    config = DartDraftConfig.from_target_config(base.config, draft_length=ROWS, draft_vocab_size=512)
    head = DartDraftModel(config)
    used = torch.unique(torch.tensor([t for s in seqs for t in s]))
    others = torch.tensor(sorted(set(range(512 + used.numel())) - set(used.tolist())))[: 512 - used.numel()]
    head.set_vocab_mapping(torch.cat([used, others]).sort().values)
    head.set_target_embedding(base.get_input_embeddings().weight)
    draft_id = torch.full((config.vocab_size,), -100)
    draft_id[head.draft_to_target(torch.arange(512))] = torch.arange(512)
    batches = []
    for seq in seqs:
        n = len(seq) - 1  # prefix positions t = 0..n-1 pair aux_t with x_{t+1}
        anchor = torch.arange(n).repeat(FITTED_MASKS + 1)
        level = torch.arange(FITTED_MASKS + 1).repeat_interleave(n)
        q_anchor, q_level, k_anchor, k_level = anchor[:, None], level[:, None], anchor[None], level[None]
        mask = ((k_level == 0) & (k_anchor <= q_anchor)) | (
            (k_level > 0) & (k_anchor == q_anchor) & (k_level <= q_level))
        target_pos = anchor + level + 2  # row m of anchor t predicts x_{t+2+m}
        full = torch.tensor(seq + [0] * (FITTED_MASKS + 2))
        labels = torch.where(target_pos < len(seq), draft_id[full[target_pos]], -100)
        batches.append((aux_states(base, head, seq)[:, :n], torch.tensor([seq[1:]]), (anchor + level)[None],
                        mask[None, None], labels))
    torch.manual_seed(0)
    optimizer = torch.optim.Adam([p for n, p in head.named_parameters() if "embed" not in n], lr=3e-3)
    for _ in range(steps):
        loss = 0.0
        for aux, next_ids, positions, mask, labels in batches:
            res_p, in_p = head.prefix_inputs(aux, next_ids)
            res_m, in_m = head.mask_inputs(1, FITTED_MASKS * aux.shape[1])
            logits = head.decode(torch.cat([res_p, res_m], 1), torch.cat([in_p, in_m], 1), positions, mask)
            loss = loss + torch.nn.functional.cross_entropy(logits[0], labels, ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


@pytest.fixture(scope="module")
def fitted_dart(vllm_target_dir, smollm2_tokenizer, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """(saved fitted DART head as dart-train writes it, token-id prompts: TEXTS + the chat prompt)."""
    prompts = [smollm2_tokenizer(text).input_ids for text in TEXTS] + [chat_ids(smollm2_tokenizer)]
    with one_thread():
        head = fit_dart_head(load_target(vllm_target_dir), prompts)
    out = tmp_path_factory.mktemp("dart-run") / "head"
    head.save_pretrained(out)
    return out, prompts


class Oracle:
    """Our DART head on one known greedy sequence: its k chain tokens after any prefix of it."""

    def __init__(self, base, head: DartDraftModel, seq: list[int]) -> None:
        self.head, self.seq, self.aux = head, seq, aux_states(base, head, seq)

    def drafts(self, t: int, k: int) -> tuple[list[int], list[float]]:
        """(per-position argmax after x_0..x_{t+1}, each row's top-2 logit margin): one draft forward
        over prefix positions 0..t, as `DartDrafter.update` runs it."""
        with torch.no_grad():
            logits = self.head.draft_step(self.aux[:, : t + 1], torch.tensor([self.seq[1 : t + 2]]), DraftKVCache())
        top = logits.topk(2, dim=-1).values
        return self.head.draft_to_target(logits.argmax(-1))[:k].tolist(), (top[:, 0] - top[:, 1])[:k].tolist()

    def trie_chain(self, t: int, k: int, trie, settings, eos: int | None) -> list[int]:
        """Our loop's trie-chosen chain after x_0..x_{t+1} (`draft_trees`, tree=chain, the whole history),
        padded with the rows' argmax where the search ended early (as the plugin pads)."""
        from dart_infer.tree.settings import draft_trees

        with torch.no_grad():
            logits = self.head.draft_step(self.aux[:, : t + 1], torch.tensor([self.seq[1 : t + 2]]), DraftKVCache())
        tree = draft_trees(logits[None, :k], self.head, [torch.tensor(self.seq[: t + 2])], trie=trie,
                           settings=dataclasses.replace(settings, remain_total=k),
                           eos_token_ids=[] if eos is None else [eos])[0]
        chain = tree.tokens[1:].tolist()
        return chain + self.head.draft_to_target(logits.argmax(-1))[len(chain):k].tolist()

    def chain(self, prompt_len: int, k: int, budget: int, drafter=None) -> tuple[list[int], int]:
        """Greedy chain decoding with these drafts (`drafter(t, k)`, default the argmax chain): accepted
        tokens per position and verification steps."""
        per_position, steps, emitted, t = [0] * k, 0, 1, prompt_len - 1
        while emitted < budget:
            drafts = drafter(t, k) if drafter else self.drafts(t, k)[0]
            accepted = 0
            while accepted < k and drafts[accepted] == self.seq[t + 2 + accepted]:
                per_position[accepted] += 1
                accepted += 1
            steps, emitted, t = steps + 1, emitted + accepted + 1, t + accepted + 1
        return per_position, steps


def recorded_contexts(oracle: Oracle, records: list[dict]) -> Iterator[tuple[int, dict]]:
    """(t, record) for each recorded draft inside the oracle's sequence; its bonus token must be ours."""
    for record in records:
        t = record["position"]
        if t + 2 <= len(oracle.seq):
            assert record["bonus"] == oracle.seq[t + 1], record
            yield t, record


def compare_drafts(oracle: Oracle, records: list[dict]) -> tuple[int, int]:
    """Assert every draft vLLM recorded equals ours at the same context; (rows compared, rows skipped)."""
    compared = skipped = 0
    for t, record in recorded_contexts(oracle, records):
        ours, margins = oracle.drafts(t, len(record["tokens"]))
        for j, (theirs, mine, margin) in enumerate(zip(record["tokens"], ours, margins, strict=True)):
            if margin < MARGIN:
                skipped += 1
                continue
            assert theirs == mine, f"position {t} row {j}: vLLM drafted {theirs}, our head {mine} ({record})"
            compared += 1
    return compared, skipped


# ------------------------------------------------------------------------------- export (no vLLM)


def test_dart_export_writes_what_the_plugin_loads(fitted_dart, vllm_target_dir, tmp_path: Path) -> None:
    head_dir, _ = fitted_dart
    result = export_head(str(head_dir), tmp_path / "out", target=str(vllm_target_dir))
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert result.kind == "dart" and config["architectures"] == ["DartDraftModelEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["norm_before_residual"] is False
    assert config["mask_token_id"] == config["vocab_size"]  # outside the vocabulary: never a real token
    assert config["dart_draft_rows"] == ROWS and config["draft_vocab_size"] == 512
    assert not {"draft_length", "aux_layer_ids"} & set(config)
    saved = load_file(str(out / "model.safetensors"))
    original = load_file(str(head_dir / "model.safetensors"))
    assert set(saved) == {k.replace("midlayer.", "layers.0.") for k in original} | {"mask_hidden"}
    for key, tensor in original.items():
        assert torch.equal(saved[key.replace("midlayer.", "layers.0.")], tensor), key
    assert torch.equal(saved["mask_hidden"], torch.zeros(3 * 64))
    spec = json.loads((out / SPEC_CONFIG_FILE).read_text())
    # --draft-max-batch auto on a machine without CUDA: draft at up to the CPU-measured batch size only.
    assert spec == {"model": str(out.resolve()), "method": "eagle3", "num_speculative_tokens": ROWS,
                    "parallel_drafting": True,
                    "num_speculative_tokens_per_batch_size": draft_schedule(DART_CPU_DRAFT_MAX_BATCH, ROWS)}


def test_dart_export_orders_fc_by_layer_and_refuses_what_vllm_cannot_serve(
        vllm_target_dir, tmp_path: Path, capsys) -> None:
    from transformers import LlamaConfig

    config = DartDraftConfig.from_target_config(LlamaConfig.from_pretrained(vllm_target_dir), draft_length=3,
                                                aux_layer_ids=[5, 2, 4])
    head = DartDraftModel(config)
    head.save_pretrained(tmp_path / "head")
    export_head(str(tmp_path / "head"), tmp_path / "out", target=str(vllm_target_dir), num_speculative_tokens=2)
    # vLLM concatenates the captured layers in layer order: fc's blocks follow (ours: 5, 2, 4).
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    fc = load_file(str(tmp_path / "out" / "model.safetensors"))["fc.weight"]
    blocks = head.fc.weight.detach().split(64, dim=1)
    assert torch.equal(fc, torch.cat([blocks[1], blocks[2], blocks[0]], dim=1))
    capsys.readouterr()  # save_pretrained's progress bars
    for args, words in ((["--format", "sglang"], "vLLM only"), (["--num-speculative-tokens", "4"], "at most its 3")):
        with pytest.raises(SystemExit) as exit_info:
            export_main([str(tmp_path / "head"), "--out", str(tmp_path / "o"), "--target", str(vllm_target_dir), *args])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "o").exists()


def test_dart_export_records_the_trie_and_refuses_one_that_does_not_fit(
        fitted_dart, vllm_target_dir, smollm2_tokenizer, tmp_path: Path, capsys) -> None:
    """--ngram-model: config.json's dart_chain names the trie (not copied) and the chain search's settings
    (configs/tree/chain.yaml) with the target's EOS; a missing or mismatched trie is one line, nothing written."""
    from ngram_builder import NgramTrie

    head_dir, prompts = fitted_dart
    trie_path = reference_trie(prompts, smollm2_tokenizer, tmp_path / "ok.ngt")
    export_main([str(head_dir), "--out", str(tmp_path / "out"), "--target", str(vllm_target_dir),
                 "--ngram-model", str(trie_path)])
    assert "the trie-chosen chain" in capsys.readouterr().out
    chain = json.loads((tmp_path / "out" / "config.json").read_text())["dart_chain"]
    assert chain == {"ngram_model": str(trie_path.resolve()), "draft_top_k": 16, "beam_width": 4, "ngram_weight": 0.5,
                     "level_weight": None, "logit_weight": None, "ngram_on_first_level": False,
                     "eos_token_id": smollm2_tokenizer.eos_token_id}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors", SPEC_CONFIG_FILE]
    other = NgramTrie(order=3, vocab_size=len(smollm2_tokenizer))
    other.add_tokens(prompts[0])
    other.tokenizer_fingerprint = "another-tokenizer"
    other.save(tmp_path / "other.ngt")
    for trie, words in ((tmp_path / "nope.ngt", "no such trie"), (tmp_path / "other.ngt", "does not fit")):
        with pytest.raises(SystemExit) as exit_info:
            export_main([str(head_dir), "--out", str(tmp_path / "o"), "--target", str(vllm_target_dir),
                         "--ngram-model", str(trie)])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
        assert "--ngram-model" in err and words in err, err
    assert not (tmp_path / "o").exists()


def test_the_plugin_reaches_vllm_only_through_its_entry_point() -> None:
    """Declared for vLLM in both distributions; importing dart_infer (export included) never imports it."""
    import tomllib

    main = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    alone = tomllib.loads((ROOT / "scripts" / "vllm_plugin" / "pyproject.toml").read_text())["project"]["entry-points"]
    assert main["vllm.general_plugins"] == alone["vllm.general_plugins"] == {"dart": "dart_infer.engines.vllm.plugin:register"}
    code = ("import sys, dart_infer.engines.export, dart_infer.cli.export; "
            "print(sorted(m for m in sys.modules if m.startswith(('vllm', 'dart_infer.engines.vllm.plugin'))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


# ------------------------------------------------------------------------------------ inside vLLM


def vllm_env() -> dict[str, str]:
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.fail(f"no vLLM venv at {VLLM_VENV}: run `make vllm` (make test does)")
    env = {**os.environ, "VLLM_VENV": str(VLLM_VENV), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("OMP_NUM_THREADS", None)  # vLLM sizes its own threads (VLLM_CPU_OMP_THREADS_BIND)
    return env


def run_greedy_check(target: Path, export: Path, prompts: list[list[int]], tmp_path: Path, max_new: int) -> dict:
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    command = [str(ROOT / "scripts" / "vllm_env.sh"), "python", str(ROOT / "scripts" / "vllm_greedy_check.py"),
               "--target", str(target), "--speculative-config", str(export / SPEC_CONFIG_FILE),
               "--prompts", str(tmp_path / "prompts.json"), "--max-tokens", str(max_new), "--dtype", "float32",
               "--enforce-eager", "--record-drafts", "--out", str(tmp_path / "check.json")]
    run = subprocess.run(command, capture_output=True, text=True, env=vllm_env(), cwd=tmp_path, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return {**json.loads((tmp_path / "check.json").read_text()), "log": run.stdout + run.stderr}


def reference_trie(sequences: list[list[int]], tokenizer, path: Path) -> Path:
    """An order-3 trie of `sequences` (the target's greedy continuations) with the tokenizer's fingerprint."""
    from dart_infer.data.assets import tokenizer_fingerprint
    from ngram_builder import NgramTrie

    trie = NgramTrie(order=3, vocab_size=len(tokenizer))
    for seq in sequences:
        trie.add_tokens(seq)
    trie.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
    trie.save(path)
    return path


def compare_chains(oracle: Oracle, records: list[dict], trie, settings, eos: int | None) -> tuple[int, int]:
    """(drafts equal to our loop's trie chain at the same context, drafts compared)."""
    same = compared = 0
    for t, record in recorded_contexts(oracle, records):
        same += record["tokens"] == oracle.trie_chain(t, len(record["tokens"]), trie, settings, eos)
        compared += 1
    return same, compared


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_drafts_our_loops_trie_chain_losslessly(fitted_dart, vllm_target_dir, smollm2_tokenizer,
                                                     tmp_path: Path) -> None:
    """The export with a trie (--ngram-model): inside vLLM the plugin proposes our loop's tree=chain search
    on the same rows (trie included), greedy output stays vLLM plain's = transformers', and vLLM's
    per-position counters are our chain decoding's with those drafts."""
    from dart_infer.engines.vllm.plugin.chain import chain_settings
    from ngram_builder import NgramTrie

    head_dir, prompts = fitted_dart
    with one_thread():
        base = load_target(vllm_target_dir)
        references = [p + greedy(base, p, MAX_NEW + ROWS + 2) for p in prompts]
    trie_path = reference_trie(references, smollm2_tokenizer, tmp_path / "ref.ngt")
    export_main([str(head_dir), "--out", str(tmp_path / "export"), "--target", str(vllm_target_dir),
                 "--ngram-model", str(trie_path)])
    chain = json.loads((tmp_path / "export" / "config.json").read_text())["dart_chain"]
    assert chain["ngram_model"] == str(trie_path.resolve()) and chain["draft_top_k"] == 16
    check = run_greedy_check(vllm_target_dir, tmp_path / "export", prompts, tmp_path, MAX_NEW)
    assert "drafting the trie-chosen chain" in check["log"], check["log"][-3000:]
    # Lossless: greedy with the DART head = vLLM plain greedy (fp32) = transformers' greedy.
    assert check["spec"] == check["plain"] and check["identical"]
    assert check["plain"] == [r[len(p): len(p) + MAX_NEW] for p, r in zip(prompts, references, strict=True)]
    trie = NgramTrie.open(trie_path)
    settings = chain_settings(chain)
    eos = chain["eos_token_id"]
    with one_thread():
        head = DartDraftModel.from_pretrained(head_dir, dtype=torch.float32).eval()
        head.set_target_embedding(base.get_input_embeddings().weight)
        oracles = [Oracle(base, head, ref) for ref in references]
        # (b) every chain vLLM proposed is the one our loop's search picks on our head's rows
        same = compared = 0
        for oracle, records in zip(oracles, check["drafts"], strict=True):
            assert records, "no drafts recorded"
            done = compare_chains(oracle, records, trie, settings, eos)
            same, compared = same + done[0], compared + done[1]
        assert compared >= 20 and same >= compared - compared // 50, (same, compared)  # fp32 near-ties aside
        # ... so vLLM's acceptance counters are our chain decoding's, position by position, and the trie pays.
        per_position, argmax_position, steps = [0] * ROWS, [0] * ROWS, 0
        for oracle, prompt in zip(oracles, prompts, strict=True):
            counts, n = oracle.chain(len(prompt), ROWS, MAX_NEW,
                                     lambda t, k, o=oracle: o.trie_chain(t, k, trie, settings, eos))
            per_position, steps = [a + b for a, b in zip(per_position, counts, strict=True)], steps + n
            argmax_position = [a + b for a, b in zip(argmax_position, oracle.chain(len(prompt), ROWS, MAX_NEW)[0],
                                                     strict=True)]
    metrics = check["metrics"]
    assert metrics["num_drafts"] == steps and metrics["num_accepted_tokens_per_pos"] == per_position
    # Teeth: the random last row gains from the trie (the memorised rows 0..2 were accepted either way).
    assert per_position[ROWS - 1] > argmax_position[ROWS - 1], (per_position, argmax_position)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def spec_counter(metrics: str, name: str) -> float:
    """A counter of vLLM's Prometheus text (summed over its label sets)."""
    lines = [line for line in metrics.splitlines() if line.startswith(f"vllm:spec_decode_{name}_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


# The serve test's 4 concurrent chats (CHAT first: the memorised one) and their lengths: CHAT is the longest,
# so it ends alone, under the step-back bound, where it drafts again.
SERVE_CHATS = [CHAT, "Name three rivers in Europe.", "What is 17 times 3?", "Describe a cat in one sentence."]
SERVE_TOKENS = [32, 12, 16, 20]
SERVE_MAX_BATCH = 2  # draft at up to 2 concurrent requests: the 4 cross it both ways


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serve_streams_the_dart_heads_chat_losslessly(fitted_dart, vllm_target_dir, smollm2_tokenizer,
                                                          tmp_path: Path) -> None:
    """One `vllm serve` with the step-back schedule, 4 concurrent streamed chats: each one = greedy plain."""
    head_dir, prompts = fitted_dart
    export_main([str(head_dir), "--out", str(tmp_path / "export"), "--target", str(vllm_target_dir),
                 "--draft-max-batch", str(SERVE_MAX_BATCH)])
    spec_text = (tmp_path / "export" / SPEC_CONFIG_FILE).read_text()
    assert json.loads(spec_text)["num_speculative_tokens_per_batch_size"] == [
        [1, SERVE_MAX_BATCH, ROWS], [SERVE_MAX_BATCH + 1, 1 << 20, 0]]
    port, env, wrapper = free_port(), vllm_env(), str(ROOT / "scripts" / "vllm_env.sh")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # served as users serve: engine-core and worker processes
    # What a user runs: vllm serve <target> --speculative-config "$(cat <export>/vllm_speculative_config.json)"
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [wrapper, "vllm", "serve", str(vllm_target_dir), "--speculative-config", spec_text, "--dtype", "float32",
         "--enforce-eager", "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while http_get(f"http://127.0.0.1:{port}/health") is None:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-6000:]
            time.sleep(1)
        messages = [arg for chat in SERVE_CHATS for arg in ("--message", chat)]
        chat = subprocess.run([wrapper, "python", str(ROOT / "scripts" / "vllm_chat_check.py"), "--base-url",
                               f"http://127.0.0.1:{port}/v1", *messages, "--max-tokens", *map(str, SERVE_TOKENS),
                               "--out", str(tmp_path / "chat.json")],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
        assert chat.returncode == 0, (chat.stdout + chat.stderr)[-4000:]
        metrics = http_get(f"http://127.0.0.1:{port}/metrics") or ""
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # its own session: the engine processes it started
            server.wait()
        log.close()
    assert "drafting the argmax chain" in (tmp_path / "server.log").read_text()  # no trie: said in one line
    results = json.loads((tmp_path / "chat.json").read_text())["requests"]
    assert results[0]["prompt_token_ids"] == prompts[-1]  # the server rendered the chat template as we did
    with one_thread():
        base = load_target(vllm_target_dir)
        for message, new, result in zip(SERVE_CHATS, SERVE_TOKENS, results, strict=True):
            ids = list(smollm2_tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                             add_generation_prompt=True, tokenize=True,
                                                             return_dict=True)["input_ids"])
            assert result["prompt_token_ids"] == ids and result["chunks"] > 2  # rendered as ours; streamed
            plain = greedy(base, ids, new)
            assert result["token_ids"] == plain, message
            # The streamed text, but for a last character whose bytes were cut (the stream holds them back).
            assert result["text"] == smollm2_tokenizer.decode(plain, skip_special_tokens=True).removesuffix("\ufffd")
    # The DART head drafted, and its drafts were accepted, behind the server (CHAT's tail, at <= 2 requests).
    drafts, accepted = spec_counter(metrics, "num_drafts"), spec_counter(metrics, "num_accepted_tokens")
    assert drafts > 0 and accepted > 0, metrics[-3000:]
    # Step-back: a decode step that verifies drafts counts one draft and emits 1 + its accepted tokens, one that
    # does not (k = 0 above the bound) emits 1. Drafting at every step leaves no token for the second kind.
    undrafted = sum(n - 1 for n in SERVE_TOKENS) - drafts - accepted
    assert undrafted > 0, (drafts, accepted)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_drafts_what_the_shipped_head_drafts_on_smollm2(smollm2_dir, smollm2_tokenizer, tmp_path: Path) -> None:
    """The real thing: the shipped head (bf16, served in fp32) on SmolLM2-135M-Instruct."""
    from transformers import AutoModelForCausalLM

    from dart_infer.methods.loading import load_draft_model

    export_main(["dart-smollm2-135m-instruct", "--out", str(tmp_path / "export")])
    prompts = [smollm2_tokenizer("def fibonacci(n):").input_ids, chat_ids(smollm2_tokenizer)]
    check = run_greedy_check(Path(smollm2_dir), tmp_path / "export", prompts, tmp_path, 24)
    assert check["identical"]
    with one_thread():
        base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        head = load_draft_model("dart-smollm2-135m-instruct", dtype=torch.float32).eval()
        head.set_target_embedding(base.get_input_embeddings().weight)
        compared = skipped = 0
        for prompt, out, records in zip(prompts, check["spec"], check["drafts"], strict=True):
            done = compare_drafts(Oracle(base, head, prompt + out), records)
            compared, skipped = compared + done[0], skipped + done[1]
    assert compared >= 8 * 20 and skipped <= compared // 50, (compared, skipped)
    assert check["metrics"]["num_accepted_tokens"] > 0
