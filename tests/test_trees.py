"""Draft trees: the tree mask and KV compaction against a chain of the accepted path (bit for bit on the
row-exact CPU kernels), the engine's tree steps (cache and drafter features exactly a chain's), the tree
drafters' trees, the accept walk and the cost model's choice of nodes."""

import pytest
import torch

import eagle_fixtures as ef
from eagle_fixtures import one_thread  # noqa: F401
from specpack.runtime.drafters.base import Draft, DraftJob, TreeShape
from specpack.runtime.drafters.ngram import continuations, trie
from specpack.runtime.drafters.tree import ancestor_mask, depths, fed_block
from specpack.runtime.engine import Engine, Request
from specpack.runtime.engine.cost import Calibration, CostModel, choose_nodes
from specpack.runtime.engine.sampling import accept_tree
from specpack.runtime.models.rows import Rows, Segment
from test_engine import model

PARENTS = [-1, -1, 0, 1, 1, 3]  # root -> 0, 1; 0 -> 2; 1 -> 3, 4; 3 -> 5
PATH = [1, 3, 5]  # accepted nodes: rows 2, 4, 6 of the verification, not contiguous


def test_ancestor_mask_and_depths():
    assert depths(PARENTS) == [1, 1, 2, 2, 2, 3]
    mask = ancestor_mask(PARENTS)  # row 0 the root, row i + 1 node i
    assert mask[6].nonzero().flatten().tolist() == [0, 2, 4, 6]  # node 5: root, 1, 3, itself
    assert mask[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert mask[0].tolist() == [True] + [False] * 6
    # a head's draft rows: nodes 3 and 4 fed after nodes 0 and 1 see their parent (1) and themselves
    assert fed_block(PARENTS, [0, 1], [3, 4]).tolist() == [[False, True, True, False], [False, True, False, True]]


def cache_rows(target, slot: int, n: int) -> list[torch.Tensor]:
    """The first n positions of `slot` in every cache tensor of a torch or graph target."""
    if hasattr(target, "caches"):  # GraphTarget: one SlotCache per slot
        return [target.caches[slot].store[:, :n].clone()]
    c = target.cache
    return [t[:, slot, :, :n].clone() for t in (c.k, c.v) if t is not None]


def same(a, b, exact: bool) -> bool:
    return torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-5, rtol=1e-5)


# dense and DeepSeek (MLA latent cache) targets, torch and ONNX Runtime
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("kind", ["ngram", "mtp-1"])
def test_a_verified_tree_compacts_to_the_cache_of_its_path(kind, backend):
    t = model(kind, backend).target
    exact = backend == "torch"  # the row-exact kernels see the same keys in the same order either way
    t.setup_cache(32, 2)
    g = torch.Generator().manual_seed(0)
    prompt, nodes = torch.randint(3, t.spec.vocab_size, (6,), generator=g), torch.randint(3, 50, (6,), generator=g)
    for slot in (0, 1):
        t.forward_rows(prompt[:-1], Rows.of([Segment(slot, 0, 5)]))
    at = 5 + torch.tensor([0] + depths(PARENTS))
    tree = t.forward_rows(torch.cat([prompt[-1:], nodes]), Rows.of([Segment(0, 5, 7, ancestor_mask(PARENTS), at)]))
    chain = t.forward_rows(torch.cat([prompt[-1:], nodes[PATH]]), Rows.of([Segment(1, 5, 4)]))
    assert same(tree.logits[[0, 2, 4, 6]], chain.logits, exact)
    t.compact(0, [5 + 2, 5 + 4, 5 + 6], [5 + 1, 5 + 2, 5 + 3])
    assert all(same(a, b, exact) for a, b in zip(cache_rows(t, 0, 9), cache_rows(t, 1, 9)))
    after = [t.forward_rows(torch.tensor([7]), Rows.of([Segment(slot, 9, 1)])).logits for slot in (0, 1)]
    assert same(after[0], after[1], exact)


