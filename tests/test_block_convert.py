"""Block drafters (DFlash, DSpark, LiLiCorr) from every published layout → one canonical drafter:
the same head whichever layout it came from, every binding stated in the manifest, and every
mis-binding refused with the flag that settles it and nothing written."""

import json

import pytest
import torch
from safetensors.torch import load_file

import block_layouts as bl
from conftest import read_json
from specpack.converters import block, detect_drafter
from specpack.converters.base import AuxOverride, BlockOverrides
from specpack.errors import ConversionError, InputError, UnsupportedError
from specpack.packager import BuildOptions, build

FLAGS = {"specforge-dspark": BlockOverrides(layout="anchor_first")}  # its config states no query layout


def _build(tmp_path, target, drafter, name="art", aux=None, **flags):
    block_flags = BlockOverrides(**flags) if flags else FLAGS.get(block.detect(drafter))
    return build(BuildOptions(target=target, drafter=str(drafter), out=tmp_path / name, aux=aux,
                              block=block_flags)).out


def _refused(tmp_path, target, drafter, *texts, error=ConversionError, aux=None, **flags):
    with pytest.raises(error) as err:
        _build(tmp_path, target, drafter, "refused", aux=aux, **flags)
    shown = str(err.value)
    for text in texts:
        assert text in shown, shown
    assert not (tmp_path / "refused").exists()
    return err.value


def _head(art):
    return read_json(art / "drafter/config.json"), load_file(art / "drafter/model.safetensors")


def _same_head(a, b):
    (ca, ta), (cb, tb) = _head(a), _head(b)
    for c in (ca, cb):  # how the source counted its ids is the source's, not the head's
        c.pop("source_target_layer_ids"), c.pop("source_convention")
    assert ca == cb
    assert set(ta) == set(tb)
    for name, tensor in ta.items():
        assert tensor.dtype == tb[name].dtype and torch.equal(tensor, tb[name]), name


@pytest.mark.parametrize("layout", list(bl.WRITERS))
def test_every_layout_is_detected_and_builds(layout, tmp_path, tiny_target):
    drafter = bl.write(layout, tmp_path / "head", tiny_target)
    assert detect_drafter(str(drafter)) == ("block", layout)
    entry = read_json(_build(tmp_path, tiny_target, drafter) / "specpack.json")["drafter"]
    assert entry["kind"] == "block" and entry["source_layout"] == layout


@pytest.mark.parametrize("group", list(bl.GROUPS))
def test_the_canonical_head_is_the_same_whichever_layout_it_came_from(group, tmp_path, tiny_target):
    layouts = bl.GROUPS[group]
    arts = [_build(tmp_path, tiny_target, bl.write(lay, tmp_path / lay, tiny_target), f"art-{lay}")
            for lay in layouts]
    for art in arts[1:]:
        _same_head(arts[0], art)
    entries = [_binding_fields(read_json(a / "specpack.json")["drafter"]) for a in arts]
    assert all(e == entries[0] for e in entries)


def _binding_fields(entry: dict) -> dict:
    """The entry without what only describes the source (its layout, path, id convention, what settled it,
    what it states about its target)."""
    entry = {k: v for k, v in entry.items() if k not in ("source_layout", "source", "resolved_from", "made_for")}
    entry["target_features"] = entry["target_features"]["layer_ids"]
    return entry


def test_dspark_bindings_in_manifest_config_and_weights(tmp_path, tiny_target):
    art = _build(tmp_path, tiny_target, bl.write("deepspec-dspark", tmp_path / "head", tiny_target))
    d = read_json(art / "specpack.json")["drafter"]
    assert (d["algorithm"], d["query_layout"], d["block_size"], d["draft_slots"]) == ("dspark", "anchor_first", 4, 4)
    assert d["target_features"] == {"layer_ids": [2, 5, 7], "convention": "input_of_layer", "source_ids": [1, 4, 6],
                                    "source_convention": "output_of_layer", "produced_by": ["full+dense"] * 3}
    assert d["markov"] == {"rank": 8, "type": "vanilla"} and d["confidence"] == {"with_markov": True}
    # DeepSpec ships frozen copies of the target's tables: equal bit for bit, so shared and digested
    assert (d["embedding_source"], d["lm_head_source"]) == ("target", "target")
    assert len(d["target_embedding_sha256"]) == 64 and len(d["target_lm_head_sha256"]) == 64
    assert "DeepSpec" in d["resolved_from"]["query_layout"]
    config, tensors = _head(art)
    assert config["target_layer_ids"] == [2, 5, 7] and config["target_layer_convention"] == "input_of_layer"
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    source = load_file(tmp_path / "head/model.safetensors")
    for name, tensor in tensors.items():  # renamed at most, never changed
        assert torch.equal(tensor, source[name]), name


