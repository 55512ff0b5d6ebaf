"""What `specpack tune` shows: the summary table and, when matplotlib is installed, PNG charts."""

from __future__ import annotations

from pathlib import Path


def summary(result) -> str:
    """The table `specpack tune` prints for a TuneResult."""
    p, e = result.profile, result.profile.evidence
    w = max([18] + [len(_setting(d)) + 2 for d in e.draft_len_sweep])  # the setting column
    rows = [f"{'setting':<{w}}{'tokens/s':>10}{'speedup':>9}{'accept len':>12}",
            f"{'no speculation':<{w}}{e.baseline_tokens_per_s:>10.1f}{1.0:>9.2f}{1.0:>12.2f}"]
    best = _key(p.settings) if p.settings.speculative else None
    rows += [f"{_setting(d):<{w}}{d.tokens_per_s:>10.1f}{d.speedup:>9.2f}{d.acceptance_length:>12.2f}"
             + ("  <- best" if _key(d) == best else "") for d in e.draft_len_sweep]
    if e.concurrency_sweep:
        rows += ["", f"{'concurrency':<{w}}{'off tok/s':>10}{'on tok/s':>10}"]
        rows += [f"{c.concurrency:<{w}}{c.baseline_tokens_per_s:>10.1f}{c.speculative_tokens_per_s:>10.1f}"
                 for c in e.concurrency_sweep]
    pos = ", ".join(f"{r:.2f}" for r in e.position_acceptance) or "-"
    mode = (f"speculation on, {_setting(p.settings)}, up to {p.settings.max_concurrency} "
            f"concurrent requests" if p.settings.speculative else "speculation off (it did not pay)")
    rows += ["", f"profile {p.name} ({p.id}): {mode}",
             f"  greedy output identical on all {e.prompts_checked} prompts; per-position acceptance: {pos}",
             f"  needs {p.memory.required_bytes / 2**20:,.1f} MiB; written to {result.manifest_path} "
             f"({'re-signed' if result.signed else 'unsigned: digests still verify'})"]
    rows += [f"  {x}" for x in result.plots] + result.notes
    return "\n".join(rows)


def _key(d) -> tuple:
    """A sweep point's or profile settings' shape: (draft length, top-k, nodes, lookup)."""
    return d.draft_len, d.tree_topk, d.tree_nodes, d.lookup


def _setting(d) -> str:
    """'draft length D', or 'tree DxKxM' (depth, top-k, nodes), with ' + lookup N' where prompt
    lookup ran beside the drafter, of a sweep point or profile settings."""
    shape = f"tree {d.draft_len}x{d.tree_topk}x{d.tree_nodes}" if d.tree_topk > 1 else f"draft length {d.draft_len}"
    return shape + (f" + lookup {d.lookup}" if d.lookup else "")


def save_plots(result, out: Path) -> tuple[list[Path], list[str]]:
    """PNG charts (tokens/s vs draft length; acceptance per position) when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], ["plots skipped: matplotlib is not installed (pip install matplotlib)"]
    out.mkdir(parents=True, exist_ok=True)
    e, name = result.profile.evidence, result.profile.name
    fig, ax = plt.subplots(figsize=(6, 4))
    chains = [p for p in e.draft_len_sweep if p.tree_topk == 1 and not p.lookup]
    ax.plot([p.draft_len for p in chains], [p.tokens_per_s for p in chains], "o-", label="speculative")
    trees = [p for p in e.draft_len_sweep if p.tree_topk > 1 and not p.lookup]
    if trees:
        ax.plot([p.draft_len for p in trees], [p.tokens_per_s for p in trees], "^", label="draft trees (depth)")
    copies = [p for p in e.draft_len_sweep if p.lookup]
    if copies:
        ax.plot([p.draft_len for p in copies], [p.tokens_per_s for p in copies], "s", label="with prompt lookup")
    ax.axhline(e.baseline_tokens_per_s, color="grey", ls="--", label="no speculation")
    ax.set(xlabel="draft length", ylabel="tokens/s", title=f"{name} on {e.workload.name}")
    ax.legend()
    paths = [out / f"{name}-draft-len.png"]
    fig.savefig(paths[0], dpi=100, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(1, len(e.position_acceptance) + 1), e.position_acceptance)
    ax.set(xlabel="draft position", ylabel="conditional acceptance rate", ylim=(0, 1),
           title=f"{name}: acceptance length {e.acceptance_length:.2f}")
    paths.append(out / f"{name}-acceptance.png")
    fig.savefig(paths[1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return paths, []
