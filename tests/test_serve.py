"""`specpack serve`: the official openai client against a loopback server; greedy answers equal
`specpack run`; a bounded load test whose /metrics add up; every bad request gets an OpenAI error;
speculation turns off above the concurrency limit; a client that leaves frees its slot; a full
queue gets 429 and a request that can never fit 400."""

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from specpack.serving.generate import GenerateRequest, generate_text  # noqa: E402
from specpack.serving.serve import ServerThread, create_app, prepare  # noqa: E402
from specpack.runtime.engine.scheduler import Cancelled, Job, Scheduler  # noqa: E402
from specpack.serving.metrics import Metrics  # noqa: E402

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "The quick brown fox jumps over the",
           "for i in range(10):\n    print(i * i)\n", "Hello, how are you today?"]
LIMIT = 4  # speculation up to 4 requests in flight


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_target):
    from specpack.packager import BuildOptions, NgramParams, build

    out = tmp_path_factory.mktemp("serve") / "tiny-ngram"
    build(BuildOptions(target=tiny_target, drafter="ngram", out=out, ngram=NgramParams(1, 3, 4)))
    return out


@pytest.fixture(scope="module")
def server(artifact):
    # no cost curve measured at start: whether drafts pay would then depend on this machine's timings
    plan = prepare(artifact, max_concurrency=LIMIT, measure_cost=False)
    with ServerThread(plan.app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def reference(artifact):
    """`specpack run`'s output (its library call) from a separately loaded model."""
    import specpack

    model = specpack.load(artifact)
    cache = {}

    def run(prompt: str, chat: bool, max_tokens: int) -> dict:
        key = (prompt, chat, max_tokens)
        if key not in cache:
            cache[key] = generate_text(artifact, GenerateRequest(prompt, chat=chat, max_new_tokens=max_tokens),
                                       model=model)
        return cache[key]

    return run


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _metrics(server) -> dict[str, float]:
    samples = {}
    for line in _get(server.url + "/metrics").splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_models_and_health(server, client, artifact):
    assert [m.id for m in client.models.list().data] == [artifact.name]
    assert json.loads(_get(server.url + "/health"))["status"] == "ok"


def test_completion_equals_run(client, reference, artifact):
    for prompt in PROMPTS[:2]:
        r = client.completions.create(model=artifact.name, prompt=prompt, max_tokens=24, temperature=0)
        want = reference(prompt, False, 24)
        assert r.choices[0].text == want["text"]
        assert r.usage.completion_tokens == len(want["token_ids"])
        assert r.usage.prompt_tokens == want["prompt_tokens"]
        assert r.choices[0].finish_reason == {"length": "length", "context": "length"}.get(want["finish_reason"], "stop")


def test_streamed_chat_equals_run_chat(client, reference, artifact):
    stream = client.chat.completions.create(model=artifact.name, temperature=0, max_tokens=20, stream=True,
                                            messages=[{"role": "user", "content": PROMPTS[2]}],
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    want = reference(PROMPTS[2], True, 20)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want["token_ids"])

    plain = client.chat.completions.create(model=artifact.name, temperature=0, max_tokens=20,
                                           messages=[{"role": "user", "content": PROMPTS[2]}])
    assert plain.choices[0].message.content == want["text"]


def test_streamed_completion_equals_plain(client, artifact):
    args = dict(model=artifact.name, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **args)) == whole