class Oracle:
    """A stub drafter that knows the target's greedy continuation: at every depth its first child is
    wrong and its second right, with a wrong grandchild under the wrong one, so the accepted path
    skips rows. Records the features the engine hands it."""

    tree_drafts = True

    def __init__(self, inner, truth: list[int]):
        self.inner, self.truth, self.feats = inner, truth, []
        self.capture_layers = inner.capture_layers

    def reserve(self, slots, max_len):
        self.inner.reserve(slots, max_len)

    def start(self, slot):
        self.inner.start(slot)

    def draft(self, jobs):
        out = []
        for j in jobs:
            self.feats.append(j.feats)
            right = self.truth[len(j.context):]
            tokens, parents, tip = [], [], -1
            for d in range(min(j.k, len(right))):
                tokens += [(right[d] + 1) % 50 + 3, right[d], (right[d] + 2) % 50 + 3]
                parents += [tip, tip, len(tokens) - 3]  # wrong, right, a grandchild under the wrong one
                tip = len(tokens) - 2
            scores = torch.linspace(0.9, 0.1, len(tokens))
            out.append(Draft(torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents), scores=scores))
        return out


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_tree_steps_leave_the_cache_and_features_of_plain_decoding(backend):
    m = model("eagle3", backend)
    t, exact = m.target, backend == "torch"
    prompt = ef.training_prompts()[0].tolist()
    plain = m.generate(prompt, 12, speculative=False, eos_ids=()).tokens
    oracle = Oracle(m.drafter, prompt + plain)
    engine = Engine(t, oracle, slots=2, max_len=40, prefill_chunk=None)
    seq = engine.add(Request(prompt, 12, eos=(), draft_len=3, tree=TreeShape(2, 9)))
    while engine.running:
        engine.step()
    assert seq.new == plain and seq.stats.steps < 6 and seq.stats.accepted > 6  # paths through second children
    done = len(prompt) + len(plain) - 1  # positions in the target's cache
    t.setup_cache(40, 2)
    ref = t.forward_rows(torch.tensor((prompt + plain)[:done]), Rows.of([Segment(1, 0, done)]),
                         m.drafter.capture_layers)
    assert all(same(a, b, exact) for a, b in zip(cache_rows(t, 0, done), cache_rows(t, 1, done)))
    fed = torch.cat([f for f in oracle.feats if f is not None])
    assert same(fed, ref.aux[: len(fed)], exact)  # the accepted paths' rows, in order


def test_eagle3_tree_nodes_match_their_paths_drafted_as_chains():
    """Every node's probability, from one head forward per level with ancestor masks, equals the one
    its path gives when fed as a chain (head rows at the positions of their depths)."""
    m = model("eagle3", "torch")
    head, prompt = m.drafter, torch.tensor(ef.training_prompts()[1].tolist())
    m.target.setup_cache(32, 1)
    feats = m.target.forward_rows(prompt, Rows.of([Segment(0, 0, len(prompt))]), head.capture_layers).aux
    head.reserve(2, 32)
    tree = head.draft([DraftJob(0, prompt, feats[:-1], 3, None, TreeShape(3, 12))])[0]
    parents = tree.parents.tolist()
    for n in range(len(parents)):
        path = [n]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        assert chain_probability(head, prompt, feats[:-1], tree.tokens[path].tolist()) == pytest.approx(
            float(tree.scores[n]), rel=1e-5)


@torch.inference_mode()
def chain_probability(head, prompt, feats, tokens: list[int]) -> float:
    """The head's probability of `tokens` drafted one after another (slot 1, from scratch)."""
    head.start(1)
    rows = Rows.of([Segment(1, 0, len(feats))])
    out, logits = head._forward(head.fc(feats), prompt[1:], rows, rows.last_rows())
    head.lengths[1] = len(feats)
    h, p = out[-1:], 1.0
    to_draft = {int(t): d for d, t in enumerate(head.draft_to_target)}
    for step, tok in enumerate(tokens):
        p *= float(logits[0].softmax(-1)[to_draft[tok]])
        if step + 1 < len(tokens):
            out, logits = head._forward(h, torch.tensor([tok]), Rows.of([Segment(1, len(feats) + step, 1)]), [0])
            h = out
    return p


