"""The artifact's model card (README.md): a hub YAML header, then the bindings in plain words."""

from __future__ import annotations

from specpack.schemas import BlockDrafter, DraftModelDrafter, ReleaseDSparkDrafter, Eagle3Drafter, Manifest, MtpDrafter
from specpack.schemas.manifest import default_draft_len

TARGET_CARD = "README.target.md"


def render(m: Manifest) -> str:
    return "\n".join([_header(m), f"# {m.name}", "", _intro(m), "", _target(m), "",
                      _drafter(m), "", _memory(m), "", _usage(m), ""])


def _header(m: Manifest) -> str:
    base = m.target.source.repo_id
    tags = ["specpack", "speculative-decoding", m.drafter.kind]
    lines = ["---", "library_name: specpack", "pipeline_tag: text-generation", "tags:"]
    lines += [f"  - {t}" for t in tags]
    if base:
        lines.append(f"base_model: {base}")
    return "\n".join(lines + ["---", ""])


def _intro(m: Manifest) -> str:
    return (f"A specpack artifact (format v{m.format_version}): the target model, bytes unchanged, "
            f"with a `{m.drafter.kind}` drafter bound to it explicitly in `specpack.json`. "
            "Transformers and other engines load this directory as the plain target. "
            f"The target's own model card, if it had one, is kept as `{TARGET_CARD}`.")


def _target(m: Manifest) -> str:
    t = m.target
    return "\n".join([
        "## Target", "",
        "| field | value |", "|---|---|",
        f"| architecture | {t.architecture} ({t.model_type}) |",
        f"| layers × hidden | {t.num_hidden_layers} × {t.hidden_size} |",
        f"| heads / KV heads / head dim | {t.num_attention_heads} / {t.num_key_value_heads} / {t.head_dim} |",
        f"| vocab | {t.vocab_size} |", f"| dtype | {t.dtype} |",
        f"| parameters | {t.parameters:,} |"]
        + [f"| {k} | {v} |" for k, v in arch_rows(t.arch.model_dump() if t.arch else None,
                                                         default_draft_len(m))])


def arch_rows(a: dict | None, draft_len: int | None = None) -> list[tuple[str, str]]:
    """The target's architecture as (field, value) rows; `draft_len`: the artifact's default, which the
    draft-length row puts beside the target's GPU hint (a model directory has no drafter)."""
    """The decoder as its family reads it, as (field, value) rows (the card and `inspect` show them)."""
    if not a:
        return []
    from collections import Counter

    kinds = ", ".join(f"{n}× {k}" for k, n in Counter(a["layer_kinds"]).items())
    rows = [("family", f"{a['family']}" + (" (decoder in text_config; other towers carried)" if a["text_config"] else "")),
            ("layers", kinds)]
    e = a.get("experts")
    if e:
        rows.append(("experts", f"{e['active']} of {e['routed']} routed (width {e['size']})"
                                + (f" + {e['shared']} shared (width {e['shared_size']})" if e["shared"] else "")
                                + f", {e['layout'].replace('_', ' ')}"))
    rows.append(("parameters active / total", f"{a['active_parameters']:,} / {a['total_parameters']:,}"))
    state = a.get("state_bytes_per_sequence") or 0
    rows.append(("KV per token / state per sequence", f"{a['kv_bytes_per_token']:,} B (attention layers only)"
                                                      + (f" / {state:,} B" if state else "")))
    m = a.get("mtp")
    if m:
        rows.append(("MTP modules", f"{m['held']} held of {m['stated'] or 'unstated'} ({m['layout']}, {m['count_key']})"))
    if a.get("quantization"):
        rows.append(("quantization", quantization_text(a["quantization"])))
    rows.append(_draft_len_row(a["draft_len_start"], draft_len))
    rows.append(("runs on", "specpack's runtime and the engines" if a["runs"] else
                 "the engines only (`specpack serve --engine vllm`, `specpack export`)"))
    return rows


def _draft_len_row(hint: int, default: int | None) -> tuple[str, str]:
    """(D + 1) x G query rows fill one 128-row GPU tile (G query heads per cached KV head), so a verify of
    up to D + 1 tokens costs about one token's: a start to measure on a GPU, capped by the drafter."""
    why = f"{hint} on a GPU: (D + 1) x G query rows fill one 128-row tile, G query heads per KV head"
    if default is None:
        return "draft length to start from", why
    return "draft length", f"{default} (this drafter's default; the target alone: {why})"


def quantization_text(q: dict) -> str:
    """A checkpoint's quantization (the manifest's `quantization`, as JSON data) in one line."""
    form = "".join([", ue8m0 scales"] * (q.get("scale_format") == "ue8m0") + [", fp4 experts"] * (q.get("expert_dtype") == "fp4"))
    return (f"{q['scheme']} ({q['quant_method']}{form}): {q['quantized_linear']} linear weights quantized, "
            f"{q['unquantized_linear']} kept" + (f"; KV cache {q['kv_cache']}" if q.get("kv_cache") else ""))