def test_stop_string_cuts_like_run(client, reference, artifact):
    full = reference(PROMPTS[0], False, 24)["text"]
    stop = full[5:8]
    r = client.completions.create(model=artifact.name, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"


BAD = [
    (b'{"model": "tiny-ngram", "prompt": ', 400, None, None),
    (b'[1, 2]', 400, None, "invalid_value"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "model", "model_not_found"),
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens", "invalid_value"),
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "temperature": -0.5}).encode(), 400, "temperature", "invalid_value"),
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "temperature": 2.5}).encode(), 400, "temperature", "invalid_value"),
    (json.dumps({"model": "tiny-ngram", "prompt": "word " * 600}).encode(), 400, "prompt", "context_length_exceeded"),
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "max_tokens": 5000}).encode(), 400, "max_tokens",
     "context_length_exceeded"),
    (json.dumps({"model": "tiny-ngram", "prompt": ""}).encode(), 400, "prompt", None),
    (json.dumps({"model": "tiny-ngram"}).encode(), 400, "prompt", "missing_required_parameter"),
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "n": 3}).encode(), 400, "n", "invalid_value"),
    # bounded and valid input (issue 13): seeds in int64, real Unicode text, few and short stop strings
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "seed": 2**64}).encode(), 400, "seed", "invalid_value"),
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "seed": -2**63 - 1}).encode(), 400, "seed", "invalid_value"),
    (json.dumps({"model": "tiny-ngram", "prompt": "a\ud800b"}).encode(), 400, "prompt", "invalid_value"),
    (json.dumps({"model": "tiny-ngram", "prompt": ["\udfff"]}).encode(), 400, "prompt", "invalid_value"),
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "stop": ["ok", "\ud800"]}).encode(), 400, "stop",
     "invalid_value"),
    (json.dumps({"model": "\ud800", "prompt": "x"}).encode(), 400, "model", "invalid_value"),
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop",
     "invalid_value"),
    (json.dumps({"model": "tiny-ngram", "prompt": "x", "stop": "s" * 1025}).encode(), 400, "stop", "invalid_value"),
    (b'{"model": "tiny-ngram", "prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, None),
]