@pytest.mark.parametrize("kind", ["eagle3", "ngram", "draft_model", "mtp-2"])
def test_tree_drafters_give_trees_within_their_shape(kind):
    m = model(kind, "torch")
    prompt = torch.tensor(NGRAM_CONTEXT if kind == "ngram" else ef.training_prompts()[2].tolist())
    prompt = prompt % m.target.spec.vocab_size
    feats = None
    if m.drafter.capture_layers:
        m.target.setup_cache(64, 1)
        feats = m.target.forward_rows(prompt[:-1], Rows.of([Segment(0, 0, len(prompt) - 1)]),
                                      m.drafter.capture_layers).aux
    m.drafter.reserve(1, 64)
    jobs = [DraftJob(0, prompt, feats, 2, None, TreeShape(3, 7))]
    d = m.drafter.draft(jobs)[0]
    assert d.parents is not None and len(d.tokens) <= 7
    parents, tokens = d.parents.tolist(), d.tokens.tolist()
    assert all(p < i for i, p in enumerate(parents)) and max(depths(parents)) <= 2
    for p in set(parents):  # siblings differ, none has more than top-k children
        kids = [tokens[i] for i, q in enumerate(parents) if q == p]
        assert len(kids) == len(set(kids)) <= 3
    assert all(d.scores[i] <= (d.scores[p] if p >= 0 else 1.0) for i, p in enumerate(parents))


def test_nodes_whose_children_cannot_make_the_cut_are_not_expanded():
    from specpack.runtime.drafters.tree import Tree

    t = Tree()
    for token, p in [(10, 0.5), (11, 0.3), (12, 0.2)]:
        t.add(-1, token, p)
    t.add(0, 20, 0.9), t.add(0, 21, 0.1), t.add(1, 22, 0.5)  # logp: 0.45, 0.05, 0.15 at depth 2
    assert t.best(2, 3) == [3, 4, 5] and t.expandable(2, 3, 10) == [3, 4, 5]  # room for every node
    assert t.expandable(2, 3, 4) == [3]  # 4th likeliest so far: 0.2; a child of 0.15 is never above it
    assert t.expandable(2, 3, 2) == []  # 0.5 and 0.45 are the cut: a child of 0.45 loses the tie


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_skipped_expansions_leave_the_draft_as_it_was(kind, monkeypatch):
    """Tree.expandable only skips the rows that cannot change the draft: the trees drafted with it
    equal the trees of expanding every top-k node, from fewer drafter rows."""
    from specpack.runtime.drafters.tree import Tree

    m = model(kind, "torch")
    head, rows = m.drafter, []
    if kind == "eagle3":
        forward = head._forward
        monkeypatch.setattr(head, "_forward", lambda h, tokens, *a: rows.append(len(tokens)) or forward(h, tokens, *a))
    else:
        slot_logits = head._slot_logits
        monkeypatch.setattr(head, "_slot_logits", lambda b, h, prev, st: rows.append(len(prev)) or slot_logits(b, h, prev, st))

    def drafts():
        out = []
        for prompt in ef.training_prompts()[:3]:
            prompt = torch.tensor(prompt.tolist()) % m.target.spec.vocab_size
            m.target.setup_cache(64, 1)
            feats = m.target.forward_rows(prompt[:-1], Rows.of([Segment(0, 0, len(prompt) - 1)]),
                                          head.capture_layers).aux
            depth = min(4, getattr(head.spec, "draft_slots", 4))
            for shape in (TreeShape(3, 4), TreeShape(4, 6), TreeShape(2, 12)):
                head.reserve(1, 64)  # each draft from the same committed positions
                d = head.draft([DraftJob(0, prompt, feats, depth, None, shape)])[0]
                out.append((d.tokens.tolist(), None if d.parents is None else d.parents.tolist(), d.scores.tolist()))
        return out

    pruned, pruned_rows = drafts(), sum(rows)
    rows.clear()
    monkeypatch.setattr(Tree, "expandable", lambda self, depth, k, budget: self.best(depth, k))
    assert drafts() == pruned and sum(rows) > pruned_rows, (sum(rows), pruned_rows)


NGRAM_CONTEXT = [1, 2, 5, 6, 9, 1, 2, 7, 8, 9, 1, 2, 5, 3, 9, 1, 2]  # "1 2" went on three ways


def test_ngram_branches_are_the_continuations_of_earlier_occurrences():
    ctx = torch.tensor(NGRAM_CONTEXT)
    found = continuations(ctx, 1, 2, 2, 3)
    assert [f.tolist() for f in found] == [[5, 3], [7, 8], [5, 6]]  # most recent first
    d = trie(found, 8)
    assert d.tokens.tolist() == [5, 3, 7, 8, 6] and d.parents.tolist() == [-1, 0, -1, 2, 0]
    assert d.scores.tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert trie(found, 3).tokens.tolist() == [5, 3, 7]  # the budget keeps the likeliest (ties: most recent)


