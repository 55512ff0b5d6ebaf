"""`specpack serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over the batched engine.

    GET  /health  /metrics  /v1/models
    POST /v1/completions  /v1/chat/completions     (stream: server-sent events, then [DONE])

Continuous batching (runtime/engine/scheduler.py): up to `slots` requests decode together, one
target forward per step over all of them; requests join and leave between steps, and past a
bounded queue new ones get 429 with Retry-After. The KV cache is budgeted up front: `slots`
sequences of `max_len` positions each, from the machine's memory and the manifest's KV bytes per
token; a request that can never fit gets 400 naming the limit. Speculation follows the load: each
step drafts what a cost model measured on this machine and each sequence's acceptance say (full
drafts while a step streams weights, none past the compute knee), and not at all above the
profile's measured concurrency crossover. A client that disconnects frees its slot within a
step. Every bad request gets OpenAI's error body with a 4xx status, and the server keeps serving.

Bounds: a request body over `max_body_bytes` is refused (413) before it is read whole; stop strings,
seeds and text are validated (schemas/openai.py); the prompt must leave room in the context. With an API
key, every route but /health needs `Authorization: Bearer KEY` (401 otherwise). Tokenizing,
decoding and stop-string matching run in a thread pool, not on the worker.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime,
# and `Request` is imported inside create_app so that FastAPI stays an optional dependency.
import asyncio
import contextlib
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

from specpack._net import is_loopback, warn_without_key
from specpack.errors import InputError
from specpack.schemas import openai as oa
from specpack.serving.guards import LimitBody, RequireKey
from specpack.runtime.engine.scheduler import Cancelled, Job, QueueFull, Scheduler
from specpack.serving.metrics import Metrics

log = logging.getLogger(__name__)
_DONE, _GONE = object(), object()  # stream sentinels: generation finished / client left
MAX_BODY_BYTES = 2**20
MAX_SEQS = 16  # sequences decoding together by default (llama-server's users run -np 4..16)
KV_MEMORY_FRACTION = 0.6  # of the memory available once the model is loaded, for the KV cache
RETRY_AFTER_S = 1


class ApiError(Exception):
    """A request error sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.body = status, oa.error_body(message, type_, param, code)
        self.headers = headers


@dataclass
class ServerPlan:
    """A loaded model with the settings it will be served with; `app` is the ASGI application."""

    app: object
    model_name: str
    selection: object  # profiles.Selection
    needs_key: bool = False
    scheduler: object = None  # the engine's runtime.engine.Scheduler, with the settings it serves with


def prepare(artifact, profile: Optional[str] = None, device: str = "cpu", dtype: str = "float32",
            weights: str = "fp32", backend: str = "torch", public_key=None, model_name: Optional[str] = None,
            kv_cache: str = "model",
            max_concurrency: Optional[int] = None,
            draft_len: Optional[int] = None, progress: bool = False, api_key: Optional[str] = None,
            draft_tree=None, lookup: int | None = None,
            max_body_bytes: int = MAX_BODY_BYTES, max_seqs: int = MAX_SEQS, max_model_len: Optional[int] = None,
            max_queue: Optional[int] = None, prefill_chunk: int = 64, measure_cost: bool = True,
            phase=None) -> ServerPlan:
    """Verify and load `artifact` on `backend`, pick its best runnable profile (or `profile`), plan the
    KV cache (`max_seqs` slots of `max_model_len` positions, fewer when memory is short), build the app.
    `max_concurrency` / `draft_len` / `draft_tree` (a TreeShape; top-k 1: chains) override what the
    profile says, and so does `lookup` N: drafts copies of the context where it repeats (engine Request.lookup);
    `api_key` is required from clients on every route but /health; with `measure_cost` the engine's
    cost curve is measured at start when the profile has none. `phase(words)` is told each step as it
    starts (the CLI prints them: a start that takes half a minute says what it is doing)."""
    from specpack.runtime.api import load, require
    from specpack.runtime.engine.engine import check_tree
    from specpack.schemas.manifest import check_draft_len
    from specpack.serving.generate import engine_settings
    from specpack.tuning.profiles import select_profile

    require("fastapi", "serve")
    _check_options(max_concurrency, draft_len, api_key, max_body_bytes, max_seqs, max_model_len, max_queue,
                   prefill_chunk, lookup)
    say = phase or (lambda words: None)
    engines = {"max_sequences": max_seqs} if backend == "tensorrt" else {}  # the engines' sequence dimension
    say(f"verifying and loading {artifact} ({backend}, {weights} weights)")
    model = load(artifact, public_key=public_key, device=device, dtype=dtype, progress=progress, weights=weights,
                 kv_cache=kv_cache, backend=backend, **engines)
    selection = select_profile(model.manifest, device, dtype, wanted=profile, backend=backend, weights=weights,
                               kv_cache=kv_cache)
    if draft_len is not None:  # a block's slots, MTP's layers: refused at start, not clipped
        check_draft_len(model.manifest, draft_len)
    draft_len = draft_len or selection.draft_len
    tree = draft_tree if draft_tree is not None else selection.tree
    lookup = lookup if lookup is not None else selection.lookup
    if tree is not None:
        check_tree(tree)
    if selection.speculative and hasattr(model.drafter, "check_draft_len"):  # MTP: refuse at start, not per request
        model.drafter.check_draft_len(draft_len)
    slots, max_len = plan_kv(model, dtype, max_seqs, max_model_len)
    if measure_cost and selection.speculative:
        say("pricing drafts with this machine's cost curve (measured on the first start, then kept)")
    scheduler = Scheduler(model, slots, max_len, draft_len, speculative=selection.speculative,
                          max_queue=max_queue if max_queue is not None else 4 * slots, prefill_chunk=prefill_chunk,
                          max_concurrency=max_concurrency if max_concurrency is not None else selection.max_concurrency,
                          listener=Metrics(), tree=tree if tree is not None and tree.topk > 1 else None, lookup=lookup,
                          **engine_settings(model, selection, slots, measure_cost))
    name = model_name or model.manifest.name
    log.info("%s", selection.message)
    log.info("engine: %d slots of %d positions, queue %d, prefill chunk %d", slots, max_len,
             scheduler.max_queue, prefill_chunk)
    app = create_app(model, scheduler, name, api_key=api_key, max_body_bytes=max_body_bytes)
    return ServerPlan(app, name, selection, needs_key=api_key is not None, scheduler=scheduler)


