"""What a user error prints is bounded: the first problems, then how many more (never megabytes)."""

import json

from specpack.errors import MAX_PROBLEM_CHARS, MAX_PROBLEMS, InputError


def test_printed_problems_are_capped_and_counted():
    err = InputError("bad", problems=[f"problem {i}" for i in range(10**5)], hint="fix it")
    lines = str(err).splitlines()
    assert lines[0] == "bad" and lines[-1] == "hint: fix it"
    assert lines[1:-1] == [f"  - problem {i}" for i in range(MAX_PROBLEMS)] + \
        [f"  - ... and {10**5 - MAX_PROBLEMS} more"]
    assert err.to_dict()["problems"][-1] == f"... and {10**5 - MAX_PROBLEMS} more"
    assert len(err.problems) == 10**5  # every problem is kept for callers


def test_a_huge_problem_is_cut_short():
    err = InputError("bad", problems=["x" * 10**6])
    assert len(str(err)) < MAX_PROBLEM_CHARS + 100 and "(1000000 chars)" in str(err)
    assert len(json.dumps(err.to_dict())) < MAX_PROBLEM_CHARS + 200


def test_import_gguf_on_a_missing_file_says_what_to_pass(tmp_path, cli):
    code, _, err = cli("import-gguf", tmp_path / "nope.gguf", "-o", tmp_path / "out")
    assert code == 2 and "does not exist" in err and "hint: pass a .gguf file" in err and not (tmp_path / "out").exists()
