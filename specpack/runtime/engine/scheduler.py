"""Continuous batching: the engine on a worker thread, fed by a bounded queue.

Jobs join between steps as slots free up and leave on EOS / stop / length / cancel; a freed slot is
reused at the next step. The queue is bounded (`QueueFull` past `max_queue`: the server answers
429), so memory never grows with the load. A job whose `cancel` is set (its client went away) is
dropped before the next step, freeing its slot within one step. `serve` and `tune` share this.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

from specpack.errors import SpecpackError
from specpack.runtime.engine.engine import Engine, Generation, Request
from specpack.runtime.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class QueueFull(SpecpackError):
    """The scheduler's queue is at its limit; try again shortly."""


class Cancelled(Exception):
    """The job's client went away; its slot was freed."""


@dataclass
class Job:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: list[list[int]] = field(default_factory=list)
    on_tokens: Optional[Callable[[list[int]], None]] = None  # called on the scheduler's thread
    speculative: Optional[bool] = None  # None: the scheduler's default
    cancel: threading.Event = field(default_factory=threading.Event)
    future: Future = field(default_factory=Future)  # -> GenerationResult, or Cancelled
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: Optional[float] = None  # seconds from submission to the first token
    used_speculation: bool = False


class Scheduler:
    """Runs `Job`s on `model` (a SpecModel: target + drafter) with up to `slots` sequences decoding
    together, each in a slot of `max_len` positions. Speculation (when on) drafts what the `cost`
    model and each sequence's acceptance say; with `max_concurrency`, not at all while more
    requests than that are in flight (a profile's measured crossover); with `tree` (a TreeShape)
    drafts are trees of that shape, `draft_len` deep. `listener` (optional) is
    told of every step (`step(rows, running, queued, seconds)`) and every finished or failed job
    (`finished(job, result)`, `ended(job, cancelled)`)."""

    def __init__(self, model, slots: int = 8, max_len: Optional[int] = None, draft_len: int = 4,
                 speculative: bool = True, max_queue: int = 64, prefill_chunk: Optional[int] = 64,
                 adaptive: Optional[bool] = None, cost=None, max_concurrency: Optional[int] = None,
                 listener=None, prior=None, tree=None, lookup: int = 0):
        self.model, self.draft_len, self.max_queue, self.listener = model, draft_len, max_queue, listener
        self.tree = tree  # drafters.base.TreeShape of every speculative job's drafts; None: chains
        self.lookup = lookup  # every speculative job's prompt-lookup draft length (Request.lookup; 0: off)
        self.max_concurrency = max_concurrency
        self.speculative = speculative and model.drafter is not None
        self.adaptive = bool(getattr(model.drafter, "adaptive_draft_len", False)) if adaptive is None else adaptive
        max_len = max_len or model.context_length
        self.engine = Engine(model.target, model.drafter if self.speculative else None, slots, max_len,
                             prefill_chunk, cost, **({"prior": prior} if prior else {}))
        self._queue: collections.deque[Job] = collections.deque()
        self._running: dict[int, tuple[Job, Generation]] = {}  # id(generation) -> (job, generation)
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> "Scheduler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Scheduler":
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specpack-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the jobs already running or queued, then end the thread."""
        if self._thread is not None:
            with self._wake:
                self._stopping = True
                self._wake.notify_all()
            self._thread.join(timeout)
            self._thread = None

    # ---- submitting ------------------------------------------------------------------------

    def submit(self, job: Job) -> Future:
        """Queue `job`; raises QueueFull when `max_queue` jobs are already waiting."""
        with self._wake:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are already waiting (the limit)",
                                hint="retry after a short wait, or raise --max-queue")
            self._queue.append(job)
            self._wake.notify()
        return job.future

    @property
    def slots(self) -> int:
        return self.engine.slots

    @property
    def max_len(self) -> int:
        return self.engine.max_len

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished: the running ones plus the queued ones."""
        return self.running + self.queue_depth

    def speculation_now(self) -> bool:
        """Whether the next step may draft (speculation on, load within the measured limit)."""
        return self.speculative and (self.max_concurrency is None or self.in_flight <= self.max_concurrency)

    def gauges(self) -> dict[str, tuple[float, str]]:
        """Live gauges for /metrics: name -> (value, help)."""
        limit = -1 if self.max_concurrency is None else self.max_concurrency
        return {"specpack_requests_running": (self.running, "Sequences decoding in the engine."),
                "specpack_queue_depth": (self.queue_depth, "Requests waiting for a slot."),
                "specpack_requests_in_flight": (self.in_flight, "Requests running or waiting."),
                "specpack_slots": (self.slots, "Sequences the engine decodes together at most."),
                "specpack_queue_limit": (self.max_queue, "Waiting requests beyond which new ones get 429."),
                "specpack_speculative_enabled": (int(self.speculation_now()), "1 while steps may draft."),
                "specpack_max_concurrency": (limit, "Requests in flight up to which speculation stays on "
                                                    "(-1: no limit)."),
                "specpack_draft_len": (self.draft_len, "The longest draft per sequence when speculating (a tree's "
                                                       "depth)."),
                "specpack_draft_tree_topk": (self.tree.topk if self.tree else 1,
                                             "Children per draft tree node (1: chains)."),
                "specpack_draft_tree_nodes": (self.tree.nodes if self.tree else 0,
                                              "Draft tree nodes per sequence and step at most (0: chains).")}

    # ---- the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._running and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._queue and not self._running:
                    return
            self._drop_cancelled()
            self._admit()
            if self._running:
                self._step()

    def _admit(self) -> None:
        """Move queued jobs into free slots (between steps)."""
        while self.engine.has_room:
            with self._wake:
                if not self._queue:
                    return
                job = self._queue.popleft()
            if job.cancel.is_set() or not job.future.set_running_or_notify_cancel():
                self._end(job, Cancelled())
                continue
            try:
                seq = self.engine.add(self._request(job))
            except Exception as exc:  # noqa: BLE001 - a request the engine cannot run: its client is told
                self._end(job, exc)
                continue
            self._running[id(seq)] = (job, seq)

    def _request(self, job: Job) -> Request:
        speculative = self.speculative if job.speculative is None else job.speculative and self.speculative
        job.used_speculation = speculative

        def on_tokens(tokens: list[int]) -> None:
            if job.first_token_s is None:
                job.first_token_s = time.perf_counter() - job.submitted
            if job.cancel.is_set():
                raise Cancelled()
            if job.on_tokens is not None:
                job.on_tokens(tokens)

        return Request(list(job.prompt_ids), job.max_new_tokens,
                       SamplingParams(float(job.temperature), int(job.top_k), float(job.top_p)), job.seed,
                       tuple(self.model.target.spec.eos_token_ids), tuple(tuple(s) for s in job.stop if s),
                       speculative, self.draft_len, self.adaptive, on_tokens, tree=self.tree, lookup=self.lookup)

    def _drop_cancelled(self) -> None:
        for key, (job, seq) in list(self._running.items()):
            if job.cancel.is_set():
                self.engine.cancel(seq)
                del self._running[key]
                self._end(job, Cancelled())

    def _step(self) -> None:
        t0 = time.perf_counter()
        rows = self.engine.last_rows
        self.engine.speculate = self.speculation_now()
        try:
            done = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a broken step fails its jobs, never the server
            log.exception("engine step failed")
            for key, (job, seq) in list(self._running.items()):
                self.engine.cancel(seq, "error")
                del self._running[key]
                self._end(job, exc)
            return
        if self.listener is not None and hasattr(self.listener, "step"):
            self.listener.step(self.engine.last_rows or rows, len(self._running), self.queue_depth,
                               time.perf_counter() - t0)
        for seq in done:
            job, _ = self._running.pop(id(seq))
            if seq.error is not None:
                self._end(job, Cancelled() if isinstance(seq.error, Cancelled) else seq.error)
            else:
                result = seq.result()
                if self.listener is not None:
                    self.listener.finished(job, result)
                job.future.set_result(result)

    def _end(self, job: Job, exc: BaseException) -> None:
        if self.listener is not None:
            self.listener.ended(job, cancelled=isinstance(exc, Cancelled))
        if job.future.running():
            job.future.set_exception(exc)
        elif not job.future.done():
            job.future.set_running_or_notify_cancel() and job.future.set_exception(exc)

