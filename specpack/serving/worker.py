"""One generation at a time on a worker thread, fed by a queue: what `serve` and `tune` share.

`SpecModel` is not re-entrant, so every request is a `Job` the worker runs in turn. Whether a job
speculates is decided when it starts: on while the requests in flight (running + queued) are within
the profile's concurrency limit, off above it. A job whose `cancel` is set stops between decoding
steps (its `on_tokens` hook raises), which frees the worker for the next one.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

from specpack.runtime.engine.stats import GenerationStats

log = logging.getLogger(__name__)
COUNTERS = ("prompt_tokens", "new_tokens", "steps", "proposed", "accepted", "prefill_s", "draft_s", "verify_s",
            "total_s")


def add_stats(total: GenerationStats, s: GenerationStats) -> None:
    """Add the counters of `s` into `total` (per-position lists padded to the longer one)."""
    for name in COUNTERS:
        setattr(total, name, getattr(total, name) + getattr(s, name))
    for k, (t, a) in enumerate(zip(s.position_tried, s.position_accepted)):
        if k == len(total.position_tried):
            total.position_tried.append(0)
            total.position_accepted.append(0)
        total.position_tried[k] += t
        total.position_accepted[k] += a


class Cancelled(Exception):
    """The job's client went away; raised inside the decoding loop to stop it between steps."""


@dataclass
class Job:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: list[list[int]] = field(default_factory=list)
    on_tokens: Optional[Callable[[list[int]], None]] = None  # called on the worker thread
    speculative: Optional[bool] = None  # None: the worker decides from the load
    cancel: threading.Event = field(default_factory=threading.Event)
    future: Future = field(default_factory=Future)  # -> GenerationResult, or Cancelled
    used_speculation: bool = False


