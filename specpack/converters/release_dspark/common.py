"""What both release DSpark layouts share: the dspark_* bindings checked against the target, and the
manifest entry."""

from __future__ import annotations

from specpack.converters.target_hf import Target, _dtype_bytes, quantization_entry
from specpack.families import quant
from specpack.schemas import BlockConfidence, BlockMarkov, ReleaseDSparkDrafter

KIND = "release_dspark"
MARKERS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids")


def markers(text: dict, target: Target, where: str, source: str, convention: str = "output_of_layer"
            ) -> tuple[dict, list[str]]:
    """dspark_block_size, dspark_noise_token_id and dspark_target_layer_ids as `text` (read from
    `where`) states them, each checked against the target (ids counted by `convention`); (bindings,
    problems)."""
    bad, resolved = [], {}
    for key in MARKERS:
        if text.get(key) is None:
            bad.append(f"{where} states no {key}: {source} requires it")
        else:
            resolved[key.removeprefix("dspark_")] = f"{where} {key}"
    noise, ids, vocab = text.get("dspark_noise_token_id"), text.get("dspark_target_layer_ids"), target.info.vocab_size
    if isinstance(noise, int) and not 0 <= noise < vocab:
        bad.append(f"dspark_noise_token_id {noise} is outside the target's vocabulary (0..{vocab - 1})")
    if ids is not None:
        bad += id_problems(ids, target.info.num_hidden_layers, convention.replace("_", " ").replace("layer", "layer i"))
    return {"block_size": text.get("dspark_block_size"), "noise_token_id": noise, "ids": list(ids or []),
            "resolved_from": resolved}, bad


def id_problems(ids: list, layers: int, counted: str = "output of layer i") -> list[str]:
    bad = [f"dspark_target_layer_ids[{i}] = {v}: not a target layer (0..{layers - 1}, {counted})"
           for i, v in enumerate(ids[:64]) if not (isinstance(v, int) and 0 <= v < layers)]
    if not ids:
        bad.append("dspark_target_layer_ids is empty: the drafter reads at least one target layer")
    elif len(set(map(str, ids))) != len(ids):
        bad.append(f"dspark_target_layer_ids {ids[:16]} names a layer twice")
    return bad


def entry(target: Target, found: dict, expected: dict, q, counts: dict, bind: dict, **fields):
    """(the manifest entry, the weight bytes it adds) of a checked release drafter (`expected`: name -> Tensor, as `found` holds
    them under `q`) and the bytes it adds."""
    from specpack.converters.target_hf import _numel

    names = {n for name, t in expected.items() for n in quant.stored_names(name, t, q) if n in found}
    arch = target.checked.arch
    drafter = ReleaseDSparkDrafter(
        block_size=bind["block_size"], noise_token_id=bind["noise_token_id"], target_layer_ids=bind["ids"],
        target_layer_convention=bind.get("convention", "output_of_layer"), markov=BlockMarkov(rank=bind["rank"], type="vanilla"),
        confidence=BlockConfidence(with_markov=bind["confidence_with_markov"]) if bind["confidence"] else None,
        quantization=quantization_entry(q, counts), tensors=len(names),
        parameters=sum(_numel(t.shape) for t in expected.values()),
        shared_tensors=[arch.embed, arch.lm_head or arch.embed], resolved_from=bind["resolved_from"], **fields)
    extra = sum(found[n].numel * _dtype_bytes(found[n].dtype) for n in names)
    return drafter, extra
