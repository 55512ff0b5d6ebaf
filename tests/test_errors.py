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


def test_verbose_is_taken_before_or_after_the_command(tmp_path, tiny_target, cli):
    """`specpack build ... -v` used to fail with "No such option" (issue 62 item 4)."""
    from specpack.cli._common import hoist_verbose

    code, _, err = cli("build", tiny_target, "--drafter", "ngram", "-o", tmp_path / "art", "-v")
    assert code == 0, err
    assert hoist_verbose(["run", "ART", "-vv", "--json"]) == ["-vv", "run", "ART", "--json"]
    assert hoist_verbose(["serve", "ART", "--engine", "vllm", "--", "-v"]) == ["serve", "ART", "--engine", "vllm",
                                                                             "--", "-v"]
    assert hoist_verbose(["-v", "verify", "ART"]) == ["-v", "verify", "ART"]


def test_one_name_per_kind_of_key_and_the_old_ones_warn(tmp_path, tiny_target, keypair, cli):
    """`--signing-key` (private) and `--trust-key` (public) in every command; `--key` and tune's
    `--public-key` keep working with a deprecation warning (issue 62 item 3)."""
    code, _, err = cli("build", tiny_target, "--drafter", "ngram", "-o", tmp_path / "a", "--signing-key", keypair.private)
    assert code == 0 and "deprecated" not in err, err
    code, _, err = cli("verify", tmp_path / "a", "--trust-key", keypair.public)
    assert code == 0 and "deprecated" not in err, err
    code, _, err = cli("build", tiny_target, "--drafter", "ngram", "-o", tmp_path / "b", "--key", keypair.private)
    assert code == 0 and "warning: --key is deprecated for this command; use --signing-key" in err, err
    code, _, err = cli("verify", tmp_path / "b", "--key", keypair.public)
    assert code == 0 and "warning: --key is deprecated for this command; use --trust-key" in err, err
