"""Each weight precision on the embedded SmolLM2-135M, side by side in one run.

For every `--weights` (fp32, fp16, bf16, int8, w8a8: `specpack.load(..., weights=...)`; bf16-vector: bf16
on the vector kernel where `--weights bf16` runs AMX tiles, to compare the two):

  distance from fp32   the largest |logit difference| to fp32 over every position of the benchmark
                       prompts followed by fp32's greedy continuation (one teacher-forced forward),
                       and greedy agreement: prompts whose greedy tokens equal fp32's, and the mean
                       share of fp32's tokens before the first difference
  forward cost         one target forward over 1, 9, 16, 32 new rows after 100 cached positions of
                       the benchmark prompts' text (the rows: the text's next tokens), median ms,
                       and t(9)/t(1): what verifying a draft of 8 costs; every logit,
                       then greedy rows (the engine's greedy verify: the head screened,
                       kernels/screen.py)
  decode               tokens/s plain and with the n-gram drafter (and EAGLE-3 when the shipped head
                       is in heads/), and whether speculative output equals plain output; plain
                       decode again without the greedy screen, and whether its output is the same
  llama.cpp            (with llama-cpp-python installed, the bench extra) the same weights as F32, F16
                       and Q8_0 GGUFs: plain tokens/s and prompt lookup, beside fp32, fp16 and int8 / w8a8

It prints the CPU model, the memory bandwidth one copy reaches and how busy the CPUs were before
each phase: figures from a shared machine are only comparable within one run.

    python bench/precision.py [--weights fp32,fp16,bf16,bf16-vector,int8,w8a8] [--max-new-tokens 64] [--per-workload 2]
                              [--no-decode] [--no-llama] [--rows 1,9,16,32]
    python bench/precision.py --pairs 3 --per-workload 2 --max-new-tokens 128     # plain decode vs llama.cpp, in pairs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from decode import WORKLOADS, LlamaCpp, chat_ids, f32_gguf, humaneval_prompts, rewrite_gguf  # noqa: E402
from kernel_bench import busy_fraction, median_ms  # noqa: E402

GGUF_TYPES = {"fp32": "F32", "fp16": "F16", "bf16": "F16", "bf16-vector": "F16", "int8": "Q8_0", "w8a8": "Q8_0"}  # llama.cpp's nearest precision


def machine() -> str:
    from specpack._machine import cpu_model

    big = torch.empty(64 << 20, dtype=torch.float32)  # 256 MB: past any L3
    dst = torch.empty_like(big)
    dst.copy_(big)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(big)
    gbs = 3 * 2 * big.numel() * 4 / (time.perf_counter() - t) / 1e9
    mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]
    return (f"{cpu_model()}, {torch.get_num_threads()} threads, {int(mem) / 2**20:.0f} GiB; "
            f"memory copy {gbs:.1f} GB/s (read + write, torch {torch.__version__})")


def busy() -> str:
    b = busy_fraction(0.5)
    return f"CPUs {b:.0%} busy before this phase" + (" (contended: compare within the run only)" if b > 0.1 else "")


def prompts(tok, per_workload: int) -> dict[str, list[list[int]]]:
    out = {name: [chat_ids(tok, p) for p in ps[:per_workload]] for name, ps in WORKLOADS.items()}
    he = humaneval_prompts(per_workload)
    if he:
        out["humaneval"] = [tok(p).input_ids for p in he]
    return out


def load(artifact, pub, weights: str):
    """The artifact at `weights`; "bf16-vector" is bf16 on the vector kernel where the CPU has AMX tiles
    (which `--weights bf16` runs on), for the two side by side."""
    import specpack
    from specpack.runtime.kernels import accelerate

    if weights != "bf16-vector":
        return specpack.load(artifact, public_key=pub, weights=weights)
    tiles, accelerate.bf16_tiles = accelerate.bf16_tiles, lambda: False
    try:
        return specpack.load(artifact, public_key=pub, weights="bf16")
    finally:
        accelerate.bf16_tiles = tiles


def distance(models: dict, ids_list: list[list[int]], max_new: int) -> dict:
    """{weights: (max |logit diff| to fp32, prompts greedy-equal, mean share of fp32's tokens
    before the first difference)}."""
    ref = models["fp32"]
    out = {}
    for ids in ids_list:
        want = ref.generate(ids, max_new, speculative=False).tokens
        seq = torch.tensor(ids + want)
        logits = {}
        for w, m in models.items():
            m.target.setup_cache(len(seq) + 1)
            logits[w] = m.target(seq).logits[len(ids) - 1:]
            got = want if w == "fp32" else m.generate(ids, max_new, speculative=False).tokens
            same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want)) / max(1, len(want))
            d, eq, pre = out.get(w, (0.0, 0, []))
            out[w] = (max(d, float((logits[w] - logits["fp32"]).abs().max())), eq + (got == want), pre + [same])
    return {w: (d, eq, statistics.mean(pre)) for w, (d, eq, pre) in out.items()}


def forward_table(models: dict, rows: list[int], text: list[int], rounds: int = 3) -> dict[tuple, dict[int, float]]:
    """{(weights, greedy): {rows: ms}}: rounds interleave the precisions and both heads, so a busy
    moment hits them alike. `text`: at least 100 + max(rows) real tokens (a forward over made-up ids
    meets flat distributions that no decode step sees). greedy: every row's logits only feed a greedy
    pick (the head screened where the model has a screen), else every logit."""
    context, nxt = torch.tensor(text[:100]), torch.tensor(text[100:])
    for m in models.values():
        m.target.setup_cache(512)
        m.target(context)
    best = {(w, g): {n: float("inf") for n in rows} for w in models for g in (False, True)}
    for _ in range(rounds):
        for (w, greedy), ms in best.items():
            for n in rows:
                ms[n] = min(ms[n], median_ms(lambda: _forward(models[w].target, nxt[:n], greedy), 9))
    return best


def _forward(target, tokens: torch.Tensor, greedy: bool = False) -> None:
    from specpack.runtime.models.rows import Rows, Segment

    n = len(tokens)
    target.forward_rows(tokens, Rows.of([Segment(0, 100, n)]), greedy_rows=range(n) if greedy else ())


def decode(model, ids_list, max_new: int, spec: bool, draft_len: int, adaptive: bool = True):
    """(tokens, mean tokens/s with the prefill, mean tokens/s after the first token)."""
    toks, tps, dec = [], [], []
    for ids in ids_list:
        r = model.generate(ids, max_new, speculative=spec, draft_len=draft_len, adaptive=adaptive)
        toks.append(r.tokens)
        tps.append(r.stats.tokens_per_s)
        dec.append(r.stats.decode_tokens_per_s)
    return toks, statistics.mean(tps), statistics.mean(dec)


def llama_decode(lc, ids_list, max_new: int, eos, lookup: bool = False) -> tuple[float, float]:
    """llama.cpp's mean tokens/s with the prefill and after the first token."""
    tps, dec = [], []
    for ids in ids_list:
        tps.append(lc.run(ids, max_new, eos, lookup=lookup)[1])
        dec.append(lc.last_decode_tps)
    return statistics.mean(tps), statistics.mean(dec)