def test_modelopt_flat_names_become_deepspec_names(tmp_path, tiny_target):
    art = _build(tmp_path, tiny_target, bl.write("modelopt-dspark", tmp_path / "head", tiny_target))
    _, tensors = _head(art)
    assert {"markov_head.markov_w1.weight", "confidence_head.proj.weight"} <= set(tensors)
    assert not {"markov_w1.weight", "confidence_proj.weight"} & set(tensors)


def test_nemotron_keeps_its_own_embedding_and_fill_in_layout(tmp_path, tiny_target):
    art = _build(tmp_path, tiny_target, bl.write("nemotron35-dspark", tmp_path / "head", tiny_target))
    d = read_json(art / "specpack.json")["drafter"]
    assert (d["query_layout"], d["draft_slots"], d["embedding_source"]) == ("fill_in", 3, "drafter")
    assert d.get("target_embedding_sha256") is None and len(d["target_lm_head_sha256"]) == 64
    assert "embed_tokens.weight" in _head(art)[1]


def test_deepseek_dflash_block7_is_anchor_first_dflash(tmp_path, tiny_target):
    art = _build(tmp_path, tiny_target, bl.write("deepseek-dflash", tmp_path / "head", tiny_target))
    d = read_json(art / "specpack.json")["drafter"]
    assert (d["algorithm"], d["query_layout"], d["draft_slots"]) == ("dflash", "anchor_first", 4)


def test_lilicorr_geometry_and_sequential_names(tmp_path, tiny_target):
    art = _build(tmp_path, tiny_target, bl.write("lilicorr-sequential", tmp_path / "head", tiny_target))
    d = read_json(art / "specpack.json")["drafter"]
    assert d["lilicorr"] == bl.LILICORR and d["query_layout"] == "fill_in"
    names = set(_head(art)[1])
    assert "lilicorr.feature_norm.weight" in names and "lilicorr.layers.0.mlp.up_proj.weight" in names
    assert not any(old in n for n in names for old in ("feature_mlp.0.", "feature_mlp.1.", ".mlp.0.", ".mlp.2."))


def test_mask_embedding_file_becomes_a_tensor(tmp_path, tiny_target):
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    emb = torch.randn(64)
    torch.save({"mask_token_id": 5, "embedding": emb}, head / "mask_embedding.pt")
    art = _build(tmp_path, tiny_target, head)
    assert read_json(art / "specpack.json")["drafter"]["mask_embedding"] is True
    config, tensors = _head(art)
    assert config["mask_embedding"] is True and torch.equal(tensors["mask_embedding"], emb)


def test_inspect_and_card_show_the_bindings(tmp_path, tiny_target, cli):
    art = _build(tmp_path, tiny_target, bl.write("speculators-dspark", tmp_path / "head", tiny_target))
    code, out, _ = cli("inspect", art)
    assert code == 0
    for text in ("block from speculators-dspark", "dspark, anchor_first layout, block 4 → 4 draft slots",
                 "[2, 5, 7] (input_of_layer; source [2, 5, 7] input_of_layer)", "markov rank 8 (vanilla)",
                 "  draft length ", "4 (this drafter's default; the target alone: 63 on a GPU: (D + 1) x G"):
        assert text in out, out
    card = (art / "README.md").read_text()
    for text in ("## Drafter: block drafter", "| query layout | anchor_first", "| mask token | 5 |",
                 "Settled by: algorithm:", "| draft length | 4 (this drafter's default; the target alone: 63 on"):
        assert text in card, card


# ---- every mis-binding refused, with the flag that settles it where one does ----

def test_missing_target_layer_ids_needs_the_flag(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target), drop_dflash=("target_layer_ids",))
    _refused(tmp_path, tiny_target, head, "target layer ids", "--target-layer-ids")
    art = _build(tmp_path, tiny_target, head, aux=AuxOverride((1, 4, 6), "output_of_layer"))
    d = read_json(art / "specpack.json")["drafter"]
    assert d["target_features"]["layer_ids"] == [2, 5, 7] and "flag" in d["resolved_from"]["target_layer_ids"]


