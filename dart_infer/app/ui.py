"""The `dart-app` page (Gradio Blocks) over an `Engine`.

- Chat: a radio picks the method (DART, plain AR, EAGLE-3 when loaded) on the same base model;
  temperature / top-p / top-k / tree size / max new tokens; Send, Regenerate, Stop, Clear; a live
  tokens/s and τ readout; accepted draft tokens in colour; a bar per verification step.
- Side by side: one prompt through two methods, one after the other, each with its readout and bars.

Generation handlers are generators that yield after every decoding step, so Gradio's queue runs
several requests at once (`concurrency`) interleaved step by step, and Stop cancels a request
between two steps.
"""

from __future__ import annotations

import html
import os
from collections.abc import Iterator
from typing import Any

from dart_infer.app.engine import AR, Answer, Decoding, Engine, panel_html, stats_html, steps_html, throttle

__all__ = ["CSS", "build_ui"]

CSS = """
.drafted { background: #b7ebc6; color: #064e1f; border-radius: 3px; }
.answer { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.9em; min-height: 2em; }
.stats { font-weight: 600; margin: 4px 0; }
.step-bars { display: flex; align-items: flex-end; gap: 1px; height: 64px; overflow-x: auto;
             border-bottom: 1px solid #999; }
.step-bar { flex: 0 0 5px; background: #2f855a; }
.step-bar[data-accepted="0"] { background: #cbd5e0; }
.steps-caption { font-size: 0.85em; color: #555; margin-top: 6px; }
.panel-method { font-size: 1.1em; font-weight: 700; }
#notices { color: #9c4221; }
"""

ERROR = "⚠ "


def _status(text: str) -> str:
    return f'<div class="status">{html.escape(text)}</div>'


def _chat_view(history: list[dict[str, str]], answer: Answer | None) -> list[dict[str, str]]:
    """The chatbot's messages as HTML (escaped text): the newest answer with its drafted tokens coloured."""
    from dart_infer.app.engine import tokens_html

    view = []
    for m in history:
        text = html.escape(m["content"])
        view.append({"role": m["role"], "content": f'<div class="answer">{text}</div>' if m["role"] == "assistant" else text})
    if answer is not None and view and view[-1]["role"] == "assistant":
        view[-1]["content"] = tokens_html(answer)
    return view


class RunFlag:
    """One session's generations in one view: which is current, and whether Stop was pressed for it.
    Stored in a `gr.State`, so a Stop event and the running generator see the same object."""

    def __init__(self) -> None:
        self.current = 0
        self.stopped = -1
        self.running: set[int] = set()

    def __deepcopy__(self, memo: dict[int, Any]) -> RunFlag:
        return RunFlag()  # each session starts from a fresh flag (Gradio deep-copies State defaults)

    def start(self) -> int:
        self.current += 1
        self.running.add(self.current)
        return self.current

    def finish(self, ticket: int) -> None:
        self.running.discard(ticket)

    def stop(self) -> bool:
        """Stop the current generation; False when none is running."""
        self.stopped = self.current
        return self.current in self.running

    def supersede(self) -> None:
        self.current += 1

    def superseded(self, ticket: int) -> bool:
        return ticket != self.current

    def cleared(self) -> bool:
        """True when the newest event was Clear (no generation started since)."""
        return self.current not in self.running

    def should_stop(self, ticket: int) -> bool:
        return self.stopped == ticket or self.superseded(ticket)