@pytest.mark.parametrize("body, status, param, code", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, status, param, code):
    got, data = _post(server.url + "/v1/completions", body)
    assert got == status, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    ok = client.completions.create(model="tiny-ngram", prompt="x", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_bad_chat_requests(server, client):
    long = [{"role": "user", "content": "word " * 600}]
    for body, status, param in [({"model": "tiny-ngram", "messages": []}, 400, "messages"),
                                ({"model": "tiny-ngram", "messages": [{"role": "user", "content": "a\ud800"}]},
                                 400, "messages.0.content"),
                                ({"model": "tiny-ngram", "messages": [{"role": "alien", "content": "x"}]}, 400,
                                 "messages.0.role"),
                                ({"model": "tiny-ngram", "messages": long}, 400, "messages")]:
        got, data = _post(server.url + "/v1/chat/completions", json.dumps(body).encode())
        assert (got, data["error"]["param"]) == (status, param), data
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-ngram", messages=[{"role": "user", "content": "x"}], max_tokens=-3)


def test_load_32_clients_every_answer_complete_and_metrics_add_up(server, client, reference, artifact):
    n_requests, max_tokens = 200, 6
    before = _metrics(server)

    def one(i: int) -> tuple[int, int]:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2 == 0:
            r = client.completions.create(model=artifact.name, prompt=prompt, max_tokens=max_tokens, temperature=0)
            assert r.choices[0].text == reference(prompt, False, max_tokens)["text"]
            return r.usage.prompt_tokens, r.usage.completion_tokens
        chunks = list(client.chat.completions.create(
            model=artifact.name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            reference(prompt, True, max_tokens)["text"]
        assert chunks[-1].usage is not None
        return chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens

    for p in PROMPTS:  # fill the reference cache before the clock starts
        reference(p, False, max_tokens), reference(p, True, max_tokens)
    with ThreadPoolExecutor(32) as pool:
        usage = list(pool.map(one, range(n_requests), timeout=300))
    assert len(usage) == n_requests

    delta = _settled_delta(server, before, n_requests)
    assert delta['specpack_http_requests_total{path="/v1/completions",status="200"}'] == n_requests / 2
    assert delta['specpack_http_requests_total{path="/v1/chat/completions",status="200"}'] == n_requests / 2
    spec, plain = delta['specpack_generations_total{speculative="true"}'], \
        delta['specpack_generations_total{speculative="false"}']
    assert spec == n_requests and plain == 0  # speculation is per step: every request may draft
    assert delta["specpack_engine_steps_total"] == delta["specpack_rows_per_step_count"] > 0
    assert delta["specpack_prompt_tokens_total"] == sum(p for p, _ in usage)
    assert delta["specpack_completion_tokens_total"] == sum(c for _, c in usage)
    assert delta["specpack_generations_cancelled_total"] == delta["specpack_generations_failed_total"] == 0
    after = _metrics(server)
    assert after["specpack_queue_depth"] == after["specpack_requests_in_flight"] == 0
    assert after["specpack_acceptance_length"] >= 1
    assert after['specpack_position_tried_total{position="0"}'] >= 1
    # accepted depth per verification step: one observation per step, summing to the accepted drafts
    assert after["specpack_accepted_depth_count"] == after["specpack_spec_steps_total"] > 0
    assert after["specpack_accepted_depth_sum"] == after["specpack_draft_tokens_accepted_total"]
    assert after['specpack_accepted_depth_bucket{le="+Inf"}'] == after["specpack_accepted_depth_count"]


def test_serve_on_onnxruntime_answers_as_run(artifact, reference, tmp_path_factory, monkeypatch):
    """`serve --backend onnxruntime`: 12 concurrent clients on the exported graphs, each answer equal
    to `run`'s on torch, several sequences in one target graph call."""
    import shutil

    from specpack.exports.onnx import export_onnx
    from specpack.runtime.backends.onnxruntime_backend import OrtTarget

    art = tmp_path_factory.mktemp("serve-ort") / artifact.name
    shutil.copytree(artifact, art)
    export_onnx(art, progress=False)
    batches, run = [], OrtTarget._run
    monkeypatch.setattr(OrtTarget, "_run", lambda self, T, inputs, outputs: batches.append(
        inputs["seq_rows"].shape[0]) or run(self, T, inputs, outputs))
    plan = prepare(art, backend="onnxruntime", max_seqs=8, measure_cost=False)
    for p in PROMPTS:
        reference(p, False, 8)
    with ServerThread(plan.app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=60, max_retries=0)

        def one(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            r = client.completions.create(model=art.name, prompt=prompt, max_tokens=8, temperature=0)
            assert r.choices[0].text == reference(prompt, False, 8)["text"]

        with ThreadPoolExecutor(12) as pool:
            list(pool.map(one, range(24), timeout=300))
    assert max(batches) > 1


def test_one_client_speculates(server, client, artifact):
    before = _metrics(server)
    client.completions.create(model=artifact.name, prompt=PROMPTS[0] * 3, max_tokens=24, temperature=0)
    after = _metrics(server)
    assert after["specpack_draft_tokens_proposed_total"] > before["specpack_draft_tokens_proposed_total"]
    assert after["specpack_time_to_first_token_seconds_count"] > before["specpack_time_to_first_token_seconds_count"]


def _settled_delta(server, before: dict, n: int) -> dict:
    """Metrics minus `before`, once the last responses' counters are in (bounded wait)."""
    key = 'specpack_http_requests_total{path="/v1/chat/completions",status="200"}'
    for _ in range(50):
        now = _metrics(server)
        if now.get(key, 0) - before.get(key, 0) >= n / 2:
            break
        time.sleep(0.05)
    return {k: v - before.get(k, 0) for k, v in now.items()}


class Slow:
    """The tiny artifact's model with every engine step paused (and held at `gate` until the test
    opens it); `steps` counts the target forwards."""

    def __init__(self, artifact, step_s: float = 0.01):
        import specpack

        self.model, self.step_s, self.steps = specpack.load(artifact), step_s, 0
        self.gate = threading.Event()
        forward = self.model.target.forward_rows

        def slowed(*args, **kwargs):
            self.gate.wait(30)
            time.sleep(self.step_s)
            self.steps += 1
            return forward(*args, **kwargs)

        self.model.target.forward_rows = slowed

    def scheduler(self, **options) -> Scheduler:
        return Scheduler(self.model, **{"slots": 4, "draft_len": 3, "listener": Metrics(), **options})

    def app(self, scheduler=None, **options):
        return create_app(self.model, scheduler or self.scheduler(), "slow", **options)


@pytest.fixture
def slow(artifact):
    return Slow(artifact)


def _ids(slow, text: str = "def add(a, b):") -> list[int]:
    return slow.model.tokenizer(text).input_ids


def test_speculation_turns_off_above_the_limit_and_back_on(slow):
    sch = slow.scheduler(max_concurrency=2)
    futures = [sch.submit(Job(_ids(slow), n)) for n in (4, 8, 12, 16)]  # queued before it starts
    seen, decide = [], sch.speculation_now

    def spy():
        on = decide()
        seen.append((sch.in_flight, on))
        return on

    sch.speculation_now = spy
    slow.gate.set()
    with sch:
        for f in futures:
            f.result(30)
    assert all(on == (n <= 2) for n, on in seen), seen  # off while 4 and 3 were in flight, on at 2 and 1
    assert {on for _, on in seen} == {True, False}
    assert sch.listener.generations == {True: 4, False: 0}


def test_cancelled_job_stops_between_steps_and_frees_its_slot(slow):
    slow.gate.set()
    with slow.scheduler() as sch:
        job = Job(_ids(slow), 400)
        got = []
        job.on_tokens = lambda toks: (got.extend(toks), len(got) >= 3 and job.cancel.set())
        with pytest.raises(Cancelled):
            sch.submit(job).result(30)
        assert len(sch.submit(Job(_ids(slow), 2)).result(30).tokens) == 2
    assert len(got) <= 8 and sch.listener.cancelled == 1 and sch.in_flight == 0
    assert len(sch.engine.free) == sch.slots


def test_full_queue_gets_429_with_retry_after(slow):
    sch = slow.scheduler(slots=1, max_queue=1)
    with ServerThread(slow.app(sch)) as srv:  # the gate is shut: the first request holds the slot
        body = json.dumps({"model": "slow", "prompt": "x", "max_tokens": 3}).encode()
        first = threading.Thread(target=_post, args=(srv.url + "/v1/completions", body))
        first.start()
        while sch.running < 1:
            time.sleep(0.01)
        second = threading.Thread(target=_post, args=(srv.url + "/v1/completions", body))
        second.start()
        while sch.queue_depth < 1:
            time.sleep(0.01)
        req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 429 and err.value.headers["Retry-After"] == "1"
        assert json.loads(err.value.read())["error"]["type"] == "rate_limit_error"
        slow.gate.set()
        first.join(30)
        second.join(30)
        status, data = _post(srv.url + "/v1/completions", body)
        assert status == 200 and data["usage"]["completion_tokens"] == 3


def test_request_that_can_never_fit_gets_400_naming_the_limit(slow):
    slow.gate.set()
    with ServerThread(slow.app(slow.scheduler(max_len=32))) as srv:
        status, data = _post(srv.url + "/v1/completions",
                             json.dumps({"model": "slow", "prompt": "x", "max_tokens": 40}).encode())
        assert status == 400 and data["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is 32 tokens" in data["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_disconnects_frees_its_slot(slow, stream, monkeypatch):
    import dataclasses

    # the tiny model's random weights may say end-of-text at once: this client must still be mid-answer
    spec = slow.model.target.spec
    monkeypatch.setattr(slow.model.target, "spec", dataclasses.replace(spec, eos_token_ids=()))
    slow.gate.set()
    sch = slow.scheduler()
    with ServerThread(slow.app(sch)) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": stream}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
        else:
            deadline = time.monotonic() + 10
            while slow.steps < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert slow.steps >= 3, "the request ended before the client left"
        conn.sock.shutdown(2)
        conn.close()
        deadline = time.monotonic() + 10
        while sch.listener.cancelled < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sch.listener.cancelled == 1 and sch.in_flight == 0 and len(sch.engine.free) == sch.slots
        assert slow.steps < 400  # stopped between steps, long before its 400 tokens
        status, data = _post(srv.url + "/v1/completions", json.dumps({"model": "slow", "prompt": "x",
                                                                      "max_tokens": 3}).encode())
        assert status == 200 and data["usage"]["completion_tokens"] == 3


def test_seed_at_the_ends_of_its_range_is_served(client):
    for seed in (-2**63, 2**63 - 1):
        r = client.completions.create(model="tiny-ngram", prompt="x", max_tokens=2, temperature=0.7, seed=seed)
        assert r.usage.completion_tokens >= 1


@pytest.fixture
def small_body_server(slow):
    slow.gate.set()
    with ServerThread(slow.app(max_body_bytes=4096)) as srv:
        yield srv


def _raw_post(port: int, headers: dict, chunks: list[bytes]) -> tuple[int, dict]:
    """POST `chunks` without finishing the body (no final chunk, fewer bytes than declared), then
    read the answer: only a server that stops reading early answers at all."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    for name, value in {"Content-Type": "application/json", **headers}.items():
        conn.putheader(name, value)
    conn.endheaders()
    for chunk in chunks:
        conn.send(chunk)
    resp = conn.getresponse()
    try:
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("headers, chunks", [
    ({"Content-Length": str(50 * 2**20)}, [b'{"model": "slow", "prompt": "']),  # refused on its header
    ({"Transfer-Encoding": "chunked"}, [b"400\r\n" + b"x" * 1024 + b"\r\n"] * 5),  # counted as it streams
])
def test_body_over_the_limit_is_refused_before_it_is_read(small_body_server, headers, chunks):
    status, data = _raw_post(small_body_server.port, headers, chunks)
    assert status == 413 and data["error"]["code"] == "request_too_large"
    assert data["error"]["type"] == "invalid_request_error" and "4,096 bytes" in data["error"]["message"]
    ok, body = _post(small_body_server.url + "/v1/completions",
                     json.dumps({"model": "slow", "prompt": "x", "user": "u" * 3900, "max_tokens": 2}).encode())
    assert ok == 200 and body["usage"]["completion_tokens"] == 2


class _ThreadSpy:
    """A tokenizer that records the threads it encodes and decodes on."""

    def __init__(self, tokenizer):
        self._tokenizer, self.threads = tokenizer, set()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        self.threads.add(threading.current_thread().name)
        return self._tokenizer(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self.threads.add(threading.current_thread().name)
        return self._tokenizer.decode(*args, **kwargs)


@pytest.mark.parametrize("stream", [True, False])
def test_text_work_stays_off_the_scheduler(slow, stream):
    """Decoding and stop-string matching run off the scheduler (a stream with long stop strings in
    the thread pool): a long stop string cannot stall the scheduler (and with it every other
    request), nor the event loop."""
    slow.gate.set()
    from specpack.runtime.text import encode_prompt

    ids = encode_prompt(slow.model.tokenizer, "hi", chat=False)
    want = slow.model.tokenizer.decode(slow.model.generate(ids, 12, speculative=False).tokens, skip_special_tokens=True)
    slow.model.tokenizer = spy = _ThreadSpy(slow.model.tokenizer)
    with ServerThread(slow.app()) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=30, max_retries=0)
        stop = ["\x00" * 1024, "\x01\x02" * 512]
        r = client.completions.create(model="slow", prompt="hi", max_tokens=12, stop=stop, stream=stream,
                                      temperature=0)
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert text == want and spy.threads and "specpack-scheduler" not in spy.threads
    assert all(t.startswith("AnyIO") for t in spy.threads), spy.threads  # stops this long: never the event loop


def test_stop_strings_are_held_back_and_cut_like_before():
    """TextStream's linear partial-match scan sends exactly what the old quadratic one did."""
    import random

    from specpack.runtime.text import TextStream

    class Chars:  # one token per character
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    rng = random.Random(13)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        sent = []
        stream = TextStream(Chars(), sent.append, stops=stops)
        for ch in text:
            stream([ord(ch)])
            whole = "".join(sent)
            full = stream.text()
            assert full.startswith(whole)
            held = max((k for s in stops for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
            assert len(whole) == max(len(full) - held, len(whole))  # the old rule, on the same text
        cuts = [text.find(s) for s in stops if s in text]
        assert stream.flush() == (text[: min(cuts)] if cuts else text)


@pytest.fixture
def keyed_server(slow):
    slow.gate.set()
    with ServerThread(slow.app(api_key="sk-local-1")) as srv:
        yield srv


def _status(url: str, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()) if "json" in r.headers.get("content-type", "") else {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_api_key_is_required_on_every_route_but_health(keyed_server):
    url = keyed_server.url
    assert _status(url + "/health", {})[0] == 200
    for path in ("/v1/models", "/metrics", "/v1/models/slow", "/no/such/route"):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-local-1"},
                        {"Authorization": "Bearer sk-local-1x"}):
            status, data = _status(url + path, headers)
            assert status == 401 and data["error"]["code"] == "invalid_api_key", (path, headers)
            assert data["error"]["type"] == "invalid_request_error" and "sk-local-1" not in json.dumps(data)
    assert _status(url + "/v1/models", {"Authorization": "Bearer sk-local-1"})[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-local-1", timeout=30, max_retries=0)
    assert client.completions.create(model="slow", prompt="x", max_tokens=2).usage.completion_tokens == 2
    chunks = list(client.completions.create(model="slow", prompt="x", max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2


@pytest.mark.parametrize("key", ["", "has space", "tab\tkey", "ключ"])
def test_unusable_api_key_is_refused_before_loading(artifact, key):
    from specpack.errors import InputError

    with pytest.raises(InputError, match="invalid serve options") as err:
        prepare(artifact, api_key=key)
    assert any("--api-key" in p for p in err.value.problems)


def test_a_lookup_length_out_of_range_is_refused_before_loading(artifact):
    from specpack.errors import InputError

    with pytest.raises(InputError, match="invalid serve options") as err:
        prepare(artifact, lookup=17)
    assert any("--lookup 17" in p for p in err.value.problems)


def test_the_cli_hands_lookup_to_every_request(artifact, cli, monkeypatch):
    import specpack.serving.serve as serve_module
    from specpack.runtime.engine.scheduler import Job, Scheduler

    made = []
    monkeypatch.setattr(serve_module, "run", lambda plan, host, port: None)
    monkeypatch.setattr(serve_module, "Scheduler", lambda *a, **k: made.append(Scheduler(*a, **k)) or made[-1])
    assert cli("serve", artifact, "--lookup", "6")[0] == 0
    assert made[-1].lookup == 6 and made[-1]._request(Job([1, 2, 3], 4)).lookup == 6


def test_cli_takes_the_key_from_the_environment(artifact, cli, monkeypatch):
    import specpack.serving.serve as serve_module

    plans = []
    monkeypatch.setattr(serve_module, "run", lambda plan, host, port: plans.append(plan))
    monkeypatch.setenv("SPECPACK_API_KEY", "sk-env")
    assert cli("serve", artifact)[0] == 0 and plans[-1].needs_key
    monkeypatch.delenv("SPECPACK_API_KEY")
    assert cli("serve", artifact)[0] == 0 and not plans[-1].needs_key


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                                               ("127.0.0.1", None, False), ("::1", None, False),
                                               ("localhost", None, False), ("my-host", None, True)])
def test_serving_beyond_loopback_without_a_key_warns(monkeypatch, caplog, host, key, warned):
    import specpack.serving.serve as serve_module

    monkeypatch.setattr("uvicorn.run", lambda *a, **k: None)
    serve_module.run(serve_module.ServerPlan(None, "m", None, needs_key=key is not None), host=host)
    assert ("no API key" in caplog.text) == warned


def test_serve_logs_each_finished_request_at_the_default_level(monkeypatch, caplog):
    """The README's per-request line shows without -v (issue 62 point 4)."""
    import logging

    import specpack.serving.serve as serve_module
    from specpack.serving import metrics

    monkeypatch.setattr(metrics.log, "level", logging.NOTSET)
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: None)
    caplog.set_level(logging.WARNING)  # the CLI's default: the root at WARNING, its handler open (basicConfig)
    caplog.handler.setLevel(logging.NOTSET)
    assert not metrics.log.isEnabledFor(logging.INFO)
    serve_module.run(serve_module.ServerPlan(None, "m", None, needs_key=False))
    metrics.log.info("request done: prompt 3, new 5")
    assert "request done: prompt 3, new 5" in caplog.text


def test_serve_says_each_start_phase_and_when_it_is_ready(artifact, cli, monkeypatch):
    """A start that takes half a minute says what it is doing, timed (issue 62 item 2)."""
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: None)
    code, _, err = cli("serve", artifact, "--port", "8123")
    assert code == 0, err
    lines = err.splitlines()
    verifying = next(i for i, line in enumerate(lines) if "verifying and loading" in line)
    measuring = next(i for i, line in enumerate(lines) if "pricing drafts with this machine's cost curve" in line)
    ready = next(i for i, line in enumerate(lines) if line.endswith("] ready"))
    assert verifying < measuring < ready and lines[ready].startswith("[") and "serving 'tiny-ngram'" in err
