"""Validated profiles: which ones fit this machine, picking one for `run`/`serve`, storing new ones.

    list_profiles(artifact)                  every profile with its status here and the reasons
    select_profile(manifest, device, dtype)  the settings run/serve use, and which profile they came from
    profile_for_export(manifest, wanted)     the profile whose concurrency crossover an engine export writes
    store_profile(artifact, profile, key)    write a profile into specpack.json (re-signed with a key)

Statuses: `runnable` (compatible and fits in memory), `low-memory` (compatible but the memory it
needs is not free now), `incompatible` (wrong drafter, backend not installed, no such device, or a
profile that is not valid). `specpack tune` (runtime/tune.py) measures the profiles.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from specpack._machine import cpu_model
from specpack.errors import InputError
from specpack.schemas.profile import Hardware, Profile, profile_id

log = logging.getLogger(__name__)

RUNNABLE, LOW_MEMORY, INCOMPATIBLE = "runnable", "low-memory", "incompatible"
BACKEND_MODULES = {"torch": ("torch", None), "onnxruntime": ("onnxruntime", "onnx"),
                   "tensorrt": ("tensorrt", "tensorrt")}  # backend -> (module, extra that installs it)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_total: int
    memory_free: int


@dataclass(frozen=True)
class Machine:
    """What this machine offers; tests build one by hand to fake a small or GPU-less machine."""

    cpu_model: str
    cpu_cores: int
    memory_total: int
    memory_available: int
    gpus: tuple[Gpu, ...] = ()
    backends: dict[str, str] = field(default_factory=dict)  # installed backend -> version

    def hardware(self, device: str = "cpu") -> Hardware:
        gpu = self.gpus[0] if device == "cuda" and self.gpus else None
        return Hardware(cpu_model=self.cpu_model, cpu_cores=self.cpu_cores, memory_bytes=self.memory_total,
                        gpu=gpu.name if gpu else None, gpu_memory_bytes=gpu.memory_total if gpu else None)


def this_machine(gpus: bool = True) -> Machine:
    """Describe this machine: CPU, memory (/proc/meminfo, else psutil), GPUs torch sees, backends."""
    total, available = _memory()
    backends = {}
    for backend, (module, _) in BACKEND_MODULES.items():
        if importlib.util.find_spec(module) is not None:
            backends[backend] = package_version(module)
    return Machine(cpu_model(), os.cpu_count() or 1, total, available,
                   _gpus() if gpus and "torch" in backends else (), backends)


def _memory() -> tuple[int, int]:
    """(total, available) bytes of system memory: /proc/meminfo, else psutil, else sysconf."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(info["MemTotal"].split()[0]) * 1024, int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil

        vm = psutil.virtual_memory()
        return vm.total, vm.available
    except ImportError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total  # availability unknown without psutil: assume all of it


def _gpus() -> tuple[Gpu, ...]:
    import torch

    if not torch.cuda.is_available():
        return ()
    found = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        found.append(Gpu(torch.cuda.get_device_name(i), total, free))
    return tuple(found)


def package_version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class ProfileStatus:
    profile: Optional[Profile]  # None when the stored entry is not a valid profile
    status: str
    reasons: list[str]
    notes: list[str]
    raw: dict

    @property
    def label(self) -> str:
        if not self.profile:
            return str(self.raw.get("name", "?"))
        p = self.profile
        said = [f"{p.weights} weights"] * bool(p.weights) + [f"{p.kv_cache} KV cache"] * bool(p.kv_cache)
        return p.name + (f" ({', '.join(said)})" if said else "")

    def to_dict(self) -> dict:
        p = self.profile
        data = {"name": self.label, "id": p.id if p else self.raw.get("id"), "status": self.status,
                "reasons": self.reasons, "notes": self.notes}
        if p:
            e = p.evidence
            data |= {"settings": p.settings.model_dump(), "required_bytes": p.memory.required_bytes,
                     "speedup": e.speedup, "acceptance_length": e.acceptance_length,
                     "tokens_per_s": e.speculative_tokens_per_s, "workload": e.workload.name,
                     "measured_at": e.measured_at, "measured_on": _hardware_text(e.hardware)}
        return data


