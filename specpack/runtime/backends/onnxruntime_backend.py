"""ONNX Runtime backend (CPU): the artifact's exported step graphs (`specpack export --to onnx`).

The KV cache lives in torch tensors (`SlotCache`, `SharedCaches`) that ONNX Runtime reads in place
(IOBinding): a drafter graph gets the committed slots of its sequence as `past_*` and writes slots
P..P+T of the same buffers as its `new_*` outputs; the target graph gets the whole buffer of every
sequence and returns the new rows, which go into the buffer in one indexed copy.

Threads: ONNX Runtime gets `threads` intra-op threads (default 2: the machine class this targets has
two cores), and torch's own pool, which runs the loop's small host ops between graph calls, is set
to `torch_threads` (default 1) process-wide: two spinning pools on two cores fight (
measured on SmolLM2: 27.6 -> 34-39 tokens/s plain when torch drops from 2 threads to 1). For the same
reason only the target's session spins: each session has its own pool, and a drafter's pool spinning
after its call took the cores from the target's verification (SmolLM2 + EAGLE-3, HumanEval, one
sequence, D=3: 37.6 tokens/s with every pool spinning, 50.0 with none, 61.1 with the target's only;
plain 51.6 / 40.7 / 46.8).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from specpack.errors import InputError, UnsupportedError
from specpack.runtime.backends import GraphEagle3, GraphMtp, GraphTarget, eagle3_files, mtp_files
from specpack.runtime.backends.graph_block import GraphBlock, block_files

log = logging.getLogger(__name__)

NAME = "onnxruntime"
DEFAULT_THREADS = 2


def load(artifact, manifest, device: str = "cpu", dtype: str = "float32", threads: int = DEFAULT_THREADS,
         torch_threads: int | None = 1):
    """(target, drafter) running the exported graphs of the verified `artifact` on ONNX Runtime.
    `torch_threads` (None: leave it) sets torch's process-wide thread count, see the module docstring."""
    from specpack.runtime.spec_model import load_drafter
    from specpack.runtime.models.weights import target_spec

    if device != "cpu" or dtype != "float32":
        raise UnsupportedError(f"the onnxruntime backend runs on cpu in float32, not {device}/{dtype}",
                               hint="use --device cpu --dtype float32, or --backend tensorrt on a GPU")
    artifact = Path(artifact)
    index = require_export(artifact, manifest)
    if torch_threads:
        log.info("onnxruntime backend: %d ONNX Runtime threads, torch set to %d", threads, torch_threads)
        torch.set_num_threads(torch_threads)
    target = OrtTarget(artifact, index, target_spec(artifact), threads)
    kind = manifest.drafter.kind
    if kind == "eagle3":
        spec, d2t = eagle3_files(artifact)
        return target, OrtEagle3(artifact, index, spec, d2t, threads)
    if kind == "draft_model":
        from specpack.runtime.drafters.draft_model import DraftModelDrafter

        draft = OrtTarget(artifact, index, target_spec(artifact / "drafter"), threads, "draft_model_step")
        return target, DraftModelDrafter(draft, target.spec.vocab_size)
    if kind == "mtp":
        return target, OrtMtp(artifact, index, mtp_files(artifact), target, threads)
    if kind == "block":
        return target, OrtBlock(artifact, index, *block_files(artifact / "drafter"), threads)
    return target, load_drafter(kind, manifest.drafter.model_dump(exclude={"kind"}), None, None)


def require_export(artifact: Path, manifest):
    """The artifact's ONNX export index, or an error saying how to make one."""
    from specpack.packager.artifact import read_onnx_index as read_index

    index = read_index(artifact)
    if index is None:
        raise InputError(f"'{artifact}' has no ONNX export",
                         hint=f"run `specpack export {artifact} --to onnx --key KEY.pem` first")
    if index.drafter_kind != manifest.drafter.kind:
        raise InputError(f"the ONNX export of '{artifact}' was made for a {index.drafter_kind} drafter, "
                         f"the artifact has {manifest.drafter.kind}", hint="re-export with --force")
    return index


def session(path: Path, threads: int = DEFAULT_THREADS, spin: bool = True):
    """An ONNX Runtime CPU session over `path` with `threads` intra-op threads and full graph
    optimisation. `spin`: its idle threads spin before they sleep (ONNX Runtime's default); the
    drafter's sessions do not, see the module docstring."""
    from specpack.runtime.options import require

    ort = require("onnxruntime", "onnx")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # the graphs' dynamic shapes make ORT warn about shape inference
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