def test_target_ids_stated_in_two_conventions_must_agree(tmp_path, tiny_target):
    # the off-by-one mix-up: output-of ids written where input-of ids belong
    head = bl.edit_config(bl.write("vllm-dspark", tmp_path / "head", tiny_target),
                          {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]})
    _refused(tmp_path, tiny_target, head, "disagree", "eagle_aux_hidden_state_layer_ids", "--target-layer-ids")


def test_a_flag_never_overrides_stated_ids(tmp_path, tiny_target):
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    _refused(tmp_path, tiny_target, head, "only settles", aux=AuxOverride((1, 4, 6), "input_of_layer"))
    _build(tmp_path, tiny_target, head, aux=AuxOverride((2, 5, 7), "input_of_layer"))  # the same ids: accepted


def test_final_layer_output_is_refused(tmp_path, tiny_target):
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target, ids_out=(1, 4, 7))
    _refused(tmp_path, tiny_target, head, "final layer's output")


@pytest.mark.parametrize("layout", ["specforge-dspark", "vllm-dspark"])
def test_unstated_query_layout_needs_the_flag(layout, tmp_path, tiny_target):
    head = bl.edit_config(bl.write(layout, tmp_path / "head", tiny_target),
                          drop=("sample_from_anchor", "dspark_bonus_anchor"))
    _refused(tmp_path, tiny_target, head, "query layout", "--block-layout fill_in|anchor_first",
             layout=None)
    art = _build(tmp_path, tiny_target, head, layout="anchor_first")
    assert read_json(art / "specpack.json")["drafter"]["resolved_from"]["query_layout"] == "flag --block-layout"


def test_speculators_dspark_before_sample_from_anchor_needs_the_flag(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("speculators-dspark", tmp_path / "head", tiny_target), drop=("sample_from_anchor",))
    _refused(tmp_path, tiny_target, head, "--block-layout")


def test_contradicting_layout_markers_are_refused_and_a_flag_picks_one(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("vllm-dspark", tmp_path / "head", tiny_target), {"dspark_bonus_anchor": True})
    _refused(tmp_path, tiny_target, head, "disagrees with itself", "sample_from_anchor", "dspark_bonus_anchor")
    d = read_json(_build(tmp_path, tiny_target, head, layout="fill_in") / "specpack.json")["drafter"]
    assert d["query_layout"] == "fill_in" and d["draft_slots"] == 3


def test_zlab_dflash_saying_sample_from_anchor_is_refused(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target), dflash={"sample_from_anchor": True})
    _refused(tmp_path, tiny_target, head, "z-lab DFlash", "sample_from_anchor")


def test_a_layout_flag_never_overrides_the_layouts_definition(tmp_path, tiny_target):
    head = bl.write("deepspec-dspark", tmp_path / "head", tiny_target)
    _refused(tmp_path, tiny_target, head, "--block-layout fill_in contradicts", layout="fill_in")


def test_dflash_draft_model_with_lilicorr_markers_needs_the_algorithm_flag(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("lilicorr", tmp_path / "head", tiny_target), {"architectures": ["DFlashDraftModel"]})
    _refused(tmp_path, tiny_target, head, "plain DFlash", "--block-algorithm")
    art = _build(tmp_path, tiny_target, head, algorithm="lilicorr")
    assert read_json(art / "specpack.json")["drafter"]["algorithm"] == "lilicorr"
    # choosing dflash cannot drop the correlator silently
    _refused(tmp_path, tiny_target, head, "lilicorr.", algorithm="dflash")


@pytest.mark.parametrize("key", ["lilicorr_vector_eps", "lilicorr_logit_scale", "lilicorr_candidate_topk"])
def test_lilicorr_geometry_fields_are_required(key, tmp_path, tiny_target):
    head = bl.edit_config(bl.write("lilicorr", tmp_path / "head", tiny_target), drop_dflash=(key,))
    _refused(tmp_path, tiny_target, head, key)


def test_mask_token_missing_needs_the_flag(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target), drop_dflash=("mask_token_id",))
    _refused(tmp_path, tiny_target, head, "mask token id", "--mask-token-id")
    art = _build(tmp_path, tiny_target, head, mask_token_id=7)
    assert read_json(art / "specpack.json")["drafter"]["mask_token_id"] == 7


