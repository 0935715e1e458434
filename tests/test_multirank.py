"""Two CPU ranks (gloo) through the documented launchers (`torchrun -m dart_train.cli`, `deepspeed
$(which dart-train)`), on a tiny random Llama with the real SmolLM2 tokenizer:

(a) 2 ranks x micro-batch b train the weights of 1 rank x grad_accum 2 on the same global batches;
(c) a 2-rank run killed after a checkpoint resumes exactly (every rank restores its own state);
(d) offline states and regeneration with 2 ranks produce every row exactly once.
Both ranks share one core here: the runs are kept to a few steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import save_tiny_checkpoint
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
CONVERSATIONS = [
    {"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Count from {i} to {i + 5}, please."},
        {"role": "assistant", "content": " ".join(str(k) for k in range(i, i + 6)) + ". Done counting!"},
    ]}
    for i in range(16)
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_tokenizer) -> tuple[Path, Path]:
    """(a tiny random Llama saved like a Hub model, a JSONL of 16 conversations)."""
    root = tmp_path_factory.mktemp("multirank")
    save_tiny_checkpoint(root / "model", smollm2_tokenizer)
    data = root / "chats.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS) + "\n")
    return root / "model", data


def overrides(tiny: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    model, data = tiny
    return [
        "model=custom", f"model.name_or_path={model}", "data=jsonl", f"data.source={data}",
        "trainer=cpu", "trainer.pack_length=null", "trainer.batch_size=2", "trainer.max_tokens=null",
        "trainer.max_steps=4", "trainer.save_every=2", "trainer.keep_last=2", "trainer.max_anchors=8",
        # AdamW's eps above the gradients' rounding noise: updates compare across summation orders.
        "optim.lr=1e-3", "optim.eps=1e-6", "optim.warmup_steps=1",
        "preprocess.max_length=96", "draft.draft_length=4", "draft.draft_vocab_size=512", "train_eval=off",
        "logging.wandb.enabled=false", "logging.progress=false", "logging.log_every=1",
        f"output_dir={out}", f"output_root={out.parent / (out.name + '-artifacts')}", *extra,
    ]


def launch(args: list[str], cwd: Path, ranks: int, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    dist_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    hydra = [f"hydra.run.dir={cwd / 'hydra'}"]
    if ranks == 1:
        command = [sys.executable, "-c", "from dart_train.cli import main; main()", *args, *hydra]
    elif launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}", "-m", "dart_train.cli",
                   *args, *hydra]
    else:  # the DeepSpeed launcher (CPU accelerator: one process per "GPU" slot)
        command = [str(BIN / "deepspeed"), f"--num_gpus={ranks}", f"--master_port={_free_port()}",
                   str(BIN / "dart-train"), *args, *hydra]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def head(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "head" / "model.safetensors"))


def shard_records(cache_root: Path) -> list[dict]:
    (manifest,) = cache_root.rglob("manifest.json")
    return sorted((json.loads(p.read_text()) for p in manifest.parent.glob("shard-*.json")), key=lambda r: r["shard"])


def test_two_ranks_equal_one_rank_with_grad_accum_and_share_one_offline_cache(tiny, tmp_path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    first = launch(overrides(tiny, one, "trainer.grad_accum=2", "states=offline", "states.shard_size=3"), tmp_path, 1)
    assert first.returncode == 0, first.stderr[-4000:]
    second = launch(overrides(tiny, two, "trainer.grad_accum=1", "states=offline", "states.shard_size=3"), tmp_path, 2)
    assert second.returncode == 0, second.stderr[-4000:]
    # (a) the same global batches give the same weights (float tolerance: gradients are summed in
    # another order) and the same logged numbers (every rank's share is reduced into the metrics).
    a, b = head(one), head(two)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=2e-6, msg=key)
    ra, rb = rows(one), rows(two)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2, 3, 4]
    for x, y in zip(ra, rb, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["tokens"] == x["tokens"]
        assert y["alpha_1"] == pytest.approx(x["alpha_1"], abs=1e-6)
    # (d) the offline cache: both ranks wrote disjoint shards covering every sequence once, and
    # byte-identical to the single process's shards.
    ones, twos = shard_records(one.parent / "one-artifacts"), shard_records(two.parent / "two-artifacts")
    assert [(r["first"], r["last"]) for r in twos] == [(r["first"], r["last"]) for r in ones]
    covered = [i for r in twos for i in range(r["first"], r["last"])]
    assert covered == list(range(len(covered))) and len(covered) == len(CONVERSATIONS)
    assert [r["sha256"] for r in twos] == [r["sha256"] for r in ones]


def test_two_rank_kill_and_resume_is_exact(tiny, tmp_path) -> None:
    reference = tmp_path / "reference"
    result = launch(overrides(tiny, reference), tmp_path, 2)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        assert (reference / "checkpoints" / "step_00000002" / f"rank_state_{rank:05d}.pt").is_file()
    # The state of a run killed during step 4, after the step-2 checkpoint and step 3's metrics line.
    killed = tmp_path / "killed"
    shutil.copytree(reference, killed)
    for extra in ("head", "summary.json"):
        (killed / extra).unlink() if (killed / extra).is_file() else shutil.rmtree(killed / extra)
    shutil.rmtree(killed / "checkpoints" / "step_00000004")
    (killed / "checkpoints" / "latest").write_text("step_00000002")
    lines = (killed / "metrics.jsonl").read_text().splitlines(keepends=True)
    (killed / "metrics.jsonl").write_text("".join(lines[:3]))
    # One rank cannot continue what two wrote: refused, with how.
    alone = launch([f"output_dir={killed}", "resume=true"], tmp_path, 1)
    assert alone.returncode != 0 and "Launch 2 rank(s) to resume it" in alone.stderr
    resumed = launch([f"output_dir={killed}", "resume=true"], tmp_path, 2, launcher="deepspeed")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    def timeless(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows(run)]

    assert timeless(killed) == timeless(reference)  # steps 1-4 once each, the same losses and LRs
    (dropped,) = killed.glob("metrics.dropped-00000002-*.jsonl")
    assert [json.loads(line)["step"] for line in dropped.read_text().splitlines()] == [3]
    a, b = head(reference), head(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_rank_regeneration_writes_every_row_once(tiny, tmp_path) -> None:
    out = tmp_path / "regen.jsonl"
    args = overrides(tiny, tmp_path / "run", "preprocess.regenerate.enabled=true", "preprocess.regenerate.stop_after=true",
                     "preprocess.regenerate.max_new_tokens=3", "preprocess.regenerate.max_turns=1",
                     "preprocess.regenerate.batch_size=3", f"preprocess.regenerate.output={out}")
    result = launch(args, tmp_path, 2)
    assert result.returncode == 0, result.stderr[-4000:]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(c["id"] for c in CONVERSATIONS)  # each exactly once
    assert not list(tmp_path.glob("regen.jsonl.part-*"))
    # Run again (resume=auto: the directory holds that run now): everything is done, nothing is appended.
    before = out.read_text()
    again = launch([*args, "resume=auto"], tmp_path, 2)
    assert again.returncode == 0, again.stderr[-4000:]
    assert out.read_text() == before