def gguf_as(src_f32: Path, dst: Path, qtype: str) -> Path:
    """The F32 GGUF's weights as `qtype` (F16 or Q8_0) for llama.cpp: 2-D tensors converted, norms
    kept F32 (as llama.cpp's converter does)."""
    import gguf
    import numpy as np

    kind = getattr(gguf.GGMLQuantizationType, qtype)

    def convert(t):
        data = np.asarray(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if data.ndim != 2:
            return data, None
        q = data.astype(np.float16) if qtype == "F16" else gguf.quants.quantize(data, kind)  # Q8_0: byte rows
        return q, kind

    return rewrite_gguf(src_f32, dst, convert)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="fp32,fp16,bf16,int8,w8a8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--per-workload", type=int, default=2)
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--rows", default="1,9,16,32")
    ap.add_argument("--no-decode", action="store_true", help="distance and forward cost only")
    ap.add_argument("--no-distance", action="store_true", help="skip the distance from fp32")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--pairs", type=int, default=0, metavar="ROUNDS",
                    help="plain decode only, ours and llama.cpp's in pairs (one prompt, one precision, back to "
                    "back, the order alternating), ROUNDS rounds; prints each precision's median ratio")
    args = ap.parse_args()
    from specpack.demo import cache_dir, prepare, prepare_eagle3

    weights = args.weights.split(",")
    if "fp32" not in weights:
        weights.insert(0, "fp32")
    rows = [int(r) for r in args.rows.split(",")]
    artifact, pub = prepare(cache_dir(), lambda s: print(s, file=sys.stderr))
    eagle3 = prepare_eagle3(cache_dir(), lambda s: print(s, file=sys.stderr))
    print(machine())
    models = {w: load(artifact, pub, w) for w in weights}
    tok = models["fp32"].tokenizer
    by_workload = prompts(tok, args.per_workload)
    every = [ids for ps in by_workload.values() for ids in ps]

    if args.pairs:
        return run_pairs(args, models, every)
    if not args.no_distance:
        print_distance(models, every, args.max_new_tokens)

    print(f"\n## target forward, ms after 100 cached positions (best of 3 interleaved rounds of a median of 9); "
          f"every logit, and greedy rows (the head screened: kernels/screen.py); {busy()}")
    table = forward_table(models, rows, [t for ids in every for t in ids])
    for (w, greedy), ms in sorted(table.items(), key=lambda kv: kv[0][1]):
        print(f"{w:11s} {'greedy' if greedy else 'logits'} " + "  ".join(f"{n} rows {ms[n]:6.2f}" for n in rows)
              + (f"  t(9)/t(1) {ms[9] / ms[1]:.2f}" if 9 in ms and 1 in ms else ""))

    if not args.no_decode:
        run_decode(args, models, eagle3, pub, by_workload)