@pytest.mark.parametrize("update, text", [
    ({"dflash": {"mask_token_id": 384}}, "outside the target vocab"),
    ({"update": {"mask_token_id": 6}}, "disagrees with itself"),
])
def test_bad_or_conflicting_mask_token(update, text, tmp_path, tiny_target):
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target), **update)
    _refused(tmp_path, tiny_target, head, text)


def test_mask_embedding_for_another_token_and_mask_hidden_are_refused(tmp_path, tiny_target):
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    torch.save({"mask_token_id": 9, "embedding": torch.randn(64)}, head / "mask_embedding.pt")
    _refused(tmp_path, tiny_target, head, "mask_embedding.pt is for mask token 9")
    (head / "mask_embedding.pt").unlink()
    bl.edit_tensors(head, {"mask_hidden": torch.randn(64)})
    _refused(tmp_path, tiny_target, head, "mask_hidden")


def test_own_embedding_that_differs_is_kept_equal_copy_is_shared(tmp_path, tiny_target):
    head = bl.write("deepspec-dspark", tmp_path / "head", tiny_target)
    bl.edit_tensors(head, {"embed_tokens.weight": torch.randn(384, 64)})
    d = read_json(_build(tmp_path, tiny_target, head) / "specpack.json")["drafter"]
    assert (d["embedding_source"], d["lm_head_source"]) == ("drafter", "target")
    assert d.get("target_embedding_sha256") is None and len(d["target_lm_head_sha256"]) == 64


@pytest.mark.parametrize("layout, update, text", [
    ("zlab-dflash", {"target_hidden_size": 32}, "features of width 32"),
    ("zlab-dflash", {"num_target_layers": 36}, "num_target_layers = 36, this target's is 8"),
    ("zlab-dflash", {"vocab_size": 256}, "input vocab (256) is smaller"),
    ("zlab-dflash", {"rope_theta": 1000000.0}, "RoPE base 1000000.0 != the target's 10000"),
    ("zlab-dflash", {"is_neox_style": False}, "interleaved RoPE"),
    ("zlab-dflash", {"hidden_act": "gelu"}, "only silu"),
    ("zlab-dflash", {"quantization_config": {"quant_algo": "W4A16_NVFP4"}}, "quant_algo 'W4A16_NVFP4' but no "
                                                                            "quant_method"),
    ("zlab-dflash", {"block_size": 1}, "leaves no draft slot"),
    ("zlab-dflash", {"block_size": "4"}, "block size '4' is not an integer"),
    ("deepspec-dspark", {"target_layer_ids": "1,4,6"}, "target_layer_ids = '1,4,6' is not a list of layer ids"),
    ("deepspec-dspark", {"markov_rank": 16}, "markov rank: the checkpoint disagrees with itself"),
    ("deepspec-dspark", {"enable_confidence_head": False}, "confidence"),
    ("deepspec-dspark", {"markov_head_type": "gated"}, "markov type"),
    ("zlab-dflash", {"add_swa_attention_sink_bias": True}, "attention sinks"),
    ("zlab-dflash", {"layer_types": ["sliding_attention", "full_attention"]}, "no window is stated"),
])
def test_mismatches_against_the_target_or_itself(layout, update, text, tmp_path, tiny_target):
    head = bl.edit_config(bl.write(layout, tmp_path / "head", tiny_target), update)
    _refused(tmp_path, tiny_target, head, text)


def test_config_sizes_that_are_not_sizes(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target), {"target_hidden_size": "64"},
                          drop=("intermediate_size",))
    _refused(tmp_path, tiny_target, head, "target_hidden_size = '64': not a positive integer",
             "intermediate_size: missing", error=InputError)


def test_missing_rope_base_is_refused(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target), drop=("rope_theta",))
    _refused(tmp_path, tiny_target, head, "states no RoPE base")


def test_confidence_head_without_its_tensors_and_unmatched_names(tmp_path, tiny_target):
    head = bl.write("deepspec-dspark", tmp_path / "head", tiny_target)
    bl.edit_tensors(head, drop=("confidence_head.proj.weight", "confidence_head.proj.bias"))
    _refused(tmp_path, tiny_target, head, "confidence")
    # ModelOpt's flat names inside a DeepSpec checkpoint: never dropped silently
    head = bl.write("deepspec-dspark", tmp_path / "head2", tiny_target)
    bl.edit_tensors(head, rename={"confidence_head.proj.weight": "confidence_proj.weight",
                                  "confidence_head.proj.bias": "confidence_proj.bias"})
    _refused(tmp_path, tiny_target, head, "'confidence_proj.weight' maps to no canonical name")