def plan_kv(model, dtype: str, max_seqs: int, max_model_len: Optional[int]) -> tuple[int, int]:
    """(slots, positions per slot): `max_seqs` sequences of `max_model_len` (default: the model's
    context) positions, fewer sequences when their KV cache would take more than
    KV_MEMORY_FRACTION of the memory available now; an error when not even one fits."""
    from specpack.tuning.profiles import cache_dtype_name, kv_and_weight_bytes, this_machine

    max_len = min(max_model_len or model.context_length, model.context_length)
    _, per_slot = kv_and_weight_bytes(model.manifest, dtype, max_len, cache_dtype_name(model))
    budget = int(KV_MEMORY_FRACTION * this_machine(gpus=False).memory_available)
    slots = min(max_seqs, budget // max(per_slot, 1))
    if slots < 1:
        raise InputError(f"one sequence of {max_len} positions needs {per_slot / 2**20:.0f} MiB of KV cache, "
                         f"but only {budget / 2**20:.0f} MiB are budgeted ({KV_MEMORY_FRACTION:.0%} of the "
                         "memory available)", hint="lower --max-model-len")
    if slots < max_seqs:
        log.warning("KV cache: %d sequences of %d positions fit the memory budget, not %d", slots, max_len,
                    max_seqs)
    return slots, max_len


def _check_options(max_concurrency: Optional[int], draft_len: Optional[int], api_key: Optional[str],
                   max_body_bytes: int, max_seqs: int = MAX_SEQS, max_model_len: Optional[int] = None,
                   max_queue: Optional[int] = None, prefill_chunk: int = 64, lookup: int | None = None) -> None:
    from specpack.runtime.engine.stats import MAX_DRAFT_LEN

    problems = []
    if max_concurrency is not None and max_concurrency < 0:
        problems.append(f"--max-concurrency {max_concurrency} is negative")
    if draft_len is not None and not 1 <= draft_len <= MAX_DRAFT_LEN:
        problems.append(f"--draft-len {draft_len} is outside 1..{MAX_DRAFT_LEN}")
    if lookup is not None and not 0 <= lookup <= MAX_DRAFT_LEN:
        problems.append(f"--lookup {lookup} is outside 0..{MAX_DRAFT_LEN}")
    if api_key is not None and not re.fullmatch(r"[\x21-\x7e]+", api_key):
        problems.append("--api-key must be printable ASCII with no spaces (and not empty)")
    if max_body_bytes < 1:
        problems.append(f"--max-body-bytes {max_body_bytes} is not a positive byte count")
    if max_seqs < 1:
        problems.append(f"--max-seqs {max_seqs} must be at least 1")
    if max_model_len is not None and max_model_len < 2:
        problems.append(f"--max-model-len {max_model_len} must be at least 2")
    if max_queue is not None and max_queue < 0:
        problems.append(f"--max-queue {max_queue} is negative")
    if prefill_chunk < 1:
        problems.append(f"--prefill-chunk {prefill_chunk} must be at least 1")
    if problems:
        raise InputError("invalid serve options", problems=problems)


def run(plan: ServerPlan, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `plan` until interrupted."""
    import uvicorn

    if not plan.needs_key and not is_loopback(host):
        warn_without_key(log, host)
    log_each_request()
    uvicorn.run(plan.app, host=host, port=port, log_level=log_level)


def log_each_request() -> None:
    """The server's one line per finished request (tokens, TTFT, ms/token, acceptance) at the default
    level, beside uvicorn's access line: a server says what it served without -v."""
    from specpack.serving import metrics

    if not metrics.log.isEnabledFor(logging.INFO):
        metrics.log.setLevel(logging.INFO)


def create_app(model, worker: Scheduler, model_name: str, api_key: Optional[str] = None,
               max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI application serving `model` through the scheduler `worker` (started and stopped
    with the app).
    With `api_key`, every route but /health needs `Authorization: Bearer <api_key>`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="specpack", lifespan=lifespan, docs_url=None, redoc_url=None)
    # the last added runs first: count every answer, then check the key, then bound the body
    app.add_middleware(LimitBody, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)
    app.add_middleware(_CountRequests, metrics=worker.listener)
    state = _State(model, worker, model_name)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return JSONResponse(_validation_body(exc.errors()), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(oa.error_body(str(exc.detail), param=None, code=code), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "in_flight": worker.in_flight, "running": worker.running,
                "queued": worker.queue_depth, "slots": worker.slots}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(worker.listener.render(worker.gauges()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [state.card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        state.check_model(name)
        return state.card()

    @app.post("/v1/completions")
    async def completions(body: oa.CompletionRequest, request: Request):
        return await state.complete(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oa.ChatRequest, request: Request):
        return await state.complete(request, body, chat=True)

    return app


def _validation_body(errors) -> dict:
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return oa.error_body("the request body is not valid JSON: " + str(first.get("ctx", {}).get("error", "")))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in errors)
    return oa.error_body(message, param=param, code="missing_required_parameter"
                         if first.get("type") == "missing" else "invalid_value")


class _CountRequests:
    """Pure ASGI middleware counting HTTP responses by path and status (streams included)."""

    PATHS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"] if scope["path"] in self.PATHS else "other"
            self.metrics.count_request(path, status)


class _State:
    """What the handlers share: the model's tokenizer and limits, and the worker."""

    def __init__(self, model, worker: Scheduler, name: str):
        self.model, self.worker, self.name, self.created = model, worker, name, int(time.time())
        self.tokenizer, self.context = model.tokenizer, min(model.context_length, worker.max_len)

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "specpack"}

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{self.name}'.",
                           param="model", code="model_not_found")

    async def complete(self, request, body, chat: bool):
        from starlette.concurrency import run_in_threadpool

        self.check_model(body.model)
        ids, stop_ids = await run_in_threadpool(self._encode, body, chat)
        limit = body.token_limit() if chat else body.max_tokens
        job = Job(ids, self._budget(ids, limit, "messages" if chat else "prompt"), temperature=body.temperature,
                  top_p=body.top_p, seed=body.seed, stop=stop_ids)
        stream = self._text_stream(body)
        rid = oa.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            return self._stream(request, job, stream, rid, chat, body)
        self._submit(job)
        result = await _wait(request, job)
        stream.tokens.extend(result.tokens)
        text, finish = await run_in_threadpool(self._finish, stream, result, body)
        use = oa.usage(len(ids), len(result.tokens))
        return oa.chat_completion(rid, self.name, text, finish, use) if chat else \
            oa.completion(rid, self.name, text, finish, use)

    def _submit(self, job: Job) -> None:
        try:
            self.worker.submit(job)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc.message}; retry shortly", code="rate_limit_exceeded",
                           type_="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def _encode(self, body, chat: bool) -> tuple[list[int], list[list[int]]]:
        """Token ids of the prompt and of the stop strings (in the thread pool: bounded, but not free)."""
        from specpack.runtime.text import encode_prompt, stop_sequences
        from specpack.tuning.workload import encode_messages

        try:
            ids = encode_messages(self.tokenizer, body.messages) if chat else \
                encode_prompt(self.tokenizer, body.prompt, chat=False)
        except InputError as exc:
            raise ApiError(400, exc.message, param="messages" if chat else "prompt") from None
        return ids, stop_sequences(self.tokenizer, body.stop_list())

    def _budget(self, ids: list[int], limit: Optional[int], param: str) -> int:
        room = self.context - len(ids)
        if room < 1 or (limit is not None and limit > room):
            asked = len(ids) + (limit or 1)
            raise ApiError(400, f"This model's maximum context length is {self.context} tokens. However, you "
                                f"requested {asked} tokens ({len(ids)} in the {param}, {limit or 1} for the "
                                f"completion). Please reduce the length of the {param} or the completion.",
                           param=param if room < 1 else "max_tokens", code="context_length_exceeded")
        return limit if limit is not None else room

    def _text_stream(self, body):
        from specpack.runtime.text import TextStream

        return TextStream(self.tokenizer, lambda s: None, stops=body.stop_list())

    def _finish(self, stream, result, body) -> tuple[str, str]:
        """All text not yet sent, and OpenAI's finish reason (a stop string cut the text: stop)."""
        sent = stream.sent
        text = stream.flush()[sent:]
        finish = oa.FINISH[result.finish_reason]
        if finish == "length" and body.stop_list():
            raw = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
            finish = "stop" if any(s in raw for s in body.stop_list()) else finish
        return text, finish

    def _stream(self, request, job: Job, stream, rid: str, chat: bool, body):
        """Server-sent events. The worker only hands each step's token ids over; decoding them and
        matching stop strings happen here, off the worker's path: on the event loop while the text is
        short, in the thread pool once decoding it takes longer than the hop there."""
        from starlette.concurrency import run_in_threadpool

        loop, deltas, pending = asyncio.get_running_loop(), asyncio.Queue(), []
        job.on_tokens = lambda tokens: loop.call_soon_threadsafe(deltas.put_nowait, list(tokens))
        job.future.add_done_callback(lambda f: loop.call_soon_threadsafe(deltas.put_nowait, _DONE))
        stream.write = pending.append
        self._submit(job)
        usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(text: Optional[str], finish: Optional[str] = None, use: Optional[dict] = None) -> str:
            if chat:
                delta = {} if text is None else ({"role": "assistant", "content": ""} if text == "" else
                                                 {"content": text})
                data = oa.chat_chunk(rid, self.name, delta, finish, use)
            else:
                data = oa.completion(rid, self.name, text or "", finish, use, chunk=True)
                if use is not None:
                    data["choices"] = []
            return _event(data)

        def take() -> str:
            text = "".join(pending)
            pending.clear()
            return text

        async def events():
            if chat:
                yield chunk("")
            while (item := await _next(request, deltas, job)) is not _DONE:
                if item is _GONE:
                    return
                if stream.cheap():
                    stream(item)  # tens of µs: cheaper here than a thread-pool round trip (~115 µs)
                else:
                    await run_in_threadpool(stream, item)
                if pending:
                    yield chunk(take())
            try:
                result = job.future.result()
            except Cancelled:
                return
            except Exception:  # noqa: BLE001 - the status line is sent: report in the stream
                log.exception("generation failed")
                yield _event(oa.error_body("generation failed", type_="server_error"))
                return
            stream.write = lambda s: None
            text, finish = await run_in_threadpool(self._finish, stream, result, body)
            if text:
                yield chunk(text)
            yield chunk(None, finish)
            if usage:
                yield chunk(None, None, oa.usage(len(job.prompt_ids), len(result.tokens)))
            yield "data: [DONE]\n\n"

        return _sse_response(events(), job)


def _event(data: dict) -> str:
    import json

    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _sse_response(events, job: Job):
    from starlette.responses import StreamingResponse

    class _Events(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:  # however the stream ended (done, disconnect, error): free the slot
                _cancel(job)

    return _Events(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _cancel(job: Job) -> None:
    job.cancel.set()
    job.future.cancel()  # succeeds only while it is still queued


POLL_S = 0.25


async def _next(request, deltas: asyncio.Queue, job: Job):
    """The next text delta, _DONE when the job has finished, or _GONE (the job cancelled) when the
    client went away meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(deltas.get(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                _cancel(job)
                return _GONE


async def _wait(request, job: Job):
    """The job's result; cancels it when the client disconnects while waiting."""
    fut = asyncio.wrap_future(job.future)
    try:
        while True:
            done, _ = await asyncio.wait({fut}, timeout=POLL_S)
            if done:
                break
            if await request.is_disconnected():
                _cancel(job)
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
                raise ApiError(499, "the client closed the request", code="client_closed_request")
        return fut.result()
    except asyncio.CancelledError:
        _cancel(job)
        raise
    except Cancelled:
        raise ApiError(499, "the client closed the request", code="client_closed_request") from None
    except InputError as exc:
        raise ApiError(400, exc.message) from None
    except ApiError:
        raise
    except Exception:
        log.exception("generation failed")
        raise ApiError(500, "generation failed", type_="server_error") from None


class ServerThread:
    """Serve an app on a free loopback port from a background thread (tests, benchmarks).

        with ServerThread(plan.app) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", start_timeout: float = 30.0):
        self.app, self.host, self.start_timeout = app, host, start_timeout
        self.port = 0
        self._server = self._thread = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)