def format_statuses(statuses: list[ProfileStatus]) -> str:
    """The listing `specpack profiles` prints."""
    if not statuses:
        return "no validated profiles (run `specpack tune ARTIFACT --workload FILE.jsonl`)"
    lines = []
    for s in statuses:
        head = f"{s.status:<13} {s.label} ({s.raw.get('id', '?')})"
        if s.profile:
            e, st = s.profile.evidence, s.profile.settings
            head += (f": {e.speedup:.2f}x, acceptance length {e.acceptance_length:.2f}, "
                     f"max concurrency {st.max_concurrency}, needs {_size(s.profile.memory.required_bytes)}, "
                     f"workload '{e.workload.name}', {e.measured_at}")
        lines += [head] + [f"    - {r}" for r in s.reasons] + [f"    note: {n}" for n in s.notes]
    return "\n".join(lines)


def check_profile(raw: dict, manifest, machine: Machine) -> ProfileStatus:
    """The status of one stored profile entry on `machine`, with every reason it does not run."""
    try:
        p = Profile.model_validate(raw)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]]
        return ProfileStatus(None, INCOMPATIBLE, ["not a valid profile: " + "; ".join(problems)], [], raw)
    reasons = _validity(p, raw, manifest) + _capability(p, machine)
    if reasons:
        return ProfileStatus(p, INCOMPATIBLE, reasons, [], raw)
    need, free, where = p.memory.required_bytes, *_free_memory(p, machine)
    notes = [] if _same_hardware(p, machine) else [f"measured on other hardware ({_hardware_text(p.evidence.hardware)})"]
    if need > free:
        return ProfileStatus(p, LOW_MEMORY, [f"needs {_size(need)} of {where} memory, {_size(free)} available"],
                             notes, raw)
    return ProfileStatus(p, RUNNABLE, [], notes, raw)


def _validity(p: Profile, raw: dict, manifest) -> list[str]:
    reasons = []
    if profile_id(p.model_dump(mode="json")) != p.id:
        reasons.append("its id does not match its content: it was edited after tuning")
    if not p.evidence.greedy_equal:
        reasons.append("greedy output was not identical to decoding without speculation when it was tuned")
    if p.drafter not in ("none", manifest.drafter.kind):
        reasons.append(f"it is for a {p.drafter} drafter, this artifact has {manifest.drafter.kind}")
    return reasons


def _capability(p: Profile, machine: Machine) -> list[str]:
    from specpack._machine import ENGINES, MissingEngineError, find

    reasons = []
    if p.backend in ENGINES:
        try:
            find(p.backend)
        except MissingEngineError as exc:
            reasons.append(f"{exc.message} ({exc.hint})")
    elif p.backend not in machine.backends:
        module, extra = BACKEND_MODULES[p.backend]
        how = f"pip install 'specpack[{extra}]'" if extra else f"pip install {module}"
        reasons.append(f"backend {p.backend} is not installed ({how})")
    if p.device == "cuda" and not machine.gpus:
        reasons.append("it needs a CUDA GPU and none is visible")
    return reasons


def _free_memory(p: Profile, machine: Machine) -> tuple[int, str]:
    if p.device == "cuda":
        return max(g.memory_free for g in machine.gpus), "GPU"
    return machine.memory_available, "system"


def _same_hardware(p: Profile, machine: Machine) -> bool:
    hw = p.evidence.hardware
    if p.device == "cuda":
        return any(g.name == hw.gpu for g in machine.gpus)
    return hw.cpu_model == machine.cpu_model and hw.cpu_cores == machine.cpu_cores


def _hardware_text(hw: Hardware) -> str:
    return hw.gpu or f"{hw.cpu_model}, {hw.cpu_cores} cores"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def list_profiles(artifact, machine: Optional[Machine] = None) -> list[ProfileStatus]:
    """Every profile of `artifact` with its status on `machine` (this one by default)."""
    from specpack.packager.artifact import read_manifest

    manifest = read_manifest(artifact)
    machine = machine or this_machine(gpus=any(_raw(p).get("device") == "cuda" for p in manifest.profiles))
    return [check_profile(_raw(p), manifest, machine) for p in manifest.profiles]


