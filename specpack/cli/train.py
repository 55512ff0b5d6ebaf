"""Training commands: distill an EAGLE-3 or DSpark head for a target that ships none."""

from __future__ import annotations

from pathlib import Path

import click

from specpack._output import emit, progress_enabled
from specpack.cli._common import JSON, cli, int_list

DISTRIBUTION_LOSSES = {"l1": {"l1_alpha": 0.9, "soft_ce_alpha": 0.0},  # DSparkOptions fields per --distribution-loss
                       "soft-ce": {"l1_alpha": 0.0, "soft_ce_alpha": 0.9}}


@cli.command()
@click.argument("target", type=click.Path(path_type=Path))
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path),
              help="Head directory to write (a published layout; `specpack build --drafter OUT`).")
@click.option("--head", "head", type=click.Choice(["eagle3", "dspark"]), default="eagle3", show_default=True,
              help="eagle3: an EAGLE-3 head (SGLang layout); dspark: a DSpark block drafter (DeepSpec layout).")
@click.option("--block-size", type=int, help="DSpark: draft slots per block [default: 5].")
@click.option("--draft-layers", type=int, help="DSpark: backbone layers [default: 3].")
@click.option("--markov-rank", type=int, help="DSpark: rank of the Markov head [default: 64].")
@click.option("--distribution-loss", type=click.Choice(sorted(DISTRIBUTION_LOSSES)),
              help="DSpark: 0.9 x L1 (DeepSpec's) or 0.9 x cross-entropy (EAGLE-3's soft labels; the shipped "
                   "SmolLM2 head's) to the target's distribution, beside 0.1 x CE on its token [default: l1].")
@click.option("--data", type=click.Path(path_type=Path),
              help='JSONL of {"text"}, {"messages"} or {"prompt"[, "completion"]} lines.')
@click.option("--self-generate", type=int,
              help="Train on the target's own continuations of N seed prompts (--data prompts or built-in ones).")
@click.option("--samples-per-prompt", "samples", default=1, show_default=True, type=int,
              help="Continuations per seed prompt with --self-generate: the greedy one plus sampled ones.")
@click.option("--temperature", default=0.7, show_default=True, type=float,
              help="Sampling temperature of the extra continuations.")
@click.option("--gen-tokens", default=256, show_default=True, type=int, help="New tokens per continuation.")
@click.option("--draft-vocab", type=int, help="Rows of the head's vocabulary [default: min(8192, target vocab)].")
@click.option("--aux-layers", help="The target layers whose inputs the head reads, e.g. 1,3,5 (EAGLE-3's three "
              "features, DSpark's taps) [default: 2, L/2, L-3 of L layers].")
@click.option("--steps", default=2000, show_default=True, type=int)
@click.option("--seq-len", default=256, show_default=True, type=int)
@click.option("--lr", default=2e-3, show_default=True, type=float)
@click.option("--batch-size", default=4, show_default=True, type=int, help="Windows of --seq-len positions per step.")
@click.option("--train-lm-head/--keep-lm-head", default=True, show_default=True,
              help="Train the head's output rows, or keep the target's (fewer weights to fit on little data).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True,
              help="Dtype of the exported weights.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--resume/--no-resume", default=True, show_default=True, help="Continue from OUT's checkpoint.")
@JSON
def distill(target, out, head, block_size, draft_layers, markov_rank, distribution_loss, data, self_generate, samples,
            temperature, gen_tokens, draft_vocab, aux_layers, steps, seq_len, lr, batch_size, train_lm_head, dtype, seed,
            resume, json_mode):
    """Train an EAGLE-3 or DSpark head for TARGET against its own outputs (CPU-capable, resumable, seeded).

    \b
    Examples:
      specpack distill smollm2-135m -o smollm2-eagle3 --self-generate 512 --samples-per-prompt 4
      specpack distill smollm2-135m -o smollm2-dspark --self-generate 512 --head dspark
      specpack distill smollm2-135m -o smollm2-dspark --self-generate 512 --head dspark --distribution-loss soft-ce
      specpack distill ./target -o head --data chats.jsonl --draft-vocab 16384
      specpack distill ./small-target -o head --self-generate 64 --aux-layers 1,3,5
      specpack build smollm2-135m --drafter smollm2-eagle3 -o smollm2-eagle3-artifact
    """
    from specpack.distill import distill as do_distill

    given = {"block_size": block_size, "layers": draft_layers, "markov_rank": markov_rank}
    dspark = {k: v for k, v in given.items() if v is not None} | DISTRIBUTION_LOSSES.get(distribution_loss, {})
    result = do_distill(target, out, data=data, self_generate=self_generate, samples=samples, temperature=temperature,
                        gen_tokens=gen_tokens, draft_vocab=draft_vocab, aux_layer_ids=int_list(aux_layers, "--aux-layers"),
                        steps=steps, seq_len=seq_len, lr=lr, batch_size=batch_size, train_lm_head=train_lm_head,
                        dtype=dtype, seed=seed, resume=resume, head=head, dspark=dspark,
                        progress=progress_enabled(json_mode))
    data = {"out": str(result.out), "finished": result.finished, "record": result.record}
    emit(data, json_mode, lambda d: f"wrote {d['out']} ({'finished' if d['finished'] else 'partial: resume'})")
