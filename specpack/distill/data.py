"""Training data for `distill`: token sequences and the target's teacher-forced features.

Sequences come from a JSONL file (`{"text"}`, `{"messages"}` or `{"prompt", "completion"}` lines) or
are the target's own continuations of seed prompts (`{"prompt"}` raw, `{"messages"}` chat, or the
built-in seeds): greedy, plus sampled ones for more text per seed. Generation runs through
specpack's batched engine (many sequences per target forward, row-exact kernels) and records the
features of the generating forwards; given text goes through specpack's own decoder,
teacher-forced. Both are cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from specpack._atomic import save_safetensors
from specpack.errors import InputError
from specpack.runtime.engine import Engine, Generation, Request, SamplingParams

log = logging.getLogger(__name__)
DATA_VERSION = 5  # 5: self-generation through specpack's engine (keyed sampling)
FEATURES = "features.safetensors"


# ---- reading JSONL ----

@dataclass(frozen=True)
class Record:
    """One line of a data file: `kind` is text | messages | prompt; `value` a str or message list."""

    kind: str
    value: object
    completion: str | None = None


def read_jsonl(path) -> list[Record]:
    """Parse a data file; every bad line is reported at once, with its line number."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"data file '{path}' does not exist", hint="pass a JSONL file of {\"text\": ...} lines")
    records, problems = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(_record(json.loads(line)))
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not JSON ({exc.msg} at column {exc.colno})")
        except ValueError as exc:
            problems.append(f"line {number}: {exc}")
    if problems:
        raise InputError(f"data file '{path}' has {len(problems)} bad lines", problems=problems[:20],
                         hint='each line: {"text": ...}, {"messages": [{"role", "content"}, ...]}, '
                              'or {"prompt": ...} with an optional "completion"')
    if not records:
        raise InputError(f"data file '{path}' holds no records", hint="add JSONL lines")
    return records