def _raw(entry) -> dict:
    """A manifest profile entry as JSON data (typed Profile or plain dict)."""
    return entry.model_dump(mode="json") if hasattr(entry, "model_dump") else dict(entry)


@dataclass(frozen=True)
class Selection:
    """What run/serve apply: speculation, draft length, concurrency limit (None: no limit), draft
    tree shape (a runtime.drafters.base.TreeShape; None: chains), prompt lookup length (0: off)."""

    profile: Optional[Profile]
    speculative: bool
    draft_len: int
    max_concurrency: Optional[int]
    message: str
    tree: Optional[tuple] = None
    curve_here: bool = True  # the profile's cost curve was measured on this hardware with these kernels
    lookup: int = 0

    @property
    def cost_curve(self) -> Optional[dict]:
        """The profile's measured step-time curve (rows, ms), for the engine's draft lengths; None when
        it was measured on other hardware or with other CPU kernels (run and serve then measure one)."""
        c = self.profile.settings.cost_curve if self.profile and self.curve_here else None
        return c.model_dump() if c else None

    @property
    def position_acceptance(self) -> Optional[list[float]]:
        """Per-position acceptance measured on the profile's workload: where sequences start."""
        return list(self.profile.evidence.position_acceptance) if self.profile and self.profile.settings.speculative \
            else None


def select_profile(manifest, device: str = "cpu", dtype: str = "float32", wanted: Optional[str] = None,
                   backend: str = "torch", machine: Optional[Machine] = None, weights: str = "fp32",
                   kv_cache: str = "model") -> Selection:
    """The best runnable profile for backend/device/dtype/weights/KV cache (or the one named `wanted`, by name
    or id), else the artifact's defaults. Best: measured on this hardware first, then the highest
    speedup."""
    device = device.split(":")[0]
    if not manifest.profiles and wanted is None:
        return _defaults(manifest, "no validated profiles in the artifact")
    machine = machine or this_machine(gpus=device == "cuda" or wanted is not None)
    checked = [check_profile(_raw(p), manifest, machine) for p in manifest.profiles]
    if wanted is not None:
        return _chosen(_find(checked, wanted), (backend, device, dtype, weights, kv_cache), machine)
    setup = (backend, device, dtype, weights, kv_cache)
    fits = [c for c in checked if c.status == RUNNABLE and _setup(c.profile) == setup]
    if not fits:
        return _defaults(manifest, f"no runnable validated profile for {_describe(*setup)} "
                                   f"(`specpack profiles` says why)")
    best = max(fits, key=lambda c: (not c.notes, c.profile.evidence.speedup, c.profile.evidence.measured_at))
    return _from_profile(best.profile, "picked", machine)


def _checked_entries(manifest) -> list[tuple[Profile, list[str]]]:
    """(profile, reasons it is not valid) of every stored profile that reads as one."""
    entries = []
    for raw in map(_raw, manifest.profiles):
        try:
            p = Profile.model_validate(raw)
        except ValidationError:
            continue
        entries.append((p, _validity(p, raw, manifest)))
    return entries


def profile_for_export(manifest, wanted: Optional[str] = None, device: str = "cuda") -> Optional[Profile]:
    """The validated profile whose measured concurrency crossover an engine export writes: the one
    named `wanted` (name, id or id prefix; "none": no profile), else the speculative one measured
    on `device` with the highest speedup (then the newest), if any. Unlike `select_profile` nothing
    is checked against this machine: the engine runs elsewhere."""
    if wanted == "none":
        return None
    entries = _checked_entries(manifest)
    if wanted is not None:
        return _named_for_export(entries, wanted)
    fits = [p for p, reasons in entries if not reasons and p.device == device and p.settings.speculative]
    return max(fits, key=lambda p: (p.evidence.speedup, p.evidence.measured_at), default=None)