_ELEMENT = {torch.float32: "float32", torch.int64: "int64", torch.bool: "bool"}


class _Binder:
    """IOBinding over torch CPU tensors: ONNX Runtime reads and writes their memory directly."""

    def __init__(self, sess):
        import numpy as np

        self.sess, self.io = sess, sess.io_binding()
        self.np = {t: np.dtype(n) for t, n in _ELEMENT.items()}
        self._keep: list[Tensor] = []

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """Run with `inputs` (copied only when not contiguous) and write into `outputs` (must be)."""
        self._keep = []
        for name, t in inputs.items():
            self.io.bind_input(name, "cpu", 0, self.np[t.dtype], tuple(t.shape), self._ptr(t.contiguous()))
        for name, t in outputs.items():
            if not t.is_contiguous():
                raise ValueError(f"output {name} must be contiguous")  # a bug: results would be lost
            self.io.bind_output(name, "cpu", 0, self.np[t.dtype], tuple(t.shape), self._ptr(t))
        self.sess.run_with_iobinding(self.io)
        self._keep = []

    def _ptr(self, t: Tensor) -> int:
        if t.numel() == 0:
            t = torch.empty(1, dtype=t.dtype)  # an empty tensor may have no storage to point at
        self._keep.append(t)  # alive until the run is over
        return t.data_ptr()


class OrtTarget(GraphTarget):
    """The target step graph (or a draft model's) on ONNX Runtime, behaving like `Transformer`."""

    def __init__(self, artifact: Path, index, spec, threads: int = DEFAULT_THREADS, role: str = "target_step"):
        aux = index.aux_layer_ids if role == "target_step" else None
        graph = index.graph(role)
        super().__init__(spec, graph, aux, torch.device("cpu"), torch.float32)
        self.binder = _Binder(session(artifact / graph.path, threads, spin=role == "target_step"))

    def _run(self, T, inputs, outputs):
        self.binder.run(inputs, outputs)


class OrtEagle3(GraphEagle3):
    """The EAGLE-3 step graph on ONNX Runtime, drafting exactly as `Eagle3Drafter`."""

    def __init__(self, artifact: Path, index, spec, d2t: Tensor, threads: int = DEFAULT_THREADS):
        graph = index.graph("eagle3_step")
        super().__init__(spec, graph, d2t, torch.device("cpu"), torch.float32)
        self.binder = _Binder(session(artifact / graph.path, threads, spin=False))

    def _run(self, T, inputs, outputs):
        self.binder.run(inputs, outputs)


class OrtMtp(GraphMtp):
    """The MTP step graphs on ONNX Runtime, drafting exactly as `MtpDrafter`."""

    def __init__(self, artifact: Path, index, spec, target: OrtTarget, threads: int = DEFAULT_THREADS):
        graphs = index.graphs_of("mtp_step")
        binders = [_Binder(session(artifact / g.path, threads, spin=False)) for g in graphs]
        super().__init__(spec, target, graphs, torch.device("cpu"), torch.float32,
                         [lambda T, inputs, outputs, b=b: b.run(inputs, outputs) for b in binders])


class OrtBlock(GraphBlock):
    """The block drafter's context and step graphs on ONNX Runtime, drafting exactly as `BlockDrafter`."""

    def __init__(self, artifact: Path, index, spec, heads: dict, threads: int = DEFAULT_THREADS):
        context, step = index.graph("block_context"), index.graph("block_step")
        super().__init__(spec, heads, context, step, torch.device("cpu"), torch.float32)
        self.context_binder = _Binder(session(artifact / context.path, threads, spin=False))
        self.step_binder = _Binder(session(artifact / step.path, threads, spin=False))

    def _run_context(self, feats, positions, dest):
        T = feats.shape[0]
        out = torch.empty(T, self.spec.hidden_size)
        new = torch.empty(len(self.new_names), T, *self.shared.flat.shape[2:])
        self.context_binder.run({"feats": feats, "positions": positions},
                                {"context": out, **dict(zip(self.new_names, new.unbind(0)))})
        self.shared.write(new, dest)
        return out

    def _run_step(self, inputs, K):
        outputs = self._step_outputs(inputs["tokens"].shape[0], K)
        self.step_binder.run(self._step_inputs(inputs), outputs)
        return outputs