def build_ui(engine: Engine, title: str = "DART: speculative decoding, live") -> Any:
    """The page. Launch it with `launch(css=CSS)` after `queue()` (see `dart_infer.cli.app`)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # never phone home (read at import)
    import gradio as gr

    methods = engine.method_names
    d = engine.defaults
    draft_length = engine.draft_length

    with gr.Blocks(title=title) as demo:
        gr.Markdown(f"# {title}\nThe same base model decodes with each method; DART and EAGLE-3 are lossless "
                    "(greedy answers equal plain decoding's in float32). Highlighted tokens came from accepted "
                    "drafts; τ is tokens per verification step.")
        notices = "\n".join(f"- {n}" for n in engine.notices)
        gr.Markdown(notices, elem_id="notices", visible=bool(notices))

        with gr.Row():
            temperature = gr.Slider(0.0, 2.0, value=d.temperature, step=0.05, label="temperature (0 = greedy)",
                                    elem_id="temperature")
            top_p = gr.Slider(0.0, 1.0, value=d.top_p, step=0.01, label="top-p (0 = off)", elem_id="top-p")
            top_k = gr.Number(value=d.top_k, precision=0, label="top-k (0 = off)", elem_id="top-k")
            tree_size = gr.Slider(1, 64, value=engine.tree_size, step=1, label="tree size (draft nodes per step)",
                                  elem_id="tree-size", interactive=draft_length > 0)
            max_new = gr.Number(value=d.max_new_tokens, precision=0, label="max new tokens", elem_id="max-new-tokens")
        controls = [temperature, top_p, top_k, tree_size, max_new]

        with gr.Tab("Chat"):
            method = gr.Radio(methods, value=methods[0], label="method", elem_id="method")
            chatbot = gr.Chatbot(label="chat", elem_id="chat", height=420, render_markdown=False)
            history = gr.State([])
            with gr.Row():
                prompt = gr.Textbox(placeholder="Type a message and press Send", show_label=False, scale=6,
                                    elem_id="prompt")
                send = gr.Button("Send", variant="primary", elem_id="send", scale=1)
            with gr.Row():
                regenerate = gr.Button("Regenerate", elem_id="regenerate")
                stop = gr.Button("Stop", variant="stop", elem_id="stop")
                clear = gr.Button("Clear", elem_id="clear")
            status = gr.HTML(_status(""), elem_id="chat-status")
            readout = gr.HTML(stats_html(None), elem_id="chat-stats")
            steps = gr.HTML(steps_html(None, draft_length), elem_id="chat-steps")

        with gr.Tab("Side by side"):
            sbs_prompt = gr.Textbox(lines=2, label="prompt", elem_id="sbs-prompt")
            with gr.Row():
                method_a = gr.Dropdown(methods, value=methods[0], label="left", elem_id="sbs-a")
                method_b = gr.Dropdown(methods, value=AR, label="right", elem_id="sbs-b")
                run_sbs = gr.Button("Run both", variant="primary", elem_id="sbs-run")
                stop_sbs = gr.Button("Stop", variant="stop", elem_id="sbs-stop")
            sbs_status = gr.HTML(_status(""), elem_id="sbs-status")
            with gr.Row(equal_height=False):
                panel_a = gr.HTML(panel_html(None, methods[0], draft_length), elem_id="sbs-a-out")
                panel_b = gr.HTML(panel_html(None, AR, draft_length), elem_id="sbs-b-out")

        chat_outputs = [chatbot, history, readout, steps, status]
        # Per-session run bookkeeping (Gradio hands a session the same State object in every event):
        # each generation takes a number; Stop marks the current one stopped; Clear or a newer
        # generation supersedes it. The decoding loop asks before every step (`Engine.stream(stop=)`).
        chat_run, sbs_run = gr.State(RunFlag()), gr.State(RunFlag())

        def cleared_view() -> tuple[Any, ...]:
            return [], [], stats_html(None), steps_html(None, draft_length), _status("")

        def answer_turn(
            run: RunFlag, history: list[dict[str, str]], method: str, *raw: Any
        ) -> Iterator[tuple[Any, ...]]:
            """Stream the assistant's answer to the conversation in `history` (ending in a user turn)."""
            ticket = run.start()
            try:
                yield from _answer_turn(run, ticket, history, method, *raw)
            finally:
                run.finish(ticket)

        def _answer_turn(
            run: RunFlag, ticket: int, history: list[dict[str, str]], method: str, *raw: Any
        ) -> Iterator[tuple[Any, ...]]:
            try:
                settings = Decoding.from_controls(*raw, seed=d.seed + ticket)  # a new sample on Regenerate
                answers = engine.stream(method, history, settings, stop=lambda: run.should_stop(ticket))
                stream = throttle(answers, engine.update_interval)
                answer = next(stream)
            except ValueError as err:
                shown = history[:-1] if history and history[-1]["role"] == "user" else history
                yield (_chat_view(shown, None), shown, stats_html(None), steps_html(None, draft_length),
                       _status(ERROR + str(err)))
                return
            history = [*history, {"role": "assistant", "content": ""}]
            while answer is not None:
                if answer.stopped and run.superseded(ticket):
                    # An update of ours sent just before Clear can reach the page after Clear's own
                    # reply (two channels): end on the cleared view. A newer request owns the page.
                    if run.cleared():
                        yield cleared_view()
                    return
                history[-1] = {"role": "assistant", "content": answer.text}
                state = "stopped" if answer.stopped else "done" if answer.finished else "…"
                yield (_chat_view(history, answer), list(history), stats_html(answer),
                       steps_html(answer, draft_length), _status(f"{method}: {state}"))
                answer = next(stream, None)
            if run.superseded(ticket) and run.cleared():
                yield cleared_view()  # Clear came after our last step: its reply may have landed first

        def on_send(
            run: RunFlag, message: str, history: list[dict[str, str]], method: str, *raw: Any
        ) -> Iterator[tuple[Any, ...]]:
            if not message or not message.strip():
                yield gr.skip(), history, gr.skip(), gr.skip(), _status(ERROR + "type a message first"), gr.skip()
                return
            turn = [*history, {"role": "user", "content": message}]
            for out in answer_turn(run, turn, method, *raw):
                if ERROR in out[-1]:
                    yield (*out, message)  # keep a message that was not answered
                else:
                    yield (*out, gr.skip() if not out[0] else "")  # after Clear: leave what is typed now

        def on_regenerate(
            run: RunFlag, history: list[dict[str, str]], method: str, *raw: Any
        ) -> Iterator[tuple[Any, ...]]:
            last_user = max((i for i, m in enumerate(history) if m["role"] == "user"), default=None)
            if last_user is None:
                yield gr.skip(), history, gr.skip(), gr.skip(), _status(ERROR + "nothing to regenerate: send a message")
                return
            yield from answer_turn(run, history[: last_user + 1], method, *raw)

        def on_stop(run: RunFlag) -> Any:
            # A running generation says "stopped" itself: its last update could land before this one.
            return gr.skip() if run.stop() else _status("nothing is running")

        def on_clear(run: RunFlag) -> tuple[Any, ...]:
            run.supersede()
            return *cleared_view(), ""

        def on_side_by_side(run: RunFlag, text: str, a: str, b: str, *raw: Any) -> Iterator[tuple[str, str, str]]:
            ticket = run.start()
            try:
                yield from _side_by_side(run, ticket, text, a, b, *raw)
            finally:
                run.finish(ticket)

        def _side_by_side(run: RunFlag, ticket: int, text: str, a: str, b: str, *raw: Any) -> Iterator[tuple[str, str, str]]:
            empty_a, empty_b = panel_html(None, a, draft_length), panel_html(None, b, draft_length)
            if not text or not text.strip():
                yield empty_a, empty_b, _status(ERROR + "type a prompt first")
                return
            try:
                settings = Decoding.from_controls(*raw, seed=d.seed + ticket)  # both methods draw with one seed
                engine.prompt_ids([{"role": "user", "content": text}])
            except ValueError as err:
                yield empty_a, empty_b, _status(ERROR + str(err))
                return
            panels = [empty_a, empty_b]
            for side, name in enumerate((a, b)):
                try:
                    answers = engine.stream(name, [{"role": "user", "content": text}], settings,
                                            stop=lambda: run.should_stop(ticket))
                    for answer in throttle(answers, engine.update_interval):
                        if answer.stopped and run.superseded(ticket):
                            return
                        panels[side] = panel_html(answer, name, draft_length)
                        yield panels[0], panels[1], _status(f"{name}: stopped" if answer.stopped else f"running {name}…")
                        if answer.stopped:
                            return
                except ValueError as err:
                    yield panels[0], panels[1], _status(ERROR + str(err))
                    return
            yield panels[0], panels[1], _status(f"done: {a} then {b}")

        send_inputs = [chat_run, prompt, history, method, *controls]
        send.click(on_send, send_inputs, [*chat_outputs, prompt])
        prompt.submit(on_send, send_inputs, [*chat_outputs, prompt])
        regenerate.click(on_regenerate, [chat_run, history, method, *controls], chat_outputs)
        # Stop and Clear skip the queue: they answer at once, however busy the generators are.
        stop.click(on_stop, chat_run, status, queue=False)
        clear.click(on_clear, chat_run, [*chat_outputs, prompt], queue=False)
        run_sbs.click(on_side_by_side, [sbs_run, sbs_prompt, method_a, method_b, *controls],
                      [panel_a, panel_b, sbs_status])
        stop_sbs.click(on_stop, sbs_run, sbs_status, queue=False)
    return demo