def engine_profile(manifest, engine: str, wanted: Optional[str] = None, device: str = "cpu") -> Optional[Profile]:
    """The validated profile `serve --engine` follows: the one named `wanted` (name, id or id prefix;
    "none": none), else the one measured through `engine` on `device` with the highest speedup (then
    the newest), else None (the artifact's defaults). A profile that found speculation never paid
    (speedup 1.0) is followed too, by starting the target alone, but any speculative one outranks it.
    Profiles measured on specpack's own runtime are not used: their draft lengths and crossovers were
    measured where they do not run."""
    if wanted == "none":
        return None
    entries = _checked_entries(manifest)
    if wanted is not None:
        return _named_for_export(entries, wanted, plain_ok=True)
    fits = [p for p, reasons in entries if not reasons and p.backend == engine and p.device == device]
    return max(fits, key=lambda p: (p.settings.speculative, p.evidence.speedup, p.evidence.measured_at), default=None)


def _named_for_export(entries: list, wanted: str, plain_ok: bool = False) -> Profile:
    named = [(p, r) for p, r in entries if wanted in (p.name, p.id)]
    named = named or [(p, r) for p, r in entries if len(wanted) >= 4 and p.id.startswith(wanted)]
    if not named:
        known = ", ".join(f"{p.name} ({p.id})" for p, _ in entries) or "none"
        raise InputError(f"the artifact has no profile named '{wanted}'", hint=f"profiles: {known}")
    p, reasons = min(named, key=lambda e: (bool(e[1]), -e[0].evidence.speedup))
    if reasons:
        raise InputError(f"profile {p.name} ({p.id}) is not valid", problems=reasons,
                         hint="`specpack profiles ARTIFACT` lists them; re-tune, or pass --profile none")
    if not p.settings.speculative and not plain_ok:
        raise InputError(f"profile {p.name} ({p.id}) found that speculation never paid on its workload: there is no "
                         "concurrency crossover to export", hint="pass --profile none (or serve without speculation)")
    return p


def _find(checked: list[ProfileStatus], wanted: str) -> ProfileStatus:
    named = [c for c in checked if c.profile and wanted in (c.profile.name, c.profile.id)]
    named = named or [c for c in checked if c.profile and len(wanted) >= 4 and c.profile.id.startswith(wanted)]
    if not named:
        known = ", ".join(f"{c.label} ({c.raw.get('id')})" for c in checked) or "none"
        raise InputError(f"the artifact has no profile named '{wanted}'", hint=f"profiles: {known}")
    order = {RUNNABLE: 0, LOW_MEMORY: 1, INCOMPATIBLE: 2}
    return min(named, key=lambda c: (order[c.status], bool(c.notes), -c.profile.evidence.speedup))


def _describe(backend: str, device: str, dtype: str, weights: str, kv_cache: str = "model") -> str:
    return (f"{backend}/{device}/{dtype}" + (f" with {weights} weights" if weights != "fp32" else "")
            + (f" and an {kv_cache} KV cache" if kv_cache != "model" else ""))


def _setup(p: Profile) -> tuple[str, str, str, str, str]:
    """(backend, device, dtype, weights, KV cache) a profile was measured with."""
    return p.backend, p.device, p.dtype, p.weights or "fp32", p.kv_cache or "model"


def _chosen(c: ProfileStatus, setup: tuple, machine: Machine) -> Selection:
    """The profile `c` for a run with `setup` (as `_setup` gives it), or why it cannot be."""
    p = c.profile
    if c.status != RUNNABLE:
        raise InputError(f"profile {p.name} ({p.id}) cannot run here: {c.status}", problems=c.reasons,
                         hint="`specpack profiles ARTIFACT` lists the ones that can")
    if _setup(p) != setup:
        raise InputError(f"profile {p.name} is for {_describe(*_setup(p))}, this run uses {_describe(*setup)}",
                         hint=f"pass --device {p.device} --dtype {p.dtype} --weights {p.weights or 'fp32'} "
                              f"--kv-cache {p.kv_cache or 'model'}")
    return _from_profile(p, "using", machine)


KERNELS = "specpack-kernels"  # Software.packages key: the CPU kernels' source hash a profile was measured with


def kernels_build() -> str:
    """The CPU kernels' source hash (what a cost curve measured on the CPU depends on)."""
    from specpack.runtime.kernels._lib import source_hash

    return source_hash()


def _curve_here(p: Profile, machine: Machine) -> bool:
    """Whether `p`'s cost curve describes this machine as it runs now: the same hardware and, on the
    CPU, the same kernels (a specpack upgrade can make rows cheaper, and an old curve would then cut
    drafts that pay)."""
    if not _same_hardware(p, machine):
        return False
    return p.device == "cuda" or p.evidence.software.packages.get(KERNELS) == kernels_build()


