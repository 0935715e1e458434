"""dart-app in a real browser: the console script serves the page on a local port and headless
Chromium (Debian's chromium + chromedriver, driven by Selenium) uses it like a person would.

The model is a tiny random Llama with SmolLM2's tokenizer, a random head and a trie of the tiny
model's own greedy continuations (so drafts get accepted), served in float32, where greedy DART must
give exactly plain decoding's answer.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama

from dart_infer import DartDraftConfig, DartDraftModel, DartModel
from dart_infer.data.assets import tokenizer_fingerprint
from dart_infer.data.conversations import chat_prompt
from dart_infer.decoding.stats import StepOutput
from dart_infer.methods.eagle3 import Eagle3DraftConfig, Eagle3DraftModel
from ngram_builder import NgramTrie

DRAFT_VOCAB = 96
VOCAB = 49152  # SmolLM2's tokenizer renders the chat template, so the tiny target shares its vocabulary
PROMPTS = ["Explain speculative decoding in one sentence.", "Write a haiku about trees."]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
READOUT = re.compile(r"([\d.]+) tokens/s · τ ([\d.]+) tokens/step \(([\d.]+) accepted drafts \+ ([\d.]+) from the "
                     r"target\) · (\d+) tokens = (\d+) from the prompt's forward \+ (\d+) in (\d+) verification steps")


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"console script {name} is not installed (pip install -e .)"
    return found


@pytest.fixture(scope="module")
def tiny_files(smollm2_tokenizer, tmp_path_factory) -> dict[str, Path]:
    base = tiny_llama(0, vocab_size=VOCAB, head_dim=8, max_position_embeddings=4096, initializer_range=0.3,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa")
    config = base.config
    # As in test_generate's SmolLM2 test: the random head drafts over the tokens the tiny model emits
    # and the trie (its own greedy continuations) ranks them, so drafts do get accepted.
    trie = NgramTrie(order=3, vocab_size=VOCAB)
    emitted: set[int] = set()
    for text in PROMPTS:
        ids = chat_prompt(smollm2_tokenizer, [{"role": "user", "content": text}])
        out = base.generate(ids[None], do_sample=False, max_new_tokens=40, pad_token_id=2)
        trie.add_tokens(out[0].tolist() + [2])
        emitted.update(out[0, ids.numel():].tolist())
    assert len(emitted) <= DRAFT_VOCAB
    padding = [t for t in range(3, VOCAB) if t not in emitted][: DRAFT_VOCAB - len(emitted)]
    draft_vocab = sorted(emitted.union(padding))
    head = DartDraftModel(
        DartDraftConfig.from_target_config(config, draft_length=4, draft_vocab_size=DRAFT_VOCAB)
    ).eval()
    head.set_vocab_mapping(torch.tensor(draft_vocab))
    trie.tokenizer_fingerprint = tokenizer_fingerprint(smollm2_tokenizer)
    root = tmp_path_factory.mktemp("tiny_app")
    base.save_pretrained(root / "base")
    smollm2_tokenizer.save_pretrained(root / "base")
    head.save_pretrained(root / "head")
    Eagle3DraftModel(Eagle3DraftConfig.from_target_config(config, draft_vocab_size=4096)).save_pretrained(root / "eagle3")
    trie.save(root / "tiny.trie")
    return {"root": root, "base": root / "base", "head": root / "head", "trie": root / "tiny.trie",
            "eagle3": root / "eagle3"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(overrides: list[str], run_dir: Path, timeout: float = 120) -> Iterator[str]:
    """`dart-app <overrides>` on a free local port; yields its URL once the page answers."""
    port = _free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "app.log"
    command = [_script("dart-app"), *overrides, f"port={port}", f"hydra.run.dir={run_dir}"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                pytest.fail(f"dart-app exited with {server.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"dart-app did not serve {url} within {timeout} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def app_url(tiny_files) -> Iterator[str]:
    overrides = [
        "model=custom", f"model.name_or_path={tiny_files['base']}", f"draft_model={tiny_files['head']}",
        f"ngram_model={tiny_files['trie']}", f"eagle3_model={tiny_files['eagle3']}", "serve_dtype=float32",
        f"tree.draft_top_k={DRAFT_VOCAB}", "tree.beam_width=4", "tree.remain_total=8", "tree.ngram_weight=2.0",
        "++tree.ngram_on_first_level=true", "max_new_tokens=32", "concurrency=4", "max_length=4096",
        "updates_per_second=4",
    ]
    with serving(overrides, tiny_files["root"] / "run") as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        assert Path(path).exists(), f"{path} is missing: `make venv` installs Debian's chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# ------------------------------------------------------------------------------------ page helpers


def _open(driver, url: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#send"))


def _text(driver, selector: str) -> str:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return found[0].get_attribute("textContent") if found else ""


def _wait_text(driver, selector: str, pattern: str, timeout: float = 60) -> str:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: re.search(pattern, _text(d, selector)))
    except TimeoutException:
        seen = {s: _text(driver, s) for s in ("#notices", "#chat-status", "#chat-stats", "#sbs-status")}
        raise AssertionError(f"{selector} never matched {pattern!r} in {timeout} s; the page shows {seen}") from None
    return _text(driver, selector)


def _type(driver, selector: str, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.CSS_SELECTOR, f"{selector} textarea, {selector} input")
    box.clear()
    box.send_keys(text)


def _click(driver, selector: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, selector).click()


def _tab(driver, name: str) -> None:
    from selenium.webdriver.common.by import By

    buttons = [b for b in driver.find_elements(By.CSS_SELECTOR, "button[role='tab']") if b.text.strip() == name]
    assert buttons, f"no tab named {name!r}"
    buttons[0].click()


def _readout(text: str) -> dict[str, float]:
    match = READOUT.search(text)
    assert match, f"no tokens/s · τ readout in {text!r}"
    tps, tau, accepted, target, tokens, prefill, emitted, steps = match.groups()
    out = {"tps": float(tps), "tau": float(tau), "accepted": float(accepted), "target": float(target),
           "tokens": int(tokens), "prefill": int(prefill), "emitted": int(emitted), "steps": int(steps)}
    _check_parts_add_up(out, text)
    return out


def _check_parts_add_up(readout: dict[str, float], text: str) -> None:
    """The readout's numbers agree on their face: τ = emitted / steps = drafts/step + target/step (as
    printed, in hundredths) and tokens = the prompt forward's + the steps'."""
    cents = {k: round(readout[k] * 100) for k in ("tau", "accepted", "target")}
    assert cents["tau"] == cents["accepted"] + cents["target"], text
    assert readout["tokens"] == readout["prefill"] + readout["emitted"], text
    if readout["steps"]:
        assert cents["tau"] == round(readout["emitted"] / readout["steps"] * 100), text


def _expected_answer(tiny_files, prompt: str, max_new: int) -> str:
    model = DartModel.from_pretrained(str(tiny_files["base"]), str(tiny_files["head"]), dtype="float32")
    ids = chat_prompt(model.tokenizer, [{"role": "user", "content": prompt}])
    out = model.base_model.generate(ids[None], do_sample=False, max_new_tokens=max_new, pad_token_id=2)
    return model.tokenizer.decode(out[0, ids.numel():], skip_special_tokens=True)


# -------------------------------------------------------------------------------------------- tests


def test_side_by_side_dart_and_plain_decoding_give_the_same_answer(app_url, browser, tiny_files) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, app_url)
    _tab(browser, "Side by side")
    _type(browser, "#sbs-prompt", PROMPTS[0])
    _click(browser, "#sbs-run")
    _wait_text(browser, "#sbs-status", r"done: DART then AR")
    left, right = _text(browser, "#sbs-a-out .answer"), _text(browser, "#sbs-b-out .answer")
    assert left and left == right  # greedy, float32: lossless
    # ... and both are the base model's own greedy answer (transformers' generate).
    assert left == _expected_answer(tiny_files, PROMPTS[0], 32)
    dart = _readout(_text(browser, "#sbs-a-out .stats"))
    plain = _readout(_text(browser, "#sbs-b-out .stats"))
    assert dart["tokens"] == plain["tokens"] == 32 and dart["tps"] > 0 and plain["tps"] > 0
    assert plain["tau"] == 1.0 and plain["accepted"] == 0.0
    assert dart["tau"] > 1.0 and dart["steps"] < plain["steps"]  # the trie holds this answer: drafts accepted
    bars = browser.find_elements(By.CSS_SELECTOR, "#sbs-a-out .step-bar")
    assert len(bars) == dart["steps"]
    accepted = [int(b.get_attribute("data-accepted")) for b in bars]
    assert sum(accepted) > 0 and sum(accepted) == round(dart["accepted"] * dart["steps"])
    assert browser.find_elements(By.CSS_SELECTOR, "#sbs-a-out .answer .drafted")  # drafted tokens coloured
    assert not browser.find_elements(By.CSS_SELECTOR, "#sbs-b-out .answer .drafted")


def test_chat_switches_methods_regenerates_and_clears(app_url, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _open(browser, app_url)
    _type(browser, "#prompt", PROMPTS[1])
    _click(browser, "#send")
    _wait_text(browser, "#chat-status", r"DART: done")
    stats = _readout(_text(browser, "#chat-stats"))
    assert stats["tokens"] == 32 and stats["tps"] > 0 and stats["tau"] > 1.0
    assert PROMPTS[1] in _text(browser, "#chat")
    dart_answer = _text(browser, "#chat .drafted")  # the answer's accepted drafts, coloured
    assert dart_answer
    bot = browser.find_elements(By.CSS_SELECTOR, "#chat .answer")[-1].get_attribute("textContent")
    assert bot
    choices = [el.text.strip() for el in browser.find_elements(By.CSS_SELECTOR, "#method label")]
    assert choices == ["DART", "AR (plain)", "EAGLE-3"]
    # The plain baseline and EAGLE-3 on the same conversation: Regenerate with the radio on each.
    for choice in ("AR (plain)", "EAGLE-3"):
        browser.find_elements(By.CSS_SELECTOR, "#method label")[choices.index(choice)].click()
        _click(browser, "#regenerate")
        _wait_text(browser, "#chat-status", re.escape(choice) + ": done")
        stats = _readout(_text(browser, "#chat-stats"))
        assert stats["tokens"] == 32 and (stats["tau"] == 1.0 if choice.startswith("AR") else stats["tau"] >= 1.0)
        answers = browser.find_elements(By.CSS_SELECTOR, "#chat .answer")
        assert len(answers) == 1 and answers[0].get_attribute("textContent") == bot, choice  # replaced, same text
    # A second turn: the conversation so far is the prompt, the first answer stays as it was.
    _type(browser, "#prompt", "And in French?")
    _click(browser, "#send")
    # The status still reads "EAGLE-3: done" from the Regenerate until the new turn's first update,
    # which also adds its answer: wait for both.
    WebDriverWait(browser, 60, poll_frequency=0.1).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chat .answer")) == 2
        and re.search("EAGLE-3: done", _text(d, "#chat-status")))
    answers = browser.find_elements(By.CSS_SELECTOR, "#chat .answer")
    assert answers[0].get_attribute("textContent") == bot and "And in French?" in _text(browser, "#chat")
    _click(browser, "#clear")
    _wait_text(browser, "#chat-stats", r"tokens/s –")
    assert not browser.find_elements(By.CSS_SELECTOR, "#chat .answer") and PROMPTS[1] not in _text(browser, "#chat")
    # Clear while an answer streams: the page ends cleared, whatever order the updates arrive in.
    _type(browser, "#prompt", PROMPTS[1])
    _click(browser, "#send")
    WebDriverWait(browser, 60, poll_frequency=0.02).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chat .answer"))
    _click(browser, "#clear")
    time.sleep(2.0)  # longer than the tiny model's 32 tokens: any late update has landed
    assert re.search(r"tokens/s –", _text(browser, "#chat-stats")), _text(browser, "#chat-stats")
    assert not browser.find_elements(By.CSS_SELECTOR, "#chat .answer")


def test_bad_settings_are_named_and_stop_really_stops(app_url, browser) -> None:
    _open(browser, app_url)
    _type(browser, "#top-k", "-3")
    _type(browser, "#prompt", "Hello")
    _click(browser, "#send")
    assert "top-k must be >= 0" in _wait_text(browser, "#chat-status", "top-k")
    _type(browser, "#top-k", "0")
    # A long answer: while it streams, another request (the side-by-side view) is served meanwhile.
    _type(browser, "#max-new-tokens", "1500")
    _click(browser, "#send")
    _wait_text(browser, "#chat-stats", r"generating")
    _type(browser, "#max-new-tokens", "8")  # for the next request; the running one read 1500 when it started
    _tab(browser, "Side by side")
    _type(browser, "#sbs-prompt", PROMPTS[0])
    _click(browser, "#sbs-run")
    _wait_text(browser, "#sbs-status", r"done: DART then AR")
    assert _readout(_text(browser, "#sbs-b-out .stats"))["tokens"] == 8
    _tab(browser, "Chat")
    assert "generating" in _text(browser, "#chat-stats")  # the long answer was still going
    _click(browser, "#stop")
    _wait_text(browser, "#chat-status", "DART: stopped")
    time.sleep(1.0)
    first = _readout(_text(browser, "#chat-stats"))
    time.sleep(1.5)
    second = _readout(_text(browser, "#chat-stats"))
    assert first == second and second["tokens"] < 1500  # nothing arrives after Stop
    assert "stopped" in _text(browser, "#chat-stats")


def test_what_cannot_be_loaded_is_said_on_the_page_and_the_rest_serves(tiny_files, tmp_path) -> None:
    from hydra import compose, initialize_config_dir

    from dart_infer.app import AR, DART, DART_NO_TRIE, EAGLE3
    from dart_infer.app.ui import build_ui
    from dart_infer.cli.app import build_engine
    from dart_infer.common.configs import configs_dir

    def engine(*overrides: str):
        with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
            cfg = compose("app", overrides=[
                "model=custom", f"model.name_or_path={tiny_files['base']}", "serve_dtype=float32",
                f"default_ngram_model={tmp_path / 'none.ngt'}", *overrides,
            ])
        return build_engine(cfg)

    no_head = engine(f"draft_model={tmp_path / 'missing-head'}", f"eagle3_model={tiny_files['head']}")
    assert no_head.method_names == [AR]  # a DART head is not an EAGLE-3 head: named, not listed
    notes = "\n".join(no_head.notices)
    assert f"draft_model={tmp_path / 'missing-head'} could not be loaded" in notes and "plain decoding only" in notes
    assert "EAGLE-3 is off" in notes
    notices = next(b for b in build_ui(no_head).blocks.values() if getattr(b, "elem_id", None) == "notices")
    assert "could not be loaded" in notices.value and notices.visible
    none = engine("draft_model=null")
    assert none.method_names == [AR] and "No DART head given" in none.notices[0]

    no_trie = engine(f"draft_model={tiny_files['head']}", f"eagle3_model={tiny_files['eagle3']}")
    assert no_trie.method_names == [DART_NO_TRIE, AR, EAGLE3]
    assert any(f"ngram_model=auto: the default trie {tmp_path / 'none.ngt'} does not exist" in n for n in no_trie.notices)
    missing = engine(f"draft_model={tiny_files['head']}", f"ngram_model={tmp_path / 'gone.ngt'}")
    assert missing.method_names == [DART_NO_TRIE, AR] and "no such trie" in missing.notices[0]
    with_trie = engine(f"draft_model={tiny_files['head']}", f"ngram_model={tiny_files['trie']}")
    assert with_trie.method_names == [DART, AR] and not with_trie.notices
    # Sampling settings reach the decoding loop: the same seed draws the same answer, another seed another.
    from dart_infer.app import Decoding

    def sampled(seed: int) -> list[int]:
        settings = Decoding(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=16, seed=seed)
        *_, answer = with_trie.stream(DART, [{"role": "user", "content": PROMPTS[0]}], settings)
        assert answer.finished and len(answer.tokens) == 16
        return answer.tokens

    assert sampled(1) == sampled(1) != sampled(2)

    # Bad settings name the control; the engine refuses them before decoding.
    for controls, message in [((0, 1.5, 0, 8, 16), "top-p must be in [0, 1]"), ((-1, 0, 0, 8, 16), "temperature"),
                              (("inf", 0, 0, 8, 16), "temperature must be a finite number >= 0 (0 = greedy), got inf"),
                              ((0, 0, 2.5, 8, 16), "top-k must be a whole number"), ((0, 0, 0, 0, 16), "tree size"),
                              ((0, 0, 0, 8, None), "max new tokens is empty")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            Decoding.from_controls(*controls)


def test_a_port_in_use_is_refused_in_one_line_before_the_models_load(tmp_path) -> None:
    from dart_infer.cli.app import check_port_free
    from dart_infer.common.errors import EXIT_BAD_INPUT, InputError, report

    with socket.socket() as taken:  # another server on a free port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        expected = f"port={port}: 127.0.0.1:{port} is already in use; pass port=<a free port>"
        for host in ("127.0.0.1", "0.0.0.0"):  # Gradio checks 127.0.0.1 whatever the host
            with pytest.raises(InputError) as raised:
                check_port_free(host, port)
            assert str(raised.value) == expected.replace("127.0.0.1:", f"{host}:")
        assert report(raised.value, "dart-app") == EXIT_BAD_INPUT
        # The command: one line, exit 2, before the models load (it never gets to serve).
        result = subprocess.run([_script("dart-app"), f"port={port}", "draft_model=null", "serve_dtype=float32",
                                 f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr.splitlines() == [f"dart-app: error: {expected}"]
    assert "serving on" not in result.stdout and "Traceback" not in result.stdout + result.stderr
    check_port_free("127.0.0.1", port)  # closed: free again
    with pytest.raises(InputError, match=r"port=70000: must be in \[1, 65535\]"):
        check_port_free("127.0.0.1", 70000)
    with pytest.raises(InputError, match="host=203.0.113.7: 203.0.113.7 is not an address of this machine"):
        check_port_free("203.0.113.7", port)


def _fake_engine(steps: list[StepOutput]):
    """An Engine whose one method yields `steps` (the first is the prompt forward's token): the stream
    loop and the readout without a model."""
    from types import SimpleNamespace

    from dart_infer.app import Engine

    engine = Engine(SimpleNamespace(tokenizer=None, draft_depth=4, method=None))
    engine.prompt_ids = lambda messages: torch.tensor([1, 2, 3])
    engine.methods["fake"] = lambda ids, d, generator: iter(steps)
    return engine


def test_the_readout_and_bars_count_what_was_kept_and_add_up() -> None:
    from dart_infer.app import Decoding
    from dart_infer.app.engine import stats_line, steps_html

    # The probe's answer: 6 steps of 1 accepted draft + the target's token, then a last step whose
    # accepted draft the 14-token budget keeps without the target's token. It read "τ 1.86 ·
    # accepted/step 1.00 · 14 tokens in 7 steps".
    steps = [StepOutput([10], 0, 0, False)]
    steps += [StepOutput([11 + 2 * i, 12 + 2 * i], 1, 4, False) for i in range(6)]
    steps.append(StepOutput([30], 1, 4, True))
    *_, answer = _fake_engine(steps).stream("fake", [], Decoding(max_new_tokens=14))
    assert answer.finished and len(answer.tokens) == 14
    assert (answer.accept_lengths, answer.emitted) == ([1] * 7, [2] * 6 + [1])
    line = stats_line(answer)
    assert ("τ 1.86 tokens/step (1.00 accepted drafts + 0.86 from the target) · 14 tokens = "
            "1 from the prompt's forward + 13 in 7 verification steps") in line
    _readout(line)  # the parts add up
    # A budget cut inside the accepted drafts: 3 accepted, only 2 emitted, so 2 are counted.
    steps = [StepOutput([10], 0, 0, False), StepOutput([11, 12, 13, 14], 3, 6, False),
             StepOutput([15], 0, 6, False), StepOutput([16, 17], 3, 6, True)]
    *_, answer = _fake_engine(steps).stream("fake", [], Decoding(max_new_tokens=8))
    assert (answer.accept_lengths, answer.emitted) == ([3, 0, 2], [4, 1, 2])
    assert (answer.prefill_tokens, answer.drafted_tokens, answer.target_tokens) == (1, 5, 2)
    readout = _readout(stats_line(answer))
    assert (readout["tau"], readout["accepted"], readout["target"]) == (2.33, 1.67, 0.66)  # 7/3 = 5/3 + 2/3
    assert (readout["tokens"], readout["prefill"], readout["emitted"], readout["steps"]) == (8, 1, 7, 3)
    bars = steps_html(answer, 4)
    assert re.findall(r'data-accepted="(\d+)" data-emitted="(\d+)"', bars) == [("3", "4"), ("0", "1"), ("2", "2")]
    assert "3 verification steps, 5 drafts in all" in bars
    # The drafted tokens are highlighted: exactly the kept drafts.
    assert [text for text, drafted in answer.segments if drafted] == ["[11][12][13]", "[16][17]"]


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_side_by_side_dart_equals_plain_decoding(browser, smollm2_dir, tmp_path) -> None:
    """The real SmolLM2 and chat template behind the page, in float32: DART's answer is plain
    decoding's. The head is random over the 64 most common ShareGPT tokens and the trie is the
    default one when built (else DART runs without one), so τ is not the point here."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    head = DartDraftModel(DartDraftConfig.from_target_config(config, draft_length=4, draft_vocab_size=64)).eval()
    head.set_vocab_mapping(torch.arange(64))
    head.save_pretrained(tmp_path / "head")
    # The fixed fp32 tree: tree=auto would first time a tree per size on SmolLM2 (~35 s; test_fitted_tree tests it).
    overrides = [f"draft_model={tmp_path / 'head'}", "serve_dtype=float32", "tree=cpu-fp32", "max_new_tokens=24"]
    with serving(overrides, tmp_path / "run", timeout=300) as url:
        _open(browser, url)
        _tab(browser, "Side by side")
        _type(browser, "#sbs-prompt", "Name three primary colors.")
        _click(browser, "#sbs-run")
        _wait_text(browser, "#sbs-status", r"done: DART.* then AR", timeout=300)
        left, right = _text(browser, "#sbs-a-out .answer"), _text(browser, "#sbs-b-out .answer")
        assert len(left) > 20 and left == right
        dart, plain = (_readout(_text(browser, f"#sbs-{side}-out .stats")) for side in "ab")
        assert dart["tokens"] == plain["tokens"] <= 24 and dart["tps"] > 0 and plain["tps"] > 0
