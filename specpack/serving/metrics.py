"""What `/metrics` shows: counters of requests and generations, the scheduler's load, and latency
histograms, in Prometheus' text format. The scheduler tells it of every step and every finished
or failed job (it is the scheduler's `listener`)."""

from __future__ import annotations

import bisect
import logging
import threading

from specpack.runtime.engine.stats import GenerationStats

log = logging.getLogger("specpack.serving.requests")

SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LENGTHS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)
DEPTHS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16)


class Histogram:
    """Cumulative buckets, a sum and a count (Prometheus' histogram)."""

    def __init__(self, bounds):
        self.bounds, self.counts, self.sum, self.count = tuple(bounds), [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        for j in range(i, len(self.bounds)):
            self.counts[j] += 1
        self.sum += value
        self.count += 1

    def samples(self, name: str) -> list[tuple[str, str, float]]:
        out = [(f"{name}_bucket", f'le="{b}"', c) for b, c in zip(self.bounds, self.counts)]
        out.append((f"{name}_bucket", 'le="+Inf"', self.count))
        return out + [(f"{name}_sum", "", self.sum), (f"{name}_count", "", self.count)]


class Metrics:
    """Counters and histograms of the server; gauges come from the scheduler at render time."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.generations = {True: 0, False: 0}
        self.cancelled = self.failed = self.steps = 0
        self.all = GenerationStats()  # every finished generation
        self.spec = GenerationStats()  # the speculative ones: acceptance figures
        self.ttft, self.per_token = Histogram(SECONDS), Histogram(SECONDS)
        self.rows, self.acceptance = Histogram(ROWS), Histogram(LENGTHS)

    def count_request(self, path: str, status: int) -> None:
        with self.lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1

    # ---- the scheduler's listener -------------------------------------------------------

    def step(self, rows: int, running: int, queued: int, seconds: float) -> None:
        with self.lock:
            self.steps += 1
            self.rows.observe(rows)

    def finished(self, job, result) -> None:
        s = result.stats
        per_token = (s.total_s - (job.first_token_s or 0.0)) / max(1, s.new_tokens - 1)
        with self.lock:
            self.generations[job.used_speculation] += 1
            self.all.add(s)
            if job.used_speculation:
                self.spec.add(s)
                self.acceptance.observe(s.acceptance_length)
            if job.first_token_s is not None:
                self.ttft.observe(job.first_token_s)
            if s.new_tokens > 1:
                self.per_token.observe(per_token)
        log.info("request done: prompt %d, new %d, %s, ttft %.0f ms, %.1f ms/token, %s", s.prompt_tokens,
                 s.new_tokens, result.finish_reason, 1e3 * (job.first_token_s or 0.0), 1e3 * per_token,
                 f"AL {s.acceptance_length:.2f}" if job.used_speculation else "no speculation")

    def ended(self, job, cancelled: bool) -> None:
        with self.lock:
            if cancelled:
                self.cancelled += 1
            else:
                self.failed += 1

    # ---- rendering ------------------------------------------------------------------------

    def render(self, gauges: dict[str, tuple[float, str]]) -> str:
        """Prometheus text exposition of every counter and histogram plus the given gauges (name -> (value, help))."""
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
                ("specpack_engine_steps_total", self.steps, "Engine steps (one target forward each)."),
                ("specpack_spec_steps_total", self.spec.steps, "Target verification steps while speculating."),
                ("specpack_drafted_steps_total", self.spec.drafted_steps,
                 "Of those, verifications of the drafter's own drafts (the rest drafted nothing or copied)."),
                ("specpack_probe_steps_total", self.spec.probe_steps,
                 "Drafted verifications the cost model had not asked for (probes of the drafter's acceptance)."),
                ("specpack_draft_tokens_proposed_total", self.spec.proposed, "Draft tokens verified."),
                ("specpack_draft_tokens_accepted_total", self.spec.accepted, "Draft tokens accepted.")]:
                out += _family(name, "counter", help_, [("", value)])
            out += _family("specpack_acceptance_length", "gauge", "The drafter's: 1 + its accepted draft tokens / the "
                           "steps that verified its drafts, since start.", [("", self.spec.acceptance_length)])
            out += _family("specpack_tokens_per_step", "gauge", "1 + accepted / verification steps while speculating, "
                           "every step counted.", [("", self.spec.tokens_per_step)])
            out += _family("specpack_position_acceptance", "gauge",
                           "Conditional acceptance rate of each draft position since start.",
                           [(f'position="{k}"', r) for k, r in enumerate(self.spec.position_acceptance)])
            out += _family("specpack_position_tried_total", "counter", "Verifications of each draft position.",
                           [(f'position="{k}"', t) for k, t in enumerate(self.spec.position_tried)])
            for name, hist, help_ in [
                ("specpack_accepted_depth", _depths(self.spec.depth_steps),
                 "Depth of the accepted draft path (a chain's accepted drafts) per verification step."),
                ("specpack_time_to_first_token_seconds", self.ttft, "Seconds from arrival to the first token."),
                ("specpack_time_per_output_token_seconds", self.per_token, "Seconds per token after the first."),
                ("specpack_rows_per_step", self.rows, "Rows in each engine step's target forward."),
                ("specpack_request_acceptance_length", self.acceptance,
                 "Acceptance length of each finished speculative request.")]:
                out += _histogram(name, help_, hist)
        for name, (value, help_) in gauges.items():
            out += _family(name, "gauge", help_, [("", value)])
        return out


def _depths(depth_steps: list[int]) -> Histogram:
    """The histogram of accepted depths from per-depth step counts."""
    hist = Histogram(DEPTHS)
    for d, n in enumerate(depth_steps):
        i = bisect.bisect_left(hist.bounds, d)
        for j in range(i, len(hist.bounds)):
            hist.counts[j] += n
        hist.sum += d * n
        hist.count += n
    return hist


def _family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> str:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples]
    return "\n".join(lines) + "\n"


def _histogram(name: str, help_: str, hist: Histogram) -> str:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    lines += [f"{n}{{{labels}}} {v}" if labels else f"{n} {v}" for n, labels, v in hist.samples(name)]
    return "\n".join(lines) + "\n"