def print_distance(models, every, max_new) -> None:
    print(f"\n## distance from fp32 ({len(every)} prompts, {max_new} greedy tokens each)")
    for w, (d, eq, pre) in distance(models, every, max_new).items():
        print(f"{w:11s} max |logit diff| {d:.2e}; greedy equal on {eq}/{len(every)} prompts; "
              f"equal up to the first difference: {pre:.0%} of the tokens (mean)")


def run_decode(args, models, eagle3, pub, by_workload) -> None:
    print(f"\n## decode, tokens/s (mean over prompts, {args.max_new_tokens} new tokens, prefill included; "
          f"decode = after the first token, as llama-bench tg); {busy()}")
    eagles = {w: load(eagle3, pub, w) for w in models} if eagle3 else {}
    llama = {} if args.no_llama else llama_engines(models)
    eos = set(models["fp32"].target.spec.eos_token_ids)
    for wl, ids_list in by_workload.items():
        for w, m in models.items():
            plain, p, pd = decode(m, ids_list, args.max_new_tokens, False, 1)
            screen, m.target.screen = m.target.screen, None
            full, _, fd = decode(m, ids_list, args.max_new_tokens, False, 1)
            m.target.screen = screen
            spec, s, _ = decode(m, ids_list, args.max_new_tokens, True, args.draft_len)
            line = (f"{wl:16s} {w:11s} plain {p:6.1f} (decode {pd:6.1f}; without the screen {fd:6.1f}, "
                    f"{pd / fd:.2f}x, same: {full == plain})  n-gram {s:6.1f} ({s / p:.2f}x, same: {spec == plain})")
            if w in eagles:
                e_out, e, _ = decode(eagles[w], ids_list, args.max_new_tokens, True, 3, adaptive=False)
                line += f"  EAGLE-3 {e:6.1f} ({e / p:.2f}x, same: {e_out == plain})"
            if w in llama:
                name, lc = llama[w]
                lp, lpd = llama_decode(lc, ids_list, args.max_new_tokens, eos)
                ll, _ = llama_decode(lc, ids_list, args.max_new_tokens, eos, lookup=True)
                line += (f"  | llama.cpp {name} {lp:6.1f} (decode {lpd:6.1f}; ours {p / lp:.2f}x, decode "
                         f"{pd / lpd:.2f}x), lookup {ll:6.1f} (n-gram {s / ll:.2f}x)")
            print(line, flush=True)


def run_pairs(args, models, every) -> None:
    """Issue 15's plain-decode goal (ours >= 1.05x llama.cpp at each precision) through this machine's
    noise: per precision, every prompt decoded by ours and by llama.cpp at the matching GGUF back to back,
    the order alternating, for args.pairs rounds; the ratio of decode rates (after the first token) per
    pair, then the median and the quartiles over pairs."""
    llama = llama_engines(models)
    if not llama:
        sys.exit("--pairs compares with llama.cpp: install llama-cpp-python (the bench extra) or point PYTHONPATH "
                 "and LLAMA_CPP_LIB_PATH at a build of its sdist")
    eos = set(models["fp32"].target.spec.eos_token_ids)
    ratios = {w: [] for w in llama}
    print(f"\n## plain decode in pairs: {len(every)} prompts x {args.pairs} rounds, {args.max_new_tokens} new "
          f"tokens; {busy()}")
    for r in range(args.pairs):
        for w, (name, lc) in llama.items():
            for i, ids in enumerate(every):
                ours_first = (r + i) % 2 == 0
                for side in ("ours", "llama") if ours_first else ("llama", "ours"):
                    if side == "ours":
                        ours = models[w].generate(ids, args.max_new_tokens, speculative=False).stats.decode_tokens_per_s
                    else:
                        theirs = llama_decode(lc, [ids], args.max_new_tokens, eos)[1]
                ratios[w].append(ours / theirs)
        print(f"round {r + 1}: " + "  ".join(f"{w} {statistics.median(v):.2f}" for w, v in ratios.items()), flush=True)
    for w, v in ratios.items():
        q1, med, q3 = statistics.quantiles(v, n=4) if len(v) > 1 else (v[0],) * 3
        print(f"{w:11s} vs llama.cpp {llama[w][0]:4s}: decode ratio median {med:.2f} (quartiles {q1:.2f} - {q3:.2f}, "
              f"{len(v)} pairs; >= 1.05 in {sum(x >= 1.05 for x in v)})")


def llama_engines(models) -> dict:
    from specpack.demo import cache_dir, find_gguf

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python): skipped")
        return {}
    f32 = f32_gguf(find_gguf(), cache_dir() / "SmolLM2-135M-Instruct.F32.gguf")
    out = {}
    for w in models:
        q = GGUF_TYPES[w]
        path = f32 if q == "F32" else gguf_as(f32, cache_dir() / f"SmolLM2-135M-Instruct.{q}.gguf", q)
        out[w] = (q, LlamaCpp(path))
    return out


if __name__ == "__main__":
    main()