def made_for_text(made_for: list[dict], allowed: bool) -> str:
    """A drafter's statements about its target (the manifest's `made_for`, as JSON data) in one line."""
    def verdict(m: dict) -> str:
        if m.get("matches") is None:
            return " (unchecked: the target states none)"
        return "" if m["matches"] else f" (MISMATCH: target {m.get('target')!r})"

    text = "; ".join(f"{m['stated_in']} {m['value']!r}{verdict(m)}" for m in made_for)
    return text + (" — built with --allow-target-mismatch: expect low acceptance" if allowed else "")


def release_dspark_rows(d: dict) -> list[tuple[str, str]]:
    """A DSpark drafter bound as its release ships it (the manifest's drafter, as JSON data), as rows."""
    q, conf = d.get("quantization"), d.get("confidence")
    where = ("the target's own weight files" if d["location"] == "target" else
             f"drafter/ ({len(d['files'])} files, byte for byte)")
    return [("layers", f"{d['layers']} {d['layer_kind']} in {where} (count: {d['layers_from']})"),
            ("decoder", d["decoder"]),
            ("block", f"{d['block_size']} draft tokens, noise token {d['noise_token_id']}, "
                      f"{'causal' if d['query_causal'] else 'non-causal'} within the block, window {d['sliding_window']}"),
            ("target layers", f"{d['target_layer_ids']} ({d['target_layer_convention']})"),
            ("heads", f"markov rank {d['markov']['rank']} ({d['markov']['type']})"
                      + (f", confidence{' +markov' if conf['with_markov'] else ''}" if conf else ", no confidence head")),
            ("shared with the target", ", ".join(d["shared_tensors"])),
            ("tensors / parameters", f"{d['tensors']} checked / {d['parameters']:,}"),
            ("quantization", quantization_text(q) if q else "none")]


def _drafter(m: Manifest) -> str:
    d = m.drafter
    if isinstance(d, ReleaseDSparkDrafter):
        return "\n".join([f"## Drafter: DSpark, as the release ships it (`{d.source_layout}`)", "",
                          "| binding | value |", "|---|---|",
                          *(f"| {k} | {v} |" for k, v in release_dspark_rows(d.model_dump()))])
    if isinstance(d, MtpDrafter):
        return _mtp(d)
    if isinstance(d, DraftModelDrafter):
        return _draft_model(d)
    if isinstance(d, BlockDrafter):
        return _block(d)
    if not isinstance(d, Eagle3Drafter):
        return (f"## Drafter: n-gram prompt lookup\n\nNo weights. Looks up the longest context suffix "
                f"of {d.max_n} down to {d.min_n} tokens and proposes up to {d.draft_len} tokens that followed its "
                f"{d.match} earlier occurrence.")
    aux = d.aux_hidden_states
    return "\n".join([
        "## Drafter: EAGLE-3 head", "",
        "| binding | value |", "|---|---|",
        f"| converted from | `{d.source_layout}` |",
        f"| aux hidden states | layers {aux.layer_ids}, counted as *input of layer i* "
        f"(source: {aux.source_ids or 'defaults'}, {aux.source_convention}) |",
        f"| draft vocab | {d.draft_vocab_size} (map: {d.vocab_map}, t2d: {d.t2d_source}) |",
        f"| embedding / lm_head | {d.embedding_source} / {d.lm_head_source} |",
        f"| concat order | {d.concat_order} |",
        f"| parameters / dtype | {d.parameters:,} / {d.dtype} |", *_checked_rows(d)])


def _checked_rows(d) -> list[str]:
    """Table rows for a drafter's quantization and what it states about its target, where it has them."""
    rows = [("quantization", quantization_text(d.quantization.model_dump()))] if d.quantization else []
    if d.made_for:
        rows.append(("made for", made_for_text([m.model_dump() for m in d.made_for], d.target_mismatch_allowed)))
    return [f"| {k} | {v} |" for k, v in rows]


def _mtp(d: MtpDrafter) -> str:
    where = "the target's own weight files" if d.location == "target" else "`drafter/model.safetensors`"
    return "\n".join([
        "## Drafter: MTP layers", "",
        "| binding | value |", "|---|---|",
        f"| converted from | `{d.source_layout}`, weights in {where} |",
        f"| layers | {d.num_layers} (more draft steps than layers: "
        f"{'layer k mod n' if d.allow_layer_reuse else 'refused'}) |",
        f"| concat order | {d.concat_order} |",
        f"| fed by | target {d.target_hidden_state}; layers chain their {d.chain_hidden_state} output |",
        f"| shared with the target | {', '.join(d.shared_tensors)} |",
        f"| duplicates checked equal | {', '.join(d.duplicates_checked) or 'none'} |",
        f"| parameters / dtype | {d.parameters:,} / {d.dtype} |"])