class Metrics:
    """Counters and gauges of the generations, rendered in Prometheus' text format."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.generations = {True: 0, False: 0}
        self.cancelled = self.failed = 0
        self.all = GenerationStats()  # every finished generation
        self.spec = GenerationStats()  # the speculative ones: acceptance figures

    def count_request(self, path: str, status: int) -> None:
        with self.lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1

    def count_generation(self, job: Job, stats) -> None:
        with self.lock:
            self.generations[job.used_speculation] += 1
            add_stats(self.all, stats)
            if job.used_speculation:
                add_stats(self.spec, stats)

    def count_end(self, cancelled: bool) -> None:
        with self.lock:
            if cancelled:
                self.cancelled += 1
            else:
                self.failed += 1

    def render(self, gauges: dict[str, tuple[float, str]]) -> str:
        """Prometheus text exposition of every counter plus the given gauges (name -> (value, help))."""
        with self.lock:
            out = _family("specpack_http_requests_total", "counter", "HTTP requests by path and status.",
                          [(f'path="{p}",status="{s}"', n) for (p, s), n in sorted(self.requests.items())])
            out += _family("specpack_generations_total", "counter", "Finished generations by mode.",
                           [(f'speculative="{str(k).lower()}"', v) for k, v in self.generations.items()])
            for name, value, help_ in [
                ("specpack_generations_cancelled_total", self.cancelled, "Generations stopped by a disconnect."),
                ("specpack_generations_failed_total", self.failed, "Generations that raised an error."),
                ("specpack_prompt_tokens_total", self.all.prompt_tokens, "Prompt tokens of finished generations."),
                ("specpack_completion_tokens_total", self.all.new_tokens, "Tokens generated."),
                ("specpack_spec_steps_total", self.spec.steps, "Target verification steps while speculating."),
                ("specpack_draft_tokens_proposed_total", self.spec.proposed, "Draft tokens verified."),
                ("specpack_draft_tokens_accepted_total", self.spec.accepted, "Draft tokens accepted.")]:
                out += _family(name, "counter", help_, [("", value)])
            out += _family("specpack_acceptance_length", "gauge", "1 + accepted / steps since start.",
                           [("", self.spec.acceptance_length)])
            out += _family("specpack_position_acceptance", "gauge",
                           "Conditional acceptance rate of each draft position since start.",
                           [(f'position="{k}"', r) for k, r in enumerate(self.spec.position_acceptance)])
            out += _family("specpack_position_tried_total", "counter", "Verifications of each draft position.",
                           [(f'position="{k}"', t) for k, t in enumerate(self.spec.position_tried)])
        for name, (value, help_) in gauges.items():
            out += _family(name, "gauge", help_, [("", value)])
        return out


def _family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> str:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples]
    return "\n".join(lines) + "\n"


class Worker:
    """Runs `Job`s on `model` one at a time. `max_concurrency` None: no limit on speculation."""

    def __init__(self, model, draft_len: int, speculative: bool = True, max_concurrency: Optional[int] = None,
                 metrics: Optional[Metrics] = None):
        self.model, self.draft_len = model, draft_len
        self.speculative, self.max_concurrency = speculative and model.drafter is not None, max_concurrency
        self.metrics = metrics or Metrics()
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Worker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Worker":
        self._thread = threading.Thread(target=self._loop, name="specpack-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the jobs already queued, then end the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> Future:
        with self._lock:
            self._in_flight += 1
        self._queue.put(job)
        return job.future

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished: the one running plus the queued ones."""
        return self._in_flight

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def speculation_now(self, in_flight: Optional[int] = None) -> bool:
        """Whether a job starting with `in_flight` requests in flight (itself included) speculates."""
        n = self._in_flight if in_flight is None else in_flight
        return self.speculative and (self.max_concurrency is None or n <= self.max_concurrency)

    def gauges(self) -> dict[str, tuple[float, str]]:
        """Live gauges for /metrics: name -> (value, help)."""
        limit = -1 if self.max_concurrency is None else self.max_concurrency
        return {"specpack_queue_depth": (self.queue_depth, "Requests waiting for the worker."),
                "specpack_requests_in_flight": (self.in_flight, "Requests running or waiting."),
                "specpack_speculative_enabled": (int(self.speculation_now(self.in_flight + 1)),
                                                 "1 when a request arriving now would speculate."),
                "specpack_max_concurrency": (limit, "Requests in flight up to which speculation stays on "
                                                    "(-1: no limit)."),
                "specpack_draft_len": (self.draft_len, "Draft tokens per step when speculating.")}

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            if not job.future.set_running_or_notify_cancel():  # its waiter gave up while it was queued
                self._finish(job, exc=Cancelled())
            elif job.cancel.is_set():
                self._finish(job, exc=Cancelled())
            else:
                self._run(job)

    def _run(self, job: Job) -> None:
        job.used_speculation = self.speculation_now() if job.speculative is None else \
            job.speculative and self.model.drafter is not None

        def on_tokens(tokens: list[int]) -> None:
            if job.cancel.is_set():
                raise Cancelled()
            if job.on_tokens is not None:
                job.on_tokens(tokens)

        try:
            result = self.model.generate(job.prompt_ids, max_new_tokens=job.max_new_tokens,
                                         draft_len=self.draft_len, temperature=job.temperature, top_k=job.top_k,
                                         top_p=job.top_p, seed=job.seed, stop=job.stop,
                                         speculative=job.used_speculation, on_tokens=on_tokens)
        except Exception as exc:  # noqa: BLE001 - handed to the waiting client, never lost
            if not isinstance(exc, Cancelled):
                log.exception("generation failed")
            self._finish(job, exc=exc)
            return
        self.metrics.count_generation(job, result.stats)
        self._finish(job, result)

    def _finish(self, job: Job, result=None, exc: Optional[BaseException] = None) -> None:
        """Free the slot first, so a client that reacts at once sees the load without this job."""
        with self._lock:
            self._in_flight -= 1
        if exc is not None:
            self.metrics.count_end(cancelled=isinstance(exc, Cancelled))
            if job.future.running():
                job.future.set_exception(exc)
        else:
            job.future.set_result(result)
