"""The adaptive draft length: longer while drafts are accepted, shorter and then none while they fail."""

from specpack.runtime.engine.stats import DraftLength


def test_grows_on_full_acceptance_and_shrinks_on_rejection():
    d = DraftLength(8)
    assert d.next() == 8
    d.update(8, 0)
    assert d.next() == 4
    d.update(4, 4)
    assert d.next() == 8
    d.update(8, 3)  # partly accepted: keep
    assert d.next() == 8


def test_stops_drafting_when_single_tokens_keep_failing_then_probes_again():
    d = DraftLength(4, patience=2, cooldown=3)
    for k in (4, 2, 1):
        assert d.next() == k
        d.update(k, 0)
    assert d.next() == 1
    d.update(1, 0)  # second miss at length 1: rest
    assert [d.next() for _ in range(3)] == [0, 0, 1]
    d.update(1, 1)
    assert d.next() == 2


def test_fixed_when_not_adaptive():
    d = DraftLength(5, adaptive=False)
    for accepted in (0, 5, 2, 0):
        assert d.next() == 5
        d.update(5, accepted)


def test_default_policy_is_the_drafters(tmp_path):
    """n-gram adapts (free drafts that hit in runs); a model drafter drafts the full length every
    step (each drafted token costs a forward; the tuned profile picks the length)."""
    import eagle_fixtures as ef
    from specpack.runtime.drafters.eagle3 import load_eagle3
    from specpack.runtime.spec_model import SpecModel, load_drafter, load_target

    target_dir = ef.target_dir("llama")
    target = load_target(target_dir)
    head = ef.random_head(tmp_path / "head", target_dir, draft_vocab=200)
    prompt = list(range(5, 25))
    eagle3 = SpecModel(target, load_eagle3(None, head, target))
    ngram = SpecModel(target, load_drafter("ngram", {"min_n": 1, "max_n": 2}, None, target))
    proposed = {(name, adaptive): m.generate(prompt, max_new_tokens=40, draft_len=4, adaptive=adaptive).stats.proposed
                for name, m in (("eagle3", eagle3), ("ngram", ngram)) for adaptive in (None, True, False)}
    assert proposed["eagle3", None] == proposed["eagle3", False] > proposed["eagle3", True]
    assert proposed["ngram", None] == proposed["ngram", True] < proposed["ngram", False]