_QUERIES = {"fill_in": "[anchor, MASK × (B-1)]: each MASK slot predicts the token at its own position",
            "anchor_first": "[anchor, MASK × (B-1)]: each slot predicts the token after its position"}


def _block(d: BlockDrafter) -> str:
    f = d.target_features
    shipped = f" (shipped in the target's `{d.source.subfolder}/`, stored once)" if d.source.subfolder else ""
    rows = [
        ("converted from", f"`{d.source_layout}`{shipped}"),
        ("algorithm", d.algorithm),
        ("query layout", f"{d.query_layout}: {_QUERIES[d.query_layout]}"),
        ("block size / draft slots", f"{d.block_size} / {d.draft_slots}"),
        ("target features", f"layers {f.layer_ids}, counted as *input of layer i* (source: {f.source_ids}, "
                            f"{f.source_convention})"),
        ("mask token", f"{d.mask_token_id}" + (" (own mask embedding)" if d.mask_embedding else "")),
        ("embedding / lm_head", f"{_shared(d.embedding_source, d.target_embedding_sha256)} / "
                                f"{_shared(d.lm_head_source, d.target_lm_head_sha256)}"),
        ("vocab", f"input {d.vocab_size}, draft {d.draft_vocab_size} (map: {d.vocab_map})"),
        ("RoPE", f"base {d.rope_theta:g}, {d.rope_style}" + (f", scaling {d.rope_scaling}" if d.rope_scaling else "")),
        ("attention", _attention(d)),
        ("heads", _heads(d)),
        ("parameters / dtype", f"{d.parameters:,} / {d.dtype}")]
    settled = "; ".join(f"{k}: {v}" for k, v in d.resolved_from.items())
    return "\n".join(["## Drafter: block drafter", "", "| binding | value |", "|---|---|"]
                     + [f"| {k} | {v} |" for k, v in rows] + _checked_rows(d) + ["", f"Settled by: {settled}."])


def _shared(source: str, digest: str | None) -> str:
    return f"target (sha256 {digest[:16]}…)" if source == "target" and digest else source


def _attention(d: BlockDrafter) -> str:
    causal = "causal" if all(d.layer_causal) else "non-causal" if not any(d.layer_causal) else \
        f"causal per layer {d.layer_causal}"
    windows = "full" if not any(d.sliding_window) else f"windows {d.sliding_window}"
    return f"{causal} within the block, {windows}" + (", attention sinks" if d.attention_sinks else "")


def _heads(d: BlockDrafter) -> str:
    parts = []
    if d.markov:
        parts.append(f"Markov rank {d.markov.rank} ({d.markov.type})")
    if d.confidence:
        parts.append("confidence" + (" (with Markov embedding)" if d.confidence.with_markov else ""))
    if d.lilicorr:
        g = d.lilicorr
        parts.append(f"LiLiCorr top-{g.candidate_topk}, {g.num_layers} layer(s) × {g.hidden_size}, {g.num_heads} "
                     f"heads, factor {g.factor_dim}, eps {g.vector_eps:g}, scale {g.logit_scale:g}")
    return "; ".join(parts) or "none"


def _draft_model(d: DraftModelDrafter) -> str:
    t = d.tokenizer
    return "\n".join([
        "## Drafter: draft model", "",
        "| binding | value |", "|---|---|",
        f"| model | {d.architecture} ({d.model_type}), {d.num_layers} layers × {d.hidden_size} |",
        f"| tokenizer | {t.vocab_tokens} tokens with the target's ids; special tokens identical; files "
        f"{'identical' if t.files_identical else 'differ, vocabularies equal'} |",
        f"| vocab rows | draft {t.draft_vocab_size}, target {t.target_vocab_size} (past {t.vocab_tokens}: padding) |",
        f"| parameters / dtype | {d.parameters:,} / {d.dtype} |"])


def _memory(m: Manifest) -> str:
    mem = m.memory
    return "\n".join([
        "## Memory", "",
        f"- target weights: {mem.target_weight_bytes / 2**20:,.1f} MiB; drafter adds "
        f"{mem.drafter_weight_bytes / 2**20:,.1f} MiB",
        f"- KV cache per token: target {mem.target_kv_bytes_per_token:,} B, drafter "
        f"{mem.drafter_kv_bytes_per_token:,} B"])


def _usage(m: Manifest) -> str:
    return "\n".join([
        "## Use", "", "```bash",
        f"specpack verify {m.name} --key signer.pub",
        f"specpack run {m.name} --prompt 'Hello'", "```"])