def test_dspark_heads_in_a_checkpoint_that_declares_none_are_refused(tmp_path, tiny_target):
    # a dflash_*_block7 config (markov_rank 0, no confidence head) whose weights hold the heads
    head = bl.write("deepseek-dflash", tmp_path / "head", tiny_target)
    heads = {k: v for k, v in bl.canonical_tensors(bl.DSPARK, tiny_target).items() if "_head." in k}
    bl.edit_tensors(head, heads)
    _refused(tmp_path, tiny_target, head, "markov rank: the checkpoint disagrees with itself", "confidence")
    _refused(tmp_path, tiny_target, head, "contradicts", algorithm="dflash")  # no flag drops them


def test_misshapen_and_missing_tensors_all_listed(tmp_path, tiny_target):
    head = bl.edit_tensors(bl.write("zlab-dflash", tmp_path / "head", tiny_target),
                           {"fc.weight": torch.randn(64, 128)}, drop=("layers.1.mlp.up_proj.weight",))
    err = _refused(tmp_path, tiny_target, head, "fc.weight takes 128 inputs", "missing tensor 'layers.1.mlp.up_proj")
    assert len(err.problems) >= 2


def test_reduced_vocab_lilicorr_is_refused(tmp_path, tiny_target):
    head = bl.write("lilicorr", tmp_path / "head", tiny_target)
    bl.edit_tensors(head, {"lm_head.weight": torch.randn(256, 64), "d2t": torch.zeros(256, dtype=torch.int64)})
    _refused(tmp_path, tiny_target, head, "full target vocabulary")


@pytest.mark.parametrize("dflash, text", [
    ({"projector_type": "domino", "shift_label": True}, "Domino"),
    ({"conv_kernel_size": 4, "conv_group_size": 8}, "grouped convolutions"),
    ({"selector_rank": 8, "selector_top_k": 4}, "candidate selector"),
])
def test_unsupported_variants_are_refused_with_the_reason(dflash, text, tmp_path, tiny_target):
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target), dflash=dflash)
    _refused(tmp_path, tiny_target, head, text, error=UnsupportedError)


def test_conv_tensors_whose_config_lost_them_are_refused(tmp_path, tiny_target):
    head = bl.edit_tensors(bl.write("zlab-dflash", tmp_path / "head", tiny_target),
                           {"layers.0.attention_conv.base_kernel": torch.randn(2, 4, 64)})
    _refused(tmp_path, tiny_target, head, "grouped convolutions", error=UnsupportedError)


def test_block_flags_on_another_drafter_are_refused(tmp_path, tiny_target):
    with pytest.raises(InputError) as err:
        build(BuildOptions(target=tiny_target, drafter="ngram", out=tmp_path / "x",
                           block=BlockOverrides(layout="fill_in")))
    assert "--block-layout" in str(err.value) and not (tmp_path / "x").exists()


def test_cli_flags_reach_the_converter(tmp_path, tiny_target, cli):
    head = bl.edit_config(bl.write("specforge-dspark", tmp_path / "head", tiny_target), drop_dflash=("mask_token_id",))
    code, _, err = cli("build", tiny_target, "--drafter", head, "-o", tmp_path / "a")
    assert code == 2 and "--block-layout" in err and "--mask-token-id" in err and not (tmp_path / "a").exists()
    code, out, err = cli("build", tiny_target, "--drafter", head, "-o", tmp_path / "a", "--block-layout",
                         "anchor_first", "--mask-token-id", "5", "--json")
    assert code == 0, err
    assert json.loads(out)["drafter"] == "block"


