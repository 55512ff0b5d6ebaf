"""The adaptive draft length: longer while drafts are accepted, shorter and then none while they fail."""

from specpack.runtime.speculative import DraftLength


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