def _from_profile(p: Profile, verb: str, machine: Machine) -> Selection:
    from specpack.runtime.drafters.base import TreeShape

    s, e = p.settings, p.evidence
    limit = f"speculation up to {s.max_concurrency} concurrent requests" if s.speculative else "speculation off"
    tree = TreeShape(s.tree_topk, s.tree_nodes) if s.speculative and s.draft_shape == "tree" else None
    shape = f", draft trees of top-k {tree.topk} and {tree.nodes} nodes" if tree else ""
    lookup = (s.lookup or 0) if s.speculative else 0
    shape += f", prompt lookup of up to {lookup} tokens" if lookup else ""
    stale = s.cost_curve is not None and not _curve_here(p, machine)
    message = (f"{verb} profile {p.name} ({p.id}): {e.speedup:.2f}x on workload '{e.workload.name}', "
               f"acceptance length {e.acceptance_length:.2f}, {limit}{shape}")
    if stale:
        message += "; its cost curve was measured on other hardware or CPU kernels: measuring one here"
    return Selection(p, s.speculative, s.draft_len if s.speculative else 1, s.max_concurrency, message, tree,
                     not stale, lookup)


def _defaults(manifest, why: str) -> Selection:
    from specpack.schemas.manifest import default_draft_len

    d = default_draft_len(manifest)
    return Selection(None, True, d, None, f"{why}: artifact defaults (speculation on, draft length {d})")


def store_profile(artifact, profile: Profile, key=None) -> Path:
    """Add `profile` to the artifact's manifest, replacing one measured for the same backend, device,
    dtype, hardware and workload; re-sign with `key` when given. specpack.json is not in the files
    list, so every digest stays valid; a signed artifact needs `key` (its signature covers the manifest).
    One transaction: a bad key or an interruption leaves the artifact as it was."""
    from specpack.packager.update import update_artifact
    from specpack.schemas import MANIFEST_NAME

    artifact = Path(artifact)
    with update_artifact(artifact, key, what=WRITING_PROFILES) as update:
        slot = _slot(profile.model_dump(mode="json"))
        kept = [_raw(p) for p in update.manifest.profiles if _slot(_raw(p)) != slot]
        update.manifest_update["profiles"] = kept + [profile.model_dump(mode="json")]
    return artifact / MANIFEST_NAME


WRITING_PROFILES = "writing profiles"


def check_writable(artifact: Path, key) -> None:
    """Refuse before any work when the key cannot sign, or when writing profiles would leave a
    stale signature behind."""
    from specpack.packager.update import check_update_options

    check_update_options(Path(artifact), key, what=WRITING_PROFILES)


def _slot(data: dict) -> tuple:
    hw = data.get("evidence", {}).get("hardware", {})
    return (data.get("backend"), data.get("device"), data.get("dtype"), data.get("weights"), data.get("kv_cache"),
            hw.get("cpu_model"),
            hw.get("gpu"), data.get("evidence", {}).get("workload", {}).get("sha256"))


def cache_dtype_name(model) -> str | None:
    """The target's KV cache dtype as kv_and_weight_bytes names it ("float16"), or None where the
    backend does not say (the graph backends keep theirs in --dtype)."""
    dtype = getattr(model.target, "cache_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def kv_and_weight_bytes(manifest, dtype: str, context: int, kv_dtype: str | None = None) -> tuple[int, int]:
    """(weights, KV cache for `context` tokens) in `dtype` (the target's cache in `kv_dtype` when
    given), from the manifest's on-disk figures."""
    mem, disk = manifest.memory, DTYPE_BYTES.get(manifest.target.dtype, 4)
    scale = DTYPE_BYTES[dtype] / disk
    weights = int((mem.target_weight_bytes + mem.drafter_weight_bytes) * scale)
    kv_scale = DTYPE_BYTES[kv_dtype or dtype] / disk
    kv = int((mem.target_kv_bytes_per_token * kv_scale + mem.drafter_kv_bytes_per_token * scale) * context)
    return weights, kv
