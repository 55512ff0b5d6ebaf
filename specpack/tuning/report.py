"""What `specpack tune` shows: the summary table and, when matplotlib is installed, PNG charts."""

from __future__ import annotations

from pathlib import Path


def summary(result) -> str:
    """The table `specpack tune` prints for a TuneResult."""
    p, e = result.profile, result.profile.evidence
    rows = [f"{'setting':<18}{'tokens/s':>10}{'speedup':>9}{'accept len':>12}",
            f"{'no speculation':<18}{e.baseline_tokens_per_s:>10.1f}{1.0:>9.2f}{1.0:>12.2f}"]
    rows += [f"{'draft length ' + str(d.draft_len):<18}{d.tokens_per_s:>10.1f}{d.speedup:>9.2f}"
             f"{d.acceptance_length:>12.2f}" + ("  <- best" if p.settings.speculative and
                                                d.draft_len == p.settings.draft_len else "")
             for d in e.draft_len_sweep]
    if e.concurrency_sweep:
        rows += ["", f"{'concurrency':<18}{'off tok/s':>10}{'on tok/s':>10}"]
        rows += [f"{c.concurrency:<18}{c.baseline_tokens_per_s:>10.1f}{c.speculative_tokens_per_s:>10.1f}"
                 for c in e.concurrency_sweep]
    pos = ", ".join(f"{r:.2f}" for r in e.position_acceptance) or "-"
    mode = (f"speculation on, draft length {p.settings.draft_len}, up to {p.settings.max_concurrency} "
            f"concurrent requests" if p.settings.speculative else "speculation off (it did not pay)")
    rows += ["", f"profile {p.name} ({p.id}): {mode}",
             f"  greedy output identical on all {e.prompts_checked} prompts; per-position acceptance: {pos}",
             f"  needs {p.memory.required_bytes / 2**20:,.1f} MiB; written to {result.manifest_path} "
             f"({'re-signed' if result.signed else 'unsigned: digests still verify'})"]
    rows += [f"  {x}" for x in result.plots] + result.notes
    return "\n".join(rows)


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
    ax.plot([p.draft_len for p in e.draft_len_sweep], [p.tokens_per_s for p in e.draft_len_sweep], "o-",
            label="speculative")
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
