"""The head families `distill` trains, with the same verbs: its options' `problems`, the head's
`config`, the trainable `model` (started from the target), the training `objective` and `write` (its
published layout). `FAMILIES[name](options)` makes one.

    eagle3   EAGLE-3 (head.py, train.py; SGLang layout)                       no options
    dspark   DSpark (dspark.py, dspark_train.py; DeepSpec Qwen3DSparkModel)   DSparkOptions fields
"""

from __future__ import annotations

from specpack.distill.vocab import DraftVocab

FLAGS = {"block_size": " (--block-size)", "layers": " (--draft-layers)", "markov_rank": " (--markov-rank)",
         "l1_alpha": " (--distribution-loss)", "soft_ce_alpha": " (--distribution-loss)"}


class Eagle3:
    name, layout = "eagle3", "eagle3-sglang"

    def __init__(self, options: dict | None = None):
        self.given = dict(options or {})

    def problems(self, spec, aux_ids) -> list[str]:
        return [f"DSpark option {k}{FLAGS.get(k, '')} given for an EAGLE-3 head (it applies to --head dspark)"
                for k in self.given]

    def config(self, spec, draft_vocab: int, aux_ids, feats):
        from specpack.distill.head import HeadConfig

        return HeadConfig.for_target(spec, draft_vocab, aux_ids)

    def model(self, config, target, vocab: DraftVocab, feats):
        from specpack.distill.head import TrainableHead

        head = TrainableHead(config, target.embed_tokens.weight)
        head.init_from_target(target, vocab.ids, feats.aux)
        return head

    def objective(self, config, vocab: DraftVocab):
        from specpack.distill.train import EAGLE3

        return EAGLE3

    def write(self, out, config, state: dict, vocab: DraftVocab, record: dict, dtype: str) -> None:
        from specpack.distill.export import write_head

        write_head(out, config, state, vocab, record, dtype)


class DSpark:
    name, layout = "dspark", "deepspec-dspark"

    def __init__(self, options: dict | None = None):
        from specpack.distill.dspark import DSparkOptions

        self.options, self.unknown = DSparkOptions.from_dict(options)

    def problems(self, spec, aux_ids) -> list[str]:
        """DeepSpec's layout lists the target layers in increasing order (validate_target_layer_ids)."""
        order = [] if list(aux_ids) == sorted(aux_ids) else [
            f"aux layer ids {list(aux_ids)}: DeepSpec's layout needs them in increasing order"]
        return self.unknown + self.options.problems(spec.vocab_size) + order

    def config(self, spec, draft_vocab: int, aux_ids, feats):
        from specpack.distill.dspark import DSparkConfig, unused_token

        mask = self.options.mask_token_id
        mask = unused_token(feats.tokens, feats.pred, spec.vocab_size) if mask is None else mask
        return DSparkConfig.for_target(spec, draft_vocab, aux_ids, self.options, mask)

    def model(self, config, target, vocab: DraftVocab, feats):
        from specpack.distill.dspark import DSparkHead

        head = DSparkHead(config, target.embed_tokens.weight)
        head.init_from_target(target, vocab.ids, feats.aux)
        return head

    def objective(self, config, vocab: DraftVocab):
        from specpack.distill.dspark_train import DSparkObjective

        return DSparkObjective(config, self.options, vocab)

    def write(self, out, config, state: dict, vocab: DraftVocab, record: dict, dtype: str) -> None:
        from specpack.distill.export import write_dspark

        write_dspark(out, config, state, vocab, record, dtype, self.options.anchors)


FAMILIES = {"eagle3": Eagle3, "dspark": DSpark}