def test_accept_tree_walks_the_target_tokens():
    tokens = [10, 11, 12, 13, 14, 15]
    target = {-1: 11, 1: 13, 3: 15, 5: 99}
    assert accept_tree(tokens, PARENTS, target.get) == ([1, 3, 5], [11, 13, 15, 99])
    assert accept_tree(tokens, PARENTS, {-1: 12}.get) == ([], [12])
    assert accept_tree(tokens, PARENTS, {-1: 10, 0: 12, 2: 7}.get) == ([0, 2], [10, 12, 7])


def test_the_cost_model_keeps_likely_nodes_with_their_ancestors():
    flat = CostModel((1, 8, 32, 64), (10.0, 10.5, 11.5, 40.0))
    survival = [[0.9, 0.05, 0.8, 0.04, 0.03, 0.7], [0.3, 0.2]]
    node_depths = [depths(PARENTS), [1, 1]]
    assert choose_nodes(survival, node_depths, 2, flat, [10, 10], 20) == [[0, 1, 2, 3, 4, 5], [0, 1]]
    steep = CostModel((1, 2, 4, 8), (10.0, 14.0, 22.0, 38.0))  # every row costs 40% of a step
    assert choose_nodes(survival, node_depths, 2, steep, [10, 10], 20) == [[0, 2, 5], []]  # a path, whole
    # a draft that took 40 ms is part of the step whatever is verified: a row is weighed against the
    # step's whole rate, so the second sequence's likeliest node now pays (at 0.3 tokens for 4 ms)
    assert choose_nodes(survival, node_depths, 2, steep, [10, 10], 20, drafted_ms=40) == [[0, 2, 5], [0]]
    saturated = CostModel((1, 64), (10.0, 640.0))
    assert choose_nodes(survival, node_depths, 2, saturated, [10, 10], 20) == [[], []]
    parents = [-1, 0, -1, 1]  # a node whose draft probability beats its parent's estimate is capped by it
    c = Calibration(weight=0.05)
    assert c.estimate(parents, [0.8, 0.5, 0.1, 0.6]) == [0.8, 0.5, 0.1, 0.5]  # the drafter at its word
    for i in range(200):  # it says 0.9 at depth 1, the target takes depth 1 half the time
        c.update([1, 2, 1, 3], [0.8, 0.5, 0.1, 0.4], accepted=i % 2)
    est = c.estimate(parents, [0.8, 0.5, 0.1, 0.4])
    assert est[0] == pytest.approx(0.8 * 0.5 / 0.9, rel=0.1) and est[3] <= est[1] <= est[0]


def test_the_scheduler_serves_trees():
    from specpack.runtime.engine.scheduler import Job, Scheduler

    m = model("eagle3", "torch")
    prompts = [p[:6] for p in ef.training_prompts()[:4].tolist()]
    want = [m.generate(p, 10, speculative=False, eos_ids=()).tokens for p in prompts]
    with Scheduler(m, slots=3, max_len=32, draft_len=3, tree=TreeShape(3, 8)) as sch:
        got = [sch.submit(Job(p, 10)).result() for p in prompts]
        gauges = sch.gauges()
    assert [r.tokens for r in got] == [w[: len(r.tokens)] for w, r in zip(want, got)]
    assert sum(r.stats.accepted for r in got) > 0
    assert gauges["specpack_draft_tree_topk"][0] == 3 and gauges["specpack_draft_tree_nodes"][0] == 8


def test_chain_rows_are_made_from_ints_as_the_general_rows_are():
    segs = [Segment(2, 5, 3), Segment(0, 0, 1), Segment(1, 7, 2)]
    r = Rows.of(segs)
    assert r.slot.tolist() == [2, 2, 2, 0, 1, 1] and r.write.tolist() == [5, 6, 7, 0, 7, 8]
    assert r.pos.tolist() == r.write.tolist() and r.ctx.tolist() == [5, 5, 5, 0, 7, 7]
    assert r.end.tolist() == [6, 7, 8, 1, 8, 9] and r.mask is None
    assert [a for _, a in r.segments] == [0, 3, 4] and r.last_rows() == [2, 3, 5]
    assert all(t.dtype == torch.long for t in (r.slot, r.write, r.pos, r.ctx, r.end))
    moved = Rows.of([Segment(0, 4, 2, positions=torch.tensor([9, 9]))])  # positions of their own: the general rows
    assert moved.pos.tolist() == [9, 9] and moved.write.tolist() == [4, 5] and moved.end.tolist() == [5, 6]
