"""The OpenAI-compatible server, over real HTTP on a free loopback port.

Two servers run in this process (uvicorn in a thread, `hisparse_jax.serve.server.
ServerThread`): the synthetic `tiny` model (no tokenizer: token-id prompts) and the
`dsv32-yarn` checkpoint fixture copied with a chat template added to its
tokenizer_config.json (text prompts, stop strings, chat). Each output is compared with an
offline `Engine` of the same configuration and model serving the same request (greedy, or
sampled under the same seed). One more server runs as a subprocess for SIGTERM. Waits poll
the server's state with a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from hisparse_jax.engine import Engine  # noqa: E402
from hisparse_jax.serve import args as serve_args  # noqa: E402
from hisparse_jax.serve.cli import build_state  # noqa: E402
from hisparse_jax.serve.server import HTTPServer, ServerThread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "dsv32-yarn"
TIMEOUT = 120.0
TINY_FLAGS = ["--model", "tiny", "--seats", "2", "--max-queue", "2", "--max-model-len", "64",
              "--prefill-bucket", "64", "--no-warmup"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def wait_for(predicate, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Served:
    """A server in a thread, its state, and an offline engine of the same model and config."""

    def __init__(self, flags: list[str]) -> None:
        self.args = serve_args.parse_args(flags)
        self.model = serve_args.load_model(self.args)
        self.state = build_state(self.args, model=self.model)
        self.thread = ServerThread(HTTPServer(self.state, port=0)).start()
        self.url = self.thread.url
        self.client = httpx.Client(base_url=self.url, timeout=TIMEOUT)
        self._offline: Engine | None = None

    def offline(self, prompt, *, max_tokens, temperature=0.0, seed=None, stop_token_ids=()):
        """(finish_reason, tokens) of the offline engine serving the request alone."""
        if self._offline is None:
            self._offline = Engine(self.model, serve_args.engine_config(
                self.args, self.model.spec))
        rid = self._offline.add_request(prompt, max_new_tokens=max_tokens,
                                        temperature=temperature, seed=seed,
                                        stop_token_ids=stop_token_ids)
        req = self._offline.run()[rid]
        return req.finish_reason, list(req.generated)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = self.client.get("/metrics").text
        out = {}
        for family in prometheus_parser.text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def close(self) -> None:
        self.client.close()
        self.thread.stop()
        if self._offline is not None:
            self._offline.close()


@pytest.fixture(scope="module")
def tiny():
    served = Served(TINY_FLAGS)
    yield served
    served.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dsv32-chat")
    for item in FIXTURE.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((FIXTURE / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    served = Served(["--model", str(folder), "--seats", "2", "--max-model-len", "64",
                     "--prefill-bucket", "64", "--no-warmup"])
    yield served
    served.close()


def events(response) -> list:
    """The SSE payloads of a streamed response, "[DONE]" last (checked)."""
    out = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert out and out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]] + ["[DONE]"]


def stream(served: Served, body: dict, path: str = "/v1/completions") -> list:
    with served.client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return events(r)


def streamed_tokens(chunks: list) -> tuple[list[int], str, str]:
    ids, text, reason = [], "", None
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            ids += choice["token_ids"]
            text += choice.get("text", choice.get("delta", {}).get("content", ""))
            reason = choice["finish_reason"] or reason
    return ids, text, reason


# ------------------------------------------------------------------ token prompts (tiny)


@pytest.mark.parametrize("streamed", [False, True])
def test_token_prompts_greedy_equal_the_offline_engine(tiny, streamed):
    prompt = [5, 17, 3, 99, 250, 7, 1, 42]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    if streamed:
        chunks = stream(tiny, body)
        ids, text, reason = streamed_tokens(chunks)
        assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
        assert chunks[0]["object"] == "text_completion"
    else:
        r = tiny.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        ids, text, reason = choice["token_ids"], choice["text"], choice["finish_reason"]
        assert out["usage"] == {"prompt_tokens": 8, "completion_tokens": 12,
                                "total_tokens": 20}
    assert ids == tiny.offline(prompt, max_tokens=12)[1]
    assert reason == "length" and text == ""


def test_sampled_tokens_under_a_seed_equal_the_offline_engine(tiny):
    prompt = [9, 8, 7, 6, 5]
    body = {"prompt": [prompt], "max_tokens": 10, "temperature": 0.9, "seed": 1234}
    ids, _, _ = streamed_tokens(stream(tiny, body))
    assert ids == tiny.offline(prompt, max_tokens=10, temperature=0.9, seed=1234)[1]
    again = tiny.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert again == ids


def test_stop_token_ids_finish_with_stop(tiny):
    prompt = [11, 12, 13]
    greedy = tiny.offline(prompt, max_tokens=10)[1]
    stop = greedy[3]
    out = tiny.client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 10, "temperature": 0, "stop_token_ids": [stop]}).json()
    choice = out["choices"][0]
    assert choice["token_ids"] == greedy[:greedy.index(stop) + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


# ------------------------------------------------------------------ refusals


BAD_REQUESTS = [
    ({"prompt": [1, 2], "max_tokens": 4, "frobnicate": 1}, "frobnicate"),
    ({"prompt": [1, 2], "max_tokens": 4, "top_p": 0.5}, "top_p"),
    ({"prompt": [1, 2], "max_tokens": "4"}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": True}, "max_tokens"),
    ({"prompt": [1, 2], "temperature": "hot"}, "temperature"),
    ({"prompt": [1, 2], "temperature": -1}, "temperature"),
    ({"prompt": [1, 2], "stream": "yes"}, "stream"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [1, 2.5]}, "prompt"),
    ({"prompt": [1, 100000]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": list(range(1, 65))}, "prompt"),
    ({"prompt": list(range(1, 41)), "max_tokens": 30}, "max_tokens"),
    ({"prompt": [1, 2], "n": 2}, "n"),
    ({"prompt": [1, 2], "seed": -1}, "seed"),
    ({"prompt": [1, 2], "seed": 2**32}, "seed"),
    ({"prompt": [1, 2], "stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hello"}, "prompt"),              # text, and the model has no tokenizer
    ({"prompt": [1, 2], "stop": "\n"}, "stop"),    # stop strings need a tokenizer too
]


@pytest.mark.parametrize("body,field", BAD_REQUESTS,
                         ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_REQUESTS)])
def test_a_bad_request_gets_400_naming_the_field_before_the_engine(tiny, monkeypatch, body,
                                                                    field):
    def never(job):
        raise AssertionError("a refused request reached the engine loop")

    monkeypatch.setattr(tiny.state.loop, "submit", never)
    r = tiny.client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"'{field}'" in error["message"], error


def test_a_body_that_is_not_json_or_an_object_gets_400(tiny):
    r = tiny.client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = tiny.client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_another_model_name_gets_404_and_chat_without_a_template_400(tiny):
    r = tiny.client.post("/v1/completions", json={"model": "gpt-4", "prompt": [1]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = tiny.client.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


# ------------------------------------------------------------------ the engine loop


def pause_at_first_tokens(monkeypatch, state, prompt):
    """Pauses the engine loop (on its own thread, before its next step) once the request
    of `prompt` got its first tokens: from then on only a cancel can finish it."""
    on_tokens = state.metrics.on_tokens

    def hook(job, count, now):
        on_tokens(job, count, now)
        if job.prompt == prompt:
            state.loop.pause()

    monkeypatch.setattr(state.metrics, "on_tokens", hook)


@pytest.mark.parametrize("streamed", [True, False])
def test_a_client_that_disconnects_cancels_its_request_and_frees_its_seat(tiny, monkeypatch,
                                                                           streamed):
    loop = tiny.state.loop
    before = tiny.metrics()[("vllm:request_success_total", (("finished_reason", "abort"),))]
    body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 50, "temperature": 0, "stream": streamed}
    pause_at_first_tokens(monkeypatch, tiny.state, body["prompt"])
    try:
        if streamed:
            with tiny.client.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        assert loop.engine.running  # it holds a seat; the loop is paused
                        break
        else:  # a client that gives up waiting: its connection closes
            with httpx.Client(base_url=tiny.url) as client, pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=body, timeout=httpx.Timeout(
                    TIMEOUT, read=0.5))
        wait_for(lambda: tiny.metrics()[("vllm:request_success_total",
                                          (("finished_reason", "abort"),))] == before + 1,
                 "the cancelled request")
        m = tiny.metrics()
        assert m[("vllm:num_requests_running", ())] == 0
        assert not loop.engine.running and not loop.engine.waiting and loop.outstanding == 0
    finally:
        loop.resume()
    r = tiny.client.post("/v1/completions", json={"prompt": [2], "max_tokens": 3})
    assert r.status_code == 200


def test_a_full_server_answers_503_with_retry_after(tiny):
    loop = tiny.state.loop
    results: list = []

    def post(i):
        r = httpx.post(f"{tiny.url}/v1/completions", timeout=TIMEOUT,
                       json={"prompt": [i + 1], "max_tokens": 2, "temperature": 0})
        results.append(r.status_code)

    loop.pause()
    threads = [threading.Thread(target=post, args=(i,)) for i in range(loop.capacity)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: loop.outstanding == loop.capacity, "a full server")
        r = tiny.client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "retry later" in r.json()["error"]["message"]
    finally:
        loop.resume()
        for t in threads:
            t.join(TIMEOUT)
    assert results == [200] * loop.capacity


def test_an_engine_error_fails_only_its_request_and_the_server_serves_on(tiny, monkeypatch):
    runner = tiny.state.loop.engine.runner
    prefill = runner.prefill
    marker = (7, 7, 7, 7, 7, 7)

    def failing(req, blocks):
        if tuple(req.prompt) == marker:
            raise RuntimeError("prefill exploded")
        return prefill(req, blocks)

    monkeypatch.setattr(runner, "prefill", failing)
    r = tiny.client.post("/v1/completions", json={"prompt": list(marker), "max_tokens": 4})
    assert r.status_code == 500 and "prefill exploded" in r.json()["error"]["message"]
    chunks = stream(tiny, {"prompt": list(marker), "max_tokens": 4})
    assert "prefill exploded" in chunks[-2]["error"]["message"]
    r = tiny.client.post("/v1/completions", json={"prompt": [7, 7], "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4


def test_steps_that_keep_failing_fail_the_requests_and_the_server_serves_on(tiny,
                                                                            monkeypatch):
    engine = tiny.state.loop.engine

    def broken():
        raise RuntimeError("the device fell over")

    before = tiny.metrics()[("hisparse_jax:engine_step_failures_total", ())]
    monkeypatch.setattr(engine, "step", broken)
    r = tiny.client.post("/v1/completions", json={"prompt": [5, 5], "max_tokens": 3})
    assert r.status_code == 500 and "3 engine steps failed in a row" in r.text
    assert tiny.metrics()[("hisparse_jax:engine_step_failures_total", ())] == before + 3
    monkeypatch.undo()
    r = tiny.client.post("/v1/completions", json={"prompt": [5, 5], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_metrics_parse_as_prometheus_text_and_move(tiny):
    before = tiny.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:hisparse_cache_hits_total", "vllm:hisparse_cache_misses_total",
                 "vllm:hisparse_host_to_device_bytes_total",
                 "hisparse_jax:host_to_device_rows_total", "vllm:kv_cache_usage_perc",
                 "vllm:hisparse_host_blocks_total", "hisparse_jax:engine_step_seconds_count"):
        assert any(key[0] == name for key in before), name
    r = tiny.client.post("/v1/completions", json={"prompt": [4, 4, 4], "max_tokens": 5})
    assert r.status_code == 200
    after = tiny.metrics()

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert moved("vllm:generation_tokens_total") == 5
    assert moved("vllm:prompt_tokens_total") >= 3
    assert moved("vllm:request_success_total", (("finished_reason", "length"),)) == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:inter_token_latency_seconds_count") >= 1
    assert moved("hisparse_jax:engine_step_seconds_count") >= 5
    assert after[("vllm:hisparse_host_blocks_total", ())] > 0


def test_health_and_models(tiny):
    assert tiny.client.get("/health").json() == {"status": "ok"}
    models = tiny.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 64


def test_a_drain_past_its_grace_period_aborts_what_runs_and_stops_the_server(tiny,
                                                                           monkeypatch):
    """The drain SIGTERM starts (`HTTPServer.drain`), on a server of its own: requests still
    running when the grace period ends finish with "abort", then the server ends."""
    args = serve_args.parse_args(TINY_FLAGS)
    state = build_state(args, model=tiny.model)
    pause_at_first_tokens(monkeypatch, state, [2, 7, 1, 8])
    server = ServerThread(HTTPServer(state, port=0, grace_period=0.2)).start()
    received: list = []

    def client():
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=TIMEOUT, json={
                "prompt": [2, 7, 1, 8], "max_tokens": 50, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    received.append(line)

    t = threading.Thread(target=client)
    t.start()
    try:
        wait_for(lambda: received, "a first token")  # the loop is paused: it cannot finish
        server.server.on_signal(signal.SIGTERM, None)
        t.join(TIMEOUT)
        assert received[-1] == "data: [DONE]"
        last = json.loads(received[-2][len("data: "):])["choices"][0]
        assert last["finish_reason"] == "abort"
        assert server.join(TIMEOUT) and not state.loop.alive
        assert state.loop.engine.closed
    finally:
        state.loop.resume()
        server.stop()


def test_the_load_benchmark_runs_and_checks_its_outputs_offline(tiny, tmp_path, capsys):
    from bench import serve_load

    out = tmp_path / "load.json"
    status = serve_load.main(["--url", tiny.url, "--clients", "3", "--requests", "6",
                              "--warmup-requests", "1", "--prompt-len", "8",
                              "--output-len", "5", "--temperature", "0.7", "--out", str(out),
                              "--", *TINY_FLAGS])
    assert status == 0
    assert "outputs equal offline: yes (6 requests, 0 differ)" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["requests_completed"] == 6 and record["generated_tokens"] == 30
    assert record["ttft_ms"]["n"] == 6 and record["itl_ms"]["n"] == 24
    assert record["outputs_equal_offline"] is True and record["mode"] == "hisparse"


# ------------------------------------------------------------------ text and chat (checkpoint)


def test_text_prompts_equal_the_offline_engine_streamed_or_not(checkpoint):
    tok = checkpoint.state.tokenizer
    text = "each decode step reads a few rows"
    prompt = tok.encode(text)
    eos = tok.eos_token_ids
    reason, greedy = checkpoint.offline(prompt, max_tokens=10, stop_token_ids=eos)
    out = checkpoint.client.post("/v1/completions", json={
        "prompt": text, "max_tokens": 10, "temperature": 0}).json()
    choice = out["choices"][0]
    assert choice["token_ids"] == greedy and choice["prompt_token_ids"] == prompt
    assert choice["text"] == tok.decode(greedy, skip_special_tokens=True)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    ids, streamed_text, streamed_reason = streamed_tokens(stream(checkpoint, {
        "prompt": text, "max_tokens": 10, "temperature": 0}))
    assert (ids, streamed_text, streamed_reason) == (greedy, choice["text"],
                                                     choice["finish_reason"])
    assert choice["finish_reason"] == {"stop": "stop", "length": "length"}[reason]


def test_a_stop_string_cuts_the_text_and_frees_the_seat(checkpoint):
    body = {"prompt": "the host tier", "max_tokens": 12, "temperature": 0}
    full = checkpoint.client.post("/v1/completions", json=body).json()["choices"][0]
    text = full["text"]
    assert len(text) > 4, text
    stop = text[2:4]
    for streamed in (False, True):
        if streamed:
            ids, cut, reason = streamed_tokens(stream(checkpoint, {**body, "stop": [stop]}))
        else:
            choice = checkpoint.client.post("/v1/completions",
                                            json={**body, "stop": stop}).json()["choices"][0]
            ids, cut, reason = choice["token_ids"], choice["text"], choice["finish_reason"]
            assert choice["stop_reason"] == stop
        assert (cut, reason) == (text[:text.index(stop)], "stop")
        assert ids == full["token_ids"][:len(ids)] and len(ids) < len(full["token_ids"])
    wait_for(lambda: checkpoint.state.loop.outstanding == 0, "the stopped requests' seats")


def test_chat_completions_render_the_template_and_equal_the_offline_engine(checkpoint):
    tok = checkpoint.state.tokenizer
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "rows from host"}]}]
    rendered = "<system>be brief<user>rows from host<assistant>"
    prompt = tok.encode(rendered, add_special_tokens=False)
    _, greedy = checkpoint.offline(prompt, max_tokens=6, stop_token_ids=tok.eos_token_ids)
    body = {"messages": messages, "max_completion_tokens": 6, "temperature": 0}
    out = checkpoint.client.post("/v1/chat/completions", json=body).json()
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and choice["token_ids"] == greedy
    assert choice["message"] == {"role": "assistant",
                                 "content": tok.decode(greedy, skip_special_tokens=True)}
    chunks = stream(checkpoint, body, "/v1/chat/completions")
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    ids, text, _ = streamed_tokens(chunks)
    assert (ids, text) == (greedy, choice["message"]["content"])
    r = checkpoint.client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


# ------------------------------------------------------------------ SIGTERM (a subprocess)


SIGTERM_TEST = "test_sigterm_stops_admission_finishes_running_requests_and_exits_0"


@pytest.fixture(scope="module", autouse=True)
def subprocess_server(request):
    """The SIGTERM test's server process, started with the module (when that test is
    selected) so that its start-up overlaps the other tests."""
    if not any(item.name == SIGTERM_TEST for item in request.session.items):
        yield None
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    flags = ["--model", "tiny", "--port", "0", "--seats", "2", "--max-model-len", "512",
             "--block-size", "16", "--prefill-bucket", "64", "--no-warmup"]
    proc = subprocess.Popen([sys.executable, "-m", "hisparse_jax.serve", *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def test_sigterm_stops_admission_finishes_running_requests_and_exits_0(subprocess_server):
    proc = subprocess_server
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    line = wait_for(lambda: next((x for x in output if x.startswith("serving ")), None)
                    or proc.poll() is not None, "the server's start")
    assert isinstance(line, str), f"the server exited: {''.join(output)[-3000:]}"
    url = line.split(" on ")[-1].strip()
    received: list = []
    body = {"prompt": [1, 2, 3], "max_tokens": 480, "temperature": 0, "stream": True}

    def client():
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                received.append(line)

    t = threading.Thread(target=client)
    t.start()
    wait_for(lambda: any('"token_ids":[' in line for line in received), "a first token")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, "the drain")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 2})
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    t.join(TIMEOUT)
    assert proc.wait(TIMEOUT) == 0
    chunks = [json.loads(line[6:]) for line in received
              if line.startswith("data: {")]
    ids, _, reason = streamed_tokens([*chunks, "[DONE]"])
    assert (len(ids), reason) == (480, "length")
    assert [line for line in received if line][-1] == "data: [DONE]"


def test_every_engine_feature_serves_together_over_http(tmp_path):
    """Asynchronous scheduling (the server's default), prefix caching, chunked prefill and
    MTP drafts in one server (the fixture has an MTP layer): a second turn that extends the
    first (its prompt, the served tokens, new ones) equals the offline engine's tokens."""
    served = Served(["--model", str(FIXTURE), "--seats", "2", "--max-model-len", "64",
                     "--prefill-bucket", "16", "--prefill-chunk-size", "8",
                     "--enable-prefix-caching", "--speculative-tokens", "1", "--no-warmup"])
    try:
        ec = served.state.loop.engine.config
        assert ec.async_scheduling and ec.prefill.prefix_caching
        assert ec.num_speculative_tokens == 1 and ec.prefill.chunk_size == 8
        prompt = [5, 17, 3, 99, 250, 7, 1, 42, 11, 12, 13, 14, 15, 16, 17, 18, 19]
        for _ in range(2):
            r = served.client.post("/v1/completions",
                                   json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            ids = r.json()["choices"][0]["token_ids"]
            assert ids == served.offline(prompt, max_tokens=6)[1]
            prompt = prompt + ids + [21, 22, 23]
    finally:
        served.close()