def test_reduced_vocab_keeps_its_lm_head_and_d2t(tmp_path, tiny_target, caplog):
    ids = torch.randperm(384, generator=torch.Generator().manual_seed(1))[:256].sort().values
    head = bl.edit_tensors(bl.write("zlab-dflash", tmp_path / "head", tiny_target),
                           {"lm_head.weight": torch.randn(256, 64), "d2t": ids - torch.arange(256)})
    with caplog.at_level("INFO", logger="specpack"):
        d = read_json(_build(tmp_path, tiny_target, head) / "specpack.json")["drafter"]
    assert (d["vocab_map"], d["draft_vocab_size"], d["lm_head_source"]) == ("d2t", 256, "drafter")
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "lm_head" in r.getMessage()]
    # a draft vocabulary is the head's design: said once, at info level, with why (issue 62 point 5)
    assert said == [("INFO", "the drafter's lm_head.weight covers its own 256-token draft vocabulary (the "
                             "target's 384): kept, by design")]
    bl.edit_tensors(head, drop=("d2t",))
    _refused(tmp_path, tiny_target, head, "no d2t map")


def test_causal_sliding_layers_with_sinks_are_bound_per_layer(tmp_path, tiny_target):
    """Nemotron 3.5's attention: dflash_config causal + use_swa + swa_window_size, sinks in every layer
    (vLLM `_resolve_layer_attention`, qwen3_dflash.py @ 036a00d1)."""
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target),
                          dflash={"causal": True, "use_swa": True, "swa_window_size": 16, "attention_sink_bias": True})
    bl.edit_tensors(head, {f"layers.{i}.self_attn.attention_sink_bias": torch.randn(4) for i in range(2)})
    d = read_json(_build(tmp_path, tiny_target, head) / "specpack.json")["drafter"]
    assert (d["layer_causal"], d["sliding_window"], d["attention_sinks"]) == ([True, True], [16, 16], True)
    bl.edit_tensors(head, drop=("layers.1.self_attn.attention_sink_bias",))
    _refused(tmp_path, tiny_target, head, "attention_sink_bias tensors exist for layers [0] only")


def test_speculators_sliding_layers_follow_sliding_window_non_causal(tmp_path, tiny_target):
    head = bl.write("speculators-dflash", tmp_path / "head", tiny_target)
    config = read_json(head / "config.json")
    config["transformer_layer_config"].update(layer_types=["sliding_attention", "full_attention"], sliding_window=32,
                                              use_sliding_window=True)
    (head / "config.json").write_text(json.dumps(config))
    d = read_json(_build(tmp_path, tiny_target, head) / "specpack.json")["drafter"]
    assert (d["layer_causal"], d["sliding_window"]) == ([True, False], [32, None])
    bl.edit_config(head, {"sliding_window_non_causal": True})
    d = read_json(_build(tmp_path, tiny_target, head, "art2") / "specpack.json")["drafter"]
    assert d["layer_causal"] == [False, False]


def test_dspark_draft_model_that_is_not_qwen3_is_refused(tmp_path, tiny_target):
    # vLLM reads DSparkDraftModel as DeepSeek-V4's embedded DSpark unless model_type is qwen3
    head = bl.edit_config(bl.write("specforge-dspark", tmp_path / "head", tiny_target), {"model_type": "deepseek_v4"})
    _refused(tmp_path, tiny_target, head, "model_type 'deepseek_v4'", error=UnsupportedError, layout="anchor_first")


def test_speculators_verifier_must_be_the_target(tmp_path, tiny_target):
    head = bl.write("speculators-dspark", tmp_path / "head", tiny_target)
    config = read_json(head / "config.json")
    config["speculators_config"]["verifier"]["architectures"] = ["Qwen3ForCausalLM"]
    (head / "config.json").write_text(json.dumps(config))
    _refused(tmp_path, tiny_target, head, "speculators_config.verifier.architectures = ['Qwen3ForCausalLM']")


def test_a_drafter_for_another_target_builds_only_when_allowed_and_says_so(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target), update={"num_target_layers": 36})
    _refused(tmp_path, tiny_target, head, "num_target_layers = 36, this target's is 8", "--allow-target-mismatch")
    art = build(BuildOptions(target=tiny_target, drafter=str(head), out=tmp_path / "anyway",
                             allow_target_mismatch=True)).out
    d = read_json(art / "specpack.json")["drafter"]
    assert d["made_for"] == [{"stated_in": "num_target_layers", "value": 36, "target": 8, "matches": False}]
    assert d["target_mismatch_allowed"] is True
    plain = read_json(_build(tmp_path, tiny_target, bl.write("zlab-dflash", tmp_path / "h2", tiny_target), "ok") /
                      "specpack.json")["drafter"]
    assert plain["target_mismatch_allowed"] is False