def _record(obj) -> Record:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("text"), str) and obj["text"]:
        return Record("text", obj["text"])
    if "messages" in obj:
        msgs = obj["messages"]
        if not (isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs)):
            raise ValueError("'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
        return Record("messages", msgs)
    if isinstance(obj.get("prompt"), str) and obj["prompt"]:
        completion = obj.get("completion")
        if completion is not None and not isinstance(completion, str):
            raise ValueError("'completion' must be a string")
        return Record("prompt", obj["prompt"], completion)
    raise ValueError("no non-empty 'text', 'messages' or 'prompt' field")


# ---- tokenising ----

def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def text_sequences(records: list[Record], tokenizer) -> list[list[int]]:
    """Records used as they are (no generation): whole conversations, texts, prompt + completion."""
    seqs = []
    for r in records:
        if r.kind == "messages":
            if not has_chat_template(tokenizer):
                raise InputError("the data has 'messages' lines but the target's tokenizer has no chat template",
                                 hint="use 'text' lines for this target")
            seqs.append(chat_ids(tokenizer, r.value, add_generation_prompt=False))
        else:
            seqs.append(tokenizer(r.value + (r.completion or "")).input_ids)
    return [s for s in seqs if len(s) >= 2]


def prompt_ids(records: list[Record], tokenizer) -> list[list[int]]:
    """Seeds for self-generation: chat turns get the generation prompt, raw prompts stay raw."""
    out = []
    for r in records:
        if r.kind == "messages":
            msgs = r.value[:-1] if r.value[-1]["role"] == "assistant" else r.value
            out.append(chat_ids(tokenizer, msgs, add_generation_prompt=True))
        else:
            out.append(tokenizer(r.value).input_ids)
    return out


# ---- built-in seed prompts (open chat and code) ----

_STORY = ["a baker", "a retired astronaut", "a shy robot", "a chess champion", "a girl and her kite",
          "a lost dog", "an old fisherman", "a young wizard", "a night-shift nurse", "a talking tree",
          "a clockmaker", "a street musician", "a curious cat", "a mountain guide", "a tired detective",
          "a small dragon", "a school teacher", "a delivery driver", "an inventor", "a young gardener"]
_EVENT = ["learns to trust again", "finds a hidden door", "wins an unexpected prize", "gets lost in a city",
          "discovers a strange map", "makes a new friend", "loses something precious", "must keep a secret",
          "travels back in time", "saves a village"]
_TIPS = ["staying focused while studying", "saving money", "running a first marathon", "sleeping better",
         "writing a good essay", "keeping plants alive", "public speaking", "starting a small business",
         "cooking for a large group", "travelling on a budget", "working from home", "making friends in a new city",
         "taking better photos", "learning to swim", "reading more books", "managing stress",
         "preparing for an exam", "moving to a new apartment", "training a puppy", "negotiating a salary",
         "writing clean code", "choosing a laptop", "planning a road trip", "staying motivated at the gym"]
_EXPLAIN = ["how rainbows form", "what a black hole is", "how vaccines work", "why leaves change colour",
            "how the internet works", "what inflation is", "how airplanes stay in the air",
            "what photosynthesis is", "why we have seasons", "how a battery stores energy",
            "what machine learning is", "how tides work", "what DNA is", "how a refrigerator works",
            "why the ocean is salty", "what gravity is", "how volcanoes erupt", "what a computer virus is",
            "how money is created", "why we dream", "how earthquakes happen", "what electricity is",
            "how bees make honey", "what an atom is"]
_AUDIENCE = ["a child", "a beginner", "a high school student", "my grandmother"]
_POEM = ["autumn leaves", "a quiet morning", "the moon", "friendship", "a mountain river", "city lights",
         "the first snow", "an old library", "a summer storm", "coffee", "a train journey", "the desert",
         "a lost letter", "spring flowers", "the stars", "a busy market"]
_COMPARE = [("a virus", "a bacterium"), ("weather", "climate"), ("a list", "a tuple in Python"),
            ("RAM", "a hard drive"), ("speed", "velocity"), ("a crocodile", "an alligator"),
            ("TCP", "UDP"), ("baking soda", "baking powder"), ("a comet", "an asteroid"),
            ("affect", "effect"), ("a lake", "a pond"), ("HTML", "CSS"), ("a frog", "a toad"),
            ("stocks", "bonds"), ("a compiler", "an interpreter"), ("empathy", "sympathy")]
_HOWTO = ["change a flat tyre", "make a cup of green tea", "write a cover letter", "plan a birthday party",
          "start a vegetable garden", "learn to play the guitar", "prepare for a job interview",
          "organise my week", "bake bread at home", "set up a budget", "clean a laptop keyboard",
          "write a thank-you note", "start running", "fold a paper airplane", "make a good first impression",
          "back up my photos", "care for a cactus", "remember names better", "stop procrastinating",
          "make pancakes"]
_JOBS = ["firefighter", "pilot", "farmer", "librarian", "software engineer", "chef", "zookeeper",
         "marine biologist", "architect", "dentist", "bus driver", "journalist"]
_FACTS = ["octopuses", "the Moon", "honey", "penguins", "the Roman Empire", "volcanoes", "the human brain",
          "elephants", "the Amazon rainforest", "chocolate", "lightning", "owls", "the Pacific Ocean",
          "bicycles", "tea", "the Eiffel Tower"]
_CODE_TASK = ["reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
              "counts the vowels in a sentence", "merges two sorted lists", "removes duplicates from a list",
              "computes the factorial of n", "finds the largest element of a list",
              "checks whether a string is a palindrome", "converts Celsius to Fahrenheit",
              "flattens a nested list", "counts word frequencies in a text", "sorts a list of dictionaries by a key",
              "reads a CSV file and sums a column", "validates an email address", "computes the average of a list",
              "finds the second smallest number in a list", "capitalises every word in a sentence",
              "returns the greatest common divisor of two numbers", "checks whether two strings are anagrams",
              "groups a list of words by their first letter", "converts a binary string to an integer",
              "returns all even numbers from a list", "computes the sum of the digits of a number",
              "finds the most common element in a list", "rotates a list by k positions",
              "checks whether brackets in a string are balanced", "counts lines in a text file",
              "returns the intersection of two lists", "converts a number to Roman numerals"]
_LANG = ["Python", "JavaScript"]
_CODE_EXPLAIN = ["for i in range(5):\n    print(i * 2)", "x = [n ** 2 for n in range(10) if n % 2 == 0]",
                 "def f(a, b=2):\n    return a ** b", "with open('data.txt') as f:\n    lines = f.readlines()",
                 "d = {k: len(k) for k in ['a', 'bb', 'ccc']}", "while n > 1:\n    n = n // 2\n    steps += 1",
                 "try:\n    x = int(s)\nexcept ValueError:\n    x = 0", "nums.sort(key=lambda v: -v)"]
_CLASSES = ["a bank account with deposit and withdraw methods", "a stack with push, pop and peek",
            "a simple to-do list", "a rectangle with area and perimeter methods", "a queue built on two stacks",
            "a temperature converter", "a counter that can be reset", "a shopping cart with a total price"]


def builtin_prompts() -> list[str]:
    """~330 chat prompts covering open chat (~250) and code (~80), interleaved, in a fixed order."""
    n_ev = len(_EVENT)
    chat = [f"Tell me a short story about {w} who {_EVENT[(i + j) % n_ev]}." for i, w in enumerate(_STORY)
            for j in (0, 3)]
    chat += [f"Give me three tips for {t}." for t in _TIPS]
    chat += [f"What are common mistakes people make when {t}?" for t in _TIPS]
    chat += [f"Explain {e} to {_AUDIENCE[(i + j) % 4]}." for i, e in enumerate(_EXPLAIN) for j in (0, 1)]
    chat += [f"Write a short poem about {p}." for p in _POEM] + [f"Write a haiku about {p}." for p in _POEM]
    chat += [f"What is the difference between {a} and {b}?" for a, b in _COMPARE]
    chat += [f"How do I {h}?" for h in _HOWTO]
    chat += [f"Describe a typical day of a {j}." for j in _JOBS]
    chat += [f"List five interesting facts about {f}." for f in _FACTS]
    code = [f"Write a {lang} function that {task}." for task in _CODE_TASK for lang in _LANG]
    code += [f"Explain what this code does:\n\n{c}" for c in _CODE_EXPLAIN]
    code += [f"Write a Python class for {c}." for c in _CLASSES]
    ratio = len(chat) // len(code) + 1  # spread the code prompts evenly through the chat ones
    out = []
    for i, c in enumerate(chat):
        out.append(c)
        if i % ratio == ratio - 1 and code:
            out.append(code.pop(0))
    return out + code


def builtin_records(chat: bool) -> list[Record]:
    prompts = builtin_prompts()
    if chat:
        return [Record("messages", [{"role": "user", "content": p}]) for p in prompts]
    return [Record("prompt", f"Question: {p}\nAnswer:") for p in prompts]


# ---- self-generation: specpack's batched engine, features recorded on the way ----

def generate(target_dir: Path, prompts: list[list[int]], max_new_tokens: int, eos: tuple[int, ...],
             capture: tuple[int, ...], cache: Path, sampling: "Sampling", batch_size: int = 64,
             progress: bool = False) -> "Features":
    """The target's continuations of `prompts` (pass 0 greedy, passes 1.. sampled, see `Sampling`)
    through specpack's batched engine (one target forward per step for up to `SLOTS` sequences; the
    greedy pass is what `specpack run` gives), with the states of every position recorded by the
    generating forwards themselves (no second pass). Batches are cached as they finish, so an
    interrupted run resumes at the next batch."""
    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    jobs = [(k, i) for k in range(sampling.passes) for i in range(len(batches))]
    files = {job: cache / f"generated-{job[0]:02d}-{job[1]:05d}.safetensors" for job in jobs}
    todo = [job for job in jobs if not files[job].is_file()]
    if todo:
        from specpack.runtime.kernels.accelerate import use_cpu_kernels
        from specpack.runtime.models.weights import load_target

        target = load_target(target_dir)
        use_cpu_kernels(target)
        engine = Engine(target, None, slots=min(SLOTS, batch_size), max_len=max(map(len, prompts)) + max_new_tokens + 1,
                        capture=(*capture, target.spec.num_layers))
        total = len(prompts) * sampling.passes
        bar = _bar(total, "generating", progress, initial=total - sum(len(batches[i]) for _, i in todo))
        for k, i in todo:
            reqs = [Request(prompts[r], max_new_tokens + 1, SamplingParams(sampling.temperature if k else 0.0),
                            seed=sampling.seed_of(k, i) * 65_536 + r, eos=eos, speculative=False, record=True)
                    for r in batches[i]]
            with torch.inference_mode():
                done = engine.generate_all(reqs)
            Features.concat([_features(target, g, r, len(capture)) for g, r in zip(done, batches[i])]).save(files[(k, i)])
            bar.update(len(batches[i]))
        bar.close()
    return Features.concat([Features.load(files[job]) for job in jobs])


SLOTS = 16  # sequences the engine decodes together while generating


def _features(target, g: Generation, group: int, n_aux: int) -> "Features":
    """What the head trains on from one generation: its tokens with recorded states (the prompt and
    every generated token fed back; one more was generated than asked, so a full-length row keeps
    all it was asked for), the aux states, the final-norm output and the target's argmax."""
    states = torch.cat([x for x, _ in g.recorded])  # [rows, n_aux·H + H]
    pred = torch.cat([y for _, y in g.recorded])
    rows, width = states.shape[0], states.shape[1] - target.spec.hidden_size
    prompt = g.req.prompt
    tokens = torch.tensor(prompt + g.new[: rows - len(prompt)], dtype=torch.long)
    with torch.inference_mode():
        final = target.norm(states[:, width:])
    return Features(tokens=tokens, aux=states[:, :width].half(), final=final.half(), pred=pred,
                    offsets=torch.tensor([0, rows]), starts=torch.tensor([len(prompt)]), groups=torch.tensor([group]))


@dataclass(frozen=True)
class Sampling:
    """How many continuations each seed prompt gets: the greedy one, then `passes - 1` sampled at
    `temperature` (more text from the target's own distribution than the seeds alone give; the
    labels stay the target's argmax at every position). Seeded per (pass, batch, prompt)."""

    passes: int = 1
    temperature: float = 0.7
    seed: int = 0

    def seed_of(self, k: int, batch: int) -> int:
        return self.seed * 1_000_003 + k * 10_007 + batch


# ---- teacher-forced features from specpack's decoder ----

FIELDS = ("tokens", "aux", "final", "pred", "offsets", "starts", "groups")


@dataclass
class Features:
    """Concatenated sequences: tokens [N]; aux [N, n_aux·H] (fp16) and final [N, H] (fp16, the target's
    normed last hidden state) at each position; pred [N] the target's argmax there (its next token);
    offsets [S+1] sequence boundaries; starts [S] where in each sequence the target's own text
    begins (after the prompt; 0 for given text): the head only ever drafts from there on; groups [S]
    the seed prompt each sequence continues (sequences of one group share text: the validation
    split keeps them together)."""

    tokens: Tensor
    aux: Tensor
    final: Tensor
    pred: Tensor
    offsets: Tensor
    starts: Tensor
    groups: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def sequence(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        save_safetensors({k: getattr(self, k).contiguous() for k in FIELDS}, tmp)
        tmp.replace(path)

    @classmethod
    def concat(cls, parts: list["Features"]) -> "Features":
        lengths = torch.cat([torch.zeros(1, dtype=torch.long)] + [p.offsets.diff() for p in parts])
        return cls(tokens=torch.cat([p.tokens for p in parts]), aux=torch.cat([p.aux for p in parts]),
                   final=torch.cat([p.final for p in parts]), pred=torch.cat([p.pred for p in parts]),
                   offsets=lengths.cumsum(0), starts=torch.cat([p.starts for p in parts]),
                   groups=torch.cat([p.groups for p in parts]))

    @classmethod
    def load(cls, path: Path) -> "Features":
        from safetensors.torch import load_file

        return cls(**load_file(str(path)))


def teacher_force(target, seqs: list[list[int]], starts: list[int], capture: tuple[int, ...],
                  progress: bool = False) -> Features:
    """Run each sequence through our decoder once and keep what the head trains on."""
    final: list[Tensor] = []
    hook = target.norm.register_forward_hook(lambda mod, inp, out: final.append(out.detach()))
    parts = {"tokens": [], "aux": [], "pred": []}
    bar = _bar(sum(map(len, seqs)), "target features", progress, unit="tok")
    try:
        for seq in seqs:
            ids = torch.tensor(seq, dtype=torch.long)
            target.setup_cache(len(seq))
            out = target(ids, capture=capture)
            parts["tokens"].append(ids)
            parts["aux"].append(out.aux.to(torch.float16))
            parts["pred"].append(out.logits.argmax(-1))
            final[-1] = final[-1].to(torch.float16)
            bar.update(len(seq))
    finally:
        hook.remove()
        bar.close()
    lengths = torch.tensor([0] + [len(s) for s in seqs])
    return Features(tokens=torch.cat(parts["tokens"]), aux=torch.cat(parts["aux"]), final=torch.cat(final),
                    pred=torch.cat(parts["pred"]), offsets=lengths.cumsum(0),
                    starts=torch.tensor(starts, dtype=torch.long), groups=torch.arange(len(seqs)))


# ---- the cached pipeline ----

@dataclass(frozen=True)
class DataSpec:
    """What the data is made of; its digest names the cache entry."""

    target_digest: str
    source: str  # "file" | "self-generate" | "builtin"
    data_digest: str | None
    self_generate: int | None
    gen_tokens: int
    capture: tuple[int, ...]
    sampling: Sampling = Sampling()

    def key(self) -> str:
        blob = json.dumps({"v": DATA_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def target_digest(target_dir: Path) -> str:
    """Digest of the target's config, tokenizer and weight files (what changes its features)."""
    from specpack.packager.hashing import sha256_file

    h = hashlib.sha256()
    for p in sorted(Path(target_dir).iterdir()):
        if p.is_file() and (p.suffix in (".json", ".safetensors", ".jinja") or p.name.startswith("tokenizer")):
            h.update(p.name.encode() + sha256_file(p).encode())
    return h.hexdigest()


def build_features(target_dir: Path, target, tokenizer, records: list[Record] | None, self_generate: int | None,
                   gen_tokens: int, cache: Path, capture: tuple[int, ...], progress: bool,
                   sampling: Sampling = Sampling()) -> Features:
    """Sequences (given or generated), then features; both cached under `cache`."""
    feat_file = cache / FEATURES
    if feat_file.is_file():
        log.info("using cached features %s", feat_file)
        return Features.load(feat_file)
    cache.mkdir(parents=True, exist_ok=True)
    if self_generate:
        feats = generate(target_dir, self_generation_prompts(records, tokenizer, self_generate, gen_tokens, target.spec),
                         gen_tokens, target.spec.eos_token_ids, capture, cache, sampling, progress=progress)
    else:
        limit = target.spec.context_length
        seqs = [s[:limit] for s in text_sequences(records, tokenizer)]
        if not seqs:
            raise InputError("the data yields no sequence of two or more tokens", hint="add longer texts")
        feats = teacher_force(target, seqs, [0] * len(seqs), capture, progress)
    feats.save(feat_file)
    for part in cache.glob("generated-*.safetensors"):  # only kept for resuming generation
        part.unlink()
    return feats


def self_generation_prompts(records: list[Record] | None, tokenizer, n: int, gen_tokens: int, spec) -> list[list[int]]:
    """The first `n` seed prompts that leave room for `gen_tokens`, shortest first (less padding in
    a batch). Greedy continuations of one prompt are all the same, so there are never more than
    the seeds hold."""
    if records is None:
        records = builtin_records(has_chat_template(tokenizer))
    prompts = prompt_ids(records, tokenizer)
    fits = [p for p in prompts if len(p) + gen_tokens + 1 <= spec.context_length]
    if len(fits) < len(prompts):
        log.warning("skipping %d seed prompts too long for %d new tokens", len(prompts) - len(fits), gen_tokens)
    if n > len(fits):
        log.warning("--self-generate %d: only %d distinct seed prompts; greedy repeats would be identical", n, len(fits))
    if not fits:
        raise InputError("no seed prompt leaves room for generation", hint="shorten the prompts or --gen-tokens")
    return sorted(fits[:n], key=len)


def _bar(total: int, desc: str, enabled: bool, initial: int = 0, unit: str = "seq"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, initial=initial, unit=unit, disable=not enabled, leave=False,
                dynamic_ncols=True)
