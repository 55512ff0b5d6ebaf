"""Artifact commands: build, keygen, sign, verify, inspect, import-gguf."""

from __future__ import annotations

from pathlib import Path

import click

from specpack._output import emit, progress_enabled, table
from specpack.cli._common import JSON, PUBKEY, cli, signing_key


@cli.command()
@click.argument("target")
@click.option("--drafter", required=True,
              help="Drafter: a directory or hf://org/name[@rev] (EAGLE-3 official/SGLang/ModelOpt/vLLM speculators head, DFlash/DSpark/"
                   "LiLiCorr block drafter, MTP head, MiniMax-M3.1's dspark/, or a draft model), 'mtp' (the "
                   "target's own MTP layers), 'dspark-stages' (DeepSeek-V4 / V4.1's own DSpark stages), 'bundled' (the "
                   "one drafter the release ships: MTP or DSpark stages in its weights, or a subfolder such as "
                   "dspark/; `specpack inspect TARGET` lists them) or 'ngram'.")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="Artifact directory to create.")
@signing_key(help="EC private key (PEM) to sign with. Without it the artifact is unsigned: digests still guard "
                  "integrity; sign later with `specpack sign`")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--aux-layer-ids", "--target-layer-ids", "aux_layer_ids",
              help="Target layers whose hidden states feed the drafter's fc, e.g. 2,16,29: overrides an EAGLE-3 "
                   "head's aux ids; for a block drafter it may only supply ids its checkpoint lacks or confirm them.")
@click.option("--aux-convention", type=click.Choice(["input", "output"]),
              help="How --aux-layer-ids/--target-layer-ids count: 'input' of layer i (EAGLE, vLLM aux ids, "
                   "speculators) or 'output' of layer i (TRT-LLM, ModelOpt, z-lab/DeepSpec target_layer_ids).")
@click.option("--block-layout", type=click.Choice(["fill_in", "anchor_first"]),
              help="Block drafter query layout, when the checkpoint does not say: 'fill_in' (z-lab DFlash, LiLiCorr: "
                   "B-1 mask slots predict their own positions) or 'anchor_first' (DeepSpec DSpark: B slots, the "
                   "anchor's slot predicts the next token).")
@click.option("--block-algorithm", type=click.Choice(["dflash", "dspark", "lilicorr"]),
              help="Block drafter algorithm, when its architecture and markers disagree (e.g. DFlashDraftModel with "
                   "LiLiCorr markers).")
@click.option("--mask-token-id", type=int, help="Block drafter MASK token id, when its config states none.")
@click.option("--ngram-min", default=1, show_default=True, help="n-gram drafter: shortest suffix.")
@click.option("--ngram-max", default=4, show_default=True, help="n-gram drafter: longest suffix.")
@click.option("--draft-len", default=5, show_default=True, help="n-gram drafter: default tokens proposed.")
@click.option("--ngram-match", type=click.Choice(["latest", "earliest"]), default="latest", show_default=True,
              help="n-gram drafter: copy what followed the suffix's latest earlier occurrence (going on past the "
                   "context's end), or its earliest (stopping there: vLLM's ngram proposer).")
@click.option("--mtp-allow-reuse", is_flag=True,
              help="MTP: allow more draft tokens than MTP layers (step k reuses layer k mod n).")
@click.option("--copy", "copy_files", is_flag=True, help="Copy target files even where hard links work.")
@click.option("--allow-remote-code", is_flag=True,
              help="Accept a target that needs its own code (auto_map, .py files): it is carried and recorded "
                   "in the manifest; specpack itself never runs it.")
@click.option("--allow-target-mismatch", is_flag=True,
              help="Build a drafter whose config states another target (a speculators verifier, a layer count) "
                   "than this one; the manifest and inspect then say so. Expect low acceptance.")
@click.option("--endpoint", envvar="HF_ENDPOINT", help="hf://: the Hugging Face hub endpoint [env: HF_ENDPOINT].")
@JSON
def build(target, drafter, out, key, force, aux_layer_ids, aux_convention, block_layout, block_algorithm,
          mask_token_id, ngram_min, ngram_max, draft_len, ngram_match, mtp_allow_reuse, copy_files, allow_remote_code,
          allow_target_mismatch, endpoint, json_mode):
    """Convert TARGET and its drafter into one (signed) artifact at OUT.

    \b
    Examples:
      specpack build ./target --drafter ./eagle3-head -o my-artifact --key signer.pem
      specpack build ./target --drafter ngram --ngram-max 3 --draft-len 6 -o my-artifact
      specpack build ./release --drafter bundled -o my-artifact   # the drafter the release ships
      specpack build ./DeepSeek-V4-Flash-DSpark --drafter bundled -o v4-dspark   # its mtp.* stages, in place
      specpack build ./deepseek-v3 --drafter mtp -o deepseek-mtp --key signer.pem
      specpack build ./qwen3-8b --drafter ./dspark-head --block-layout anchor_first -o qwen3-dspark
      specpack build hf://org/release@main --drafter bundled -o art   # checked by range requests, then
                                                                     # only what the artifact carries fetched

    A hub release (hf://org/name[@branch|tag|commit]) is checked from its configs, index and safetensors
    headers first (as `inspect hf://`): one that would be refused downloads nothing. Then the weights,
    configs and tokenizer (not original/ copies, other precisions or images) are fetched into the hub cache
    (HF_TOKEN or the saved login, HF_ENDPOINT; a cached file is not fetched again, a dropped download
    resumes), each checked against the hub's sha256, and the commit is recorded as the target's source.
    """
    from specpack.converters.base import AuxOverride, BlockOverrides
    from specpack.packager import BuildOptions, NgramParams, build as do_build
    from specpack.packager import hub_release

    say = (lambda line: click.echo(line, err=True)) if not json_mode else (lambda line: None)
    fetched = {}
    if hub_release.is_hub(target):
        fetched["target"] = hub_release.fetch_target(target, drafter, endpoint, allow_remote_code, say)
    if hub_release.is_hub(drafter):
        fetched["drafter"] = hub_release.fetch_drafter(drafter, endpoint, say)
    t, d = fetched.get("target"), fetched.get("drafter")
    opts = BuildOptions(target=t.root if t else Path(target), drafter=str(d.drafter) if d else drafter, out=out, key=key,
                        force=force, target_files=t.files if t else None, target_source=t.source if t else None,
                        drafter_source=d.source if d else None,
                        aux=AuxOverride.parse(aux_layer_ids, aux_convention),
                        block=BlockOverrides(block_layout, block_algorithm, mask_token_id),
                        ngram=NgramParams(ngram_min, ngram_max, draft_len, ngram_match), link=not copy_files,
                        mtp_allow_reuse=mtp_allow_reuse, allow_remote_code=allow_remote_code,
                        allow_target_mismatch=allow_target_mismatch,
                        progress=progress_enabled(json_mode))
    result = do_build(opts)
    data = {"artifact": str(result.out), "signed": result.signed, "seconds": round(result.seconds, 3),
            "files": len(result.manifest.files), "drafter": result.manifest.drafter.kind, "notes": result.notes,
            **({"fetched": {k: {"source": f.source.model_dump(exclude_none=True), "files": len(f.files), "bytes": f.bytes,
                                "skipped": list(f.skipped)} for k, f in fetched.items()}} if fetched else {})}
    emit(data, json_mode, lambda d: "\n".join([f"built {d['artifact']} ({d['drafter']} drafter, {d['files']} files, "
                                               f"{'signed' if d['signed'] else 'UNSIGNED'}) in {d['seconds']:.2f}s",
                                               *(f"note: {n}" for n in d["notes"])]))


@cli.command()
@click.argument("prefix", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace existing key files.")
@JSON
def keygen(prefix, force, json_mode):
    """Write an ECDSA P-256 key pair: PREFIX.pem (private) and PREFIX.pub (public).

    \b
    Example:
      specpack keygen signer      # signer.pem, signer.pub
    """
    from specpack.packager import keygen as do_keygen

    pair = do_keygen(prefix, force)
    emit({"private_key": str(pair.private), "public_key": str(pair.public)}, json_mode,
         lambda d: f"private key: {d['private_key']} (keep it secret)\npublic key:  {d['public_key']}")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@signing_key(required=True, help="EC private key (PEM)")
@JSON
def sign(artifact, key, json_mode):
    """Check ARTIFACT's digests, then sign it (replacing any old signature).

    \b
    Example:
      specpack sign my-artifact --key signer.pem
    """
    from specpack.packager import sign_artifact

    report = sign_artifact(artifact, key, progress=progress_enabled(json_mode))
    emit({"artifact": str(artifact), "files": report.files}, json_mode,
         lambda d: f"signed {d['artifact']} ({d['files']} files)")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@PUBKEY
@click.option("--require-signature", is_flag=True, envvar="SPECPACK_REQUIRE_SIGNATURE",
              help="Fail unless a signature is checked.")
@JSON
def verify(artifact, public_key, require_signature, json_mode):
    """Check ARTIFACT's signature (with --key) and the digest of every file.

    On failure every changed, missing and extra file is listed and the exit code is 3.

    \b
    Examples:
      specpack verify my-artifact --key signer.pub
      specpack verify my-artifact            # digests only
    """
    from specpack.packager import verify as do_verify

    r = do_verify(artifact, public_key, require_signature, progress=progress_enabled(json_mode))
    data = {"artifact": str(artifact), "ok": True, "signed": r.signed,
            "signature_checked": r.signature_checked, "files": r.files, "bytes": r.bytes,
            "trust": r.trust}
    emit(data, json_mode, lambda d: f"OK {d['artifact']}: {d['files']} files, {d['trust']}")


@cli.command()
@click.argument("artifact")
@click.option("--endpoint", envvar="HF_ENDPOINT", help="hf://: the Hugging Face hub endpoint [env: HF_ENDPOINT].")
@JSON
def inspect(artifact, endpoint, json_mode):
    """Summarise ARTIFACT: target, drafter and its bindings, memory, signature, files.

    On a model directory that is not an artifact (a release as downloaded), list the drafters it
    bundles: MTP modules in its weights, DSpark stages its config declares, drafters in a subfolder
    (`dspark/`), each with its layout and what `build --drafter bundled` would bind. On a .gguf file,
    say what it is: a target (with its nextn MTP layers) or a llama.cpp drafter and the target it was
    made for (width, vocabulary, the layers it reads), from its metadata alone. On hf://org/name[@rev],
    check the release's target on the hub before downloading it: configs, index and every shard's
    safetensors header by range requests (HF_TOKEN / login, HF_ENDPOINT as the hub client reads them),
    never a tensor's bytes; it reports the bytes and requests that took.

    \b
    Examples:
      specpack inspect my-artifact --json | jq .drafter
      specpack inspect ./MiniMax-M3.1        # what the release bundles
      specpack inspect draft-eagle3.gguf     # which target a llama.cpp drafter GGUF was made for
      specpack inspect hf://deepseek-ai/DeepSeek-V4-Flash-DSpark@main   # check it before downloading
    """
    from specpack.schemas import MANIFEST_NAME

    if artifact.startswith("hf://"):
        emit(_hub_release(artifact, endpoint), json_mode, _hub_text)
        return
    artifact = Path(artifact)
    if artifact.suffix == ".gguf" and artifact.is_file():
        from specpack.converters.gguf import describe_gguf

        emit(describe_gguf(artifact), json_mode, _gguf_text)
        return
    if not (artifact / MANIFEST_NAME).is_file() and (artifact / "config.json").is_file():
        emit(_release(artifact), json_mode, _release_text)
        return
    from specpack.exports import engine_limits
    from specpack.packager import describe, read_manifest

    data = describe(artifact)
    data["engines"] = engine_limits(read_manifest(artifact))
    emit(data, json_mode, _inspect_text)


def _hub_release(spec: str, endpoint: str | None = None) -> dict:
    """A hub release's target checked by range requests (converters/hub_files), and what that read."""
    from specpack.converters import bundled, target_hf
    from specpack.converters.hub_files import HubFiles
    from specpack.errors import InputError, UnsupportedError
    from specpack.packager.hub_release import bundled_folders, carried as carried_files

    files = HubFiles.open(spec, endpoint=endpoint)
    target = target_hf.check(files, files.source)
    found = bundled.find_in(files, target)
    try:
        binds, why = bundled.choose(files.label(), found), None
    except (InputError, UnsupportedError) as exc:
        binds, why = None, exc.message
    carried = sum(files.size(f) for f in carried_files(files, target, bundled_folders(found)))
    size = sum(files.size(f) for f in files.list())
    engines = _engines_for(target, binds)
    return {"release": spec, "repo_id": files.repo_id, "revision": files.revision, "commit": files.commit,
            "bundled": [b.to_dict() for b in found], "drafter_bundled": binds, **({"why_not": why} if why else {}),
            **({"engines": engines} if engines is not None else {}),
            "target": target.info.model_dump(mode="json", exclude_none=True), "files": len(files.list()),
            "repository_bytes": size, "build_would_download_bytes": carried,
            "bytes_read": files.bytes_read, "requests": files.requests}


def _engines_for(target, drafter: str | None) -> dict[str, list[str]] | None:
    """Which export engines would serve the artifact `build --drafter bundled` makes of a release read on the
    hub (exports.engine_limits on the manifest it would state), where the binding is checked from headers
    alone (a release's DSpark stages); None where it needs the downloaded files first."""
    from specpack.converters import release_dspark
    from specpack.exports import engine_limits
    from specpack.packager.build import manifest_of

    if drafter != release_dspark.deepseek_v4.SPEC:
        return None
    return engine_limits(manifest_of("preview", target, release_dspark.convert_in_target(target)))


def _hub_text(d: dict) -> str:
    from specpack.packager.card import arch_rows

    t = d["target"]
    rows = [("release", f"{d['release']} -> commit {d['commit']}"),
            ("target", f"{t['architecture']} {t['num_hidden_layers']}L×{t['hidden_size']}, vocab {t['vocab_size']}, "
                       f"{t['dtype']}, {t['parameters']:,} params: every tensor checked from its header")]
    rows += [(f"  {k}", v) for k, v in arch_rows(t.get("arch"))]
    rows += _bundled_rows(d)
    rows += _engine_rows(d.get("engines", {})) if "engines" in d else \
        [("export engines", "known once the drafter is bound (`specpack inspect ART` after the build)")]
    rows += [("build would download", f"{d['build_would_download_bytes'] / 2**20:,.1f} MiB of the repository's "
                                      f"{d['repository_bytes'] / 2**20:,.1f} MiB ({d['files']} files)"),
             ("read to check it", f"{d['bytes_read']:,} bytes in {d['requests']} requests")]
    return table(rows)


def _gguf_text(d: dict) -> str:
    rows = [("gguf", f"{d['file']} ({d['architecture']}, {d['tensors']} tensors, {d['bytes'] / 2**20:,.1f} MiB; "
                     + ", ".join(f"{n} {k}" for k, n in d["tensor_types"].items()) + ")")]
    if d["role"] == "drafter":
        rows += [("drafter", f"{d['drafter']} (llama.cpp drafter GGUF), {d['layers']} layer(s) of width {d['hidden_size']}"),
                 ("made for", f"a target of hidden size {d['target_hidden_size']}, vocab {d['vocab_size']}, reading "
                              f"layers {d['target_layers']} (input of layer i: a target of at least "
                              f"{max(d['target_layers'] or [0])} layers)"),
                 ("draft vocab", f"{d['draft_vocab_size']}" + (" (d2t maps it to target ids)"
                                                               if d["draft_vocab_size"] != d["vocab_size"] else "")),
                 ("embedding / lm_head", f"{'its own' if d['own_embedding'] else 'the target' + chr(39) + 's'} / "
                                         f"{'its own' if d['own_lm_head'] else 'the target' + chr(39) + 's'}")]
        if d["architecture"] == "dflash":
            rows.append(("block", f"{d['block_size']} ({'anchor-first' if d['sample_from_anchor'] else 'fill-in'}), "
                                  f"mask token {d['mask_token_id']}, Markov rank {d['markov_rank'] or 'none'}, "
                                  f"confidence head {'yes' if d['confidence_head'] else 'no'}"))
        rows.append(("bind it", "specpack build TARGET --drafter " + d["file"] + " (checks the pairing)"))
    else:
        trunk = (d["layers"] or 0) - (d["nextn_predict_layers"] or 0)
        rows += [("target", f"{trunk} layers of width {d['hidden_size']}, vocab {d['vocab_size']}"
                            + (f" (+ {d['nextn_predict_layers']} nextn)" if d["nextn_predict_layers"] else "")),
                 ("MTP (nextn)", f"{d['nextn_predict_layers']} layer(s) stated, {d['nextn_tensors']} nextn tensors held"
                                 + (": import-gguf keeps them (`build --drafter mtp` binds them), or `build "
                                    "TARGET --drafter FILE.gguf` binds them to a target shipped without them"
                                    if d["nextn_tensors"] and d["architecture"] == "deepseek2" else "")),
                 ("import it", f"specpack import-gguf {d['file']} -o DIR")]
    return table(rows)


def _engine_rows(engines: dict) -> list[tuple[str, str]]:
    """Which export engines serve the drafter (`specpack export --to NAME`), and why the others do not."""
    if not engines:
        return []
    can = [name for name, why in engines.items() if not why]
    rows = [("export engines", ", ".join(can) if can else "none")]
    return rows + [(f"  not {name}", why[0] + (f" (+{len(why) - 1} more)" if len(why) > 1 else ""))
                   for name, why in engines.items() if why]


def _release(root: Path) -> dict:
    from specpack.converters import bundled
    from specpack.errors import InputError, UnsupportedError

    found = bundled.find(root)
    try:
        binds = bundled.choose(root, found)
    except (InputError, UnsupportedError) as exc:
        binds, why = None, exc.message
    else:
        why = None
    return {"release": str(root), "bundled": [b.to_dict() for b in found],
            "drafter_bundled": binds, **({"why_not": why} if why else {})}


def _release_text(d: dict) -> str:
    return table([("release", f"{d['release']} (a model directory, not an artifact)")] + _bundled_rows(d))


def _bundled_rows(d: dict) -> list[tuple[str, str]]:
    rows = []
    for b in d["bundled"]:
        binds = f"--drafter {b['drafter']}" if "drafter" in b else f"cannot be bound: {b['why_not']}"
        rows.append((f"  layout {b['layout']}", f"{b['kind']} in {b['where']}: {b['detail']}; {binds}"))
    if not d["bundled"]:
        rows.append(("  bundled", "no drafter"))
    rows.append(("--drafter bundled", f"binds {d['drafter_bundled']}" if d["drafter_bundled"] else
                 f"refused: {d['why_not']}"))
    return rows


def _inspect_text(d: dict) -> str:
    t, dr, mem = d["target"], d["drafter"], d["memory"]
    rows = [("artifact", f"{d['name']} (format v{d['format_version']}, specpack {d['specpack_version']}, "
                         f"{d['created']})"),
            ("target", f"{t['architecture']} {t['num_hidden_layers']}L×{t['hidden_size']}, heads "
                       f"{t['num_attention_heads']}/{t['num_key_value_heads']}, vocab {t['vocab_size']}, "
                       f"{t['dtype']}, {t['parameters']:,} params"),
            ("drafter", dr["kind"] + (f" from {dr['source_layout']}" if "source_layout" in dr else ""))]
    from specpack.packager.card import arch_rows

    rows[2:2] = [(f"  {k}", v) for k, v in arch_rows(t.get("arch"), d.get("default_draft_len"))]
    if "remote_code" in t:
        rows.insert(2, ("  remote code", _remote_code_text(t["remote_code"])))
    if dr["kind"] == "eagle3":
        aux = dr["aux_hidden_states"]
        rows += [("  aux layers", f"{aux['layer_ids']} ({aux['convention']}; source "
                                  f"{aux.get('source_ids', 'defaults')} {aux['source_convention']})"),
                 ("  draft vocab", f"{dr['draft_vocab_size']} (map {dr['vocab_map']}, t2d {dr['t2d_source']})"),
                 ("  embedding/lm_head", f"{dr['embedding_source']} / {dr['lm_head_source']}"),
                 ("  params/dtype", f"{dr['parameters']:,} / {dr['dtype']}")]
    else:
        rows += _drafter_rows(dr)
    rows += _made_for_rows(dr)
    rows += _engine_rows(d.get("engines", {}))
    rows += [("memory", f"target {mem['target_weight_bytes'] / 2**20:,.1f} MiB + drafter "
                        f"{mem['drafter_weight_bytes'] / 2**20:,.1f} MiB; KV/token "
                        f"{mem['target_kv_bytes_per_token']:,} + {mem['drafter_kv_bytes_per_token']:,} B"),
             ("signature", "model.sig (OpenSSF model-signing)" if d["signed"] else "none (unsigned)"),
             ("files", f"{len(d['files'])} files, {d['total_bytes'] / 2**20:,.1f} MiB")]
    return table(rows)


@cli.command("import-gguf")
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="Directory to create.")
@click.option("--dtype", default="float32", show_default=True,
              type=click.Choice(["float32", "float16", "bfloat16"]), help="Dtype of the written weights.")
@click.option("--dequantize", is_flag=True,
              help="Write every tensor in --dtype (what transformers loads) instead of keeping quantized blocks.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@JSON
def import_gguf(gguf_file, out, dtype, dequantize, force, json_mode):
    """Convert a GGUF target (llama.cpp) into a Hugging Face model directory.

    Architectures: llama, and deepseek2 (DeepSeek-V3-shaped MLA + MoE), whose nextn blocks become the
    target's MTP layers (`model.layers.{L+k}.*`, num_nextn_predict_layers): `build --drafter mtp` binds them.
    A llama file's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K tensors are kept as llama.cpp's blocks, bit for bit
    (config.json states each one's type; `run` and `serve` compute with them as they are); float tensors are
    written in --dtype. With --dequantize every tensor is written in --dtype (F32/F16/BF16, Q4_0/Q4_1/Q5_0/
    Q5_1/Q8_0, K-quants and IQ4 read), for transformers and the engine exports. Writes config.json,
    safetensors, tokenizer files and chat template. The result is a target for `specpack build`.

    \b
    Examples:
      specpack import-gguf SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2-135m
      specpack build smollm2-135m --drafter ngram -o smollm2-ngram
      specpack import-gguf model.Q4_K_M.gguf -o m-f32 --dequantize
      specpack import-gguf deepseek-target-f32.gguf -o ds   # its nextn block kept
      specpack build ds --drafter mtp -o ds-mtp
    """
    from specpack.converters.gguf import import_gguf as do_import

    report = do_import(gguf_file, out, dtype=dtype, progress=progress_enabled(json_mode), force=force,
                       dequantize=dequantize)
    kept = ", ".join(f"{n} {t}" for t, n in report.kept.items())
    emit(report.to_dict(), json_mode,
         lambda d: f"imported {gguf_file} -> {out} ({report.architecture}, {report.n_tensors} tensors, "
                   f"{report.bytes_written / 2**20:,.1f} MiB "
                   + (f"with {kept} kept quantized, {report.bytes_written / report.gguf_bytes:.2f}x the GGUF; "
                      f"the rest {dtype})" if kept else f"{dtype})"))


def _block_rows(dr: dict) -> list[tuple[str, str]]:
    from specpack.packager.card import quantization_text

    f = dr["target_features"]
    heads = [f"markov rank {dr['markov']['rank']} ({dr['markov']['type']})"] if "markov" in dr else []
    heads += [f"confidence{' +markov' if dr['confidence']['with_markov'] else ''}"] if "confidence" in dr else []
    heads += [f"lilicorr top-{dr['lilicorr']['candidate_topk']}"] if "lilicorr" in dr else []
    causal = dr["layer_causal"]
    return [("  algorithm", f"{dr['algorithm']}, {dr['query_layout']} layout, block {dr['block_size']} → "
                            f"{dr['draft_slots']} draft slots"),
            ("  target layers", f"{f['layer_ids']} (input_of_layer; source {f['source_ids']} "
                                f"{f['source_convention']})"),
            ("  mask token", f"{dr['mask_token_id']}" + (" + own mask embedding" if dr["mask_embedding"] else "")),
            ("  embedding/lm_head", f"{dr['embedding_source']} / {dr['lm_head_source']}; vocab {dr['vocab_size']}, "
                                    f"draft {dr['draft_vocab_size']} ({dr['vocab_map']})"),
            ("  rope/attention", f"base {dr['rope_theta']:g} {dr['rope_style']}; "
                                 f"{'causal' if all(causal) else 'non-causal' if not any(causal) else causal}"
                                 f"{', windows ' + str(dr['sliding_window']) if any(dr['sliding_window']) else ''}"
                                 f"{', sinks' if dr['attention_sinks'] else ''}"),
            ("  heads", ", ".join(heads) or "none"),
            ("  params/dtype", f"{dr['parameters']:,} / {dr['dtype']}")] + \
        ([("  quantization", quantization_text(dr["quantization"]))] if "quantization" in dr else [])


def _made_for_rows(dr: dict) -> list[tuple[str, str]]:
    """What the drafter states about the target it was made for, and a mismatch the build allowed."""
    from specpack.packager.card import made_for_text

    if not dr.get("made_for"):
        return []
    return [("  made for", made_for_text(dr["made_for"], dr.get("target_mismatch_allowed", False)))]


def _remote_code_text(rc: dict) -> str:
    files = ", ".join(rc["files"]) or "no code files"
    return (f"{'allowed' if rc['allowed'] else 'refused'} at build ({files}; {len(rc['reasons'])} reasons); "
            "specpack never runs it")


def _drafter_rows(dr: dict) -> list[tuple[str, str]]:
    if dr["kind"] == "block":
        return _block_rows(dr)
    if dr["kind"] == "release_dspark":
        from specpack.packager.card import release_dspark_rows

        return [(f"  {k}", v) for k, v in release_dspark_rows(dr)]
    if dr["kind"] == "mtp":
        return [("  layers", f"{dr['num_layers']} (weights in {dr['location']}; layer reuse "
                             f"{'allowed' if dr['allow_layer_reuse'] else 'off'})"),
                ("  inputs", f"{dr['concat_order']}; target {dr['target_hidden_state']}, chain "
                             f"{dr['chain_hidden_state']}"),
                ("  params/dtype", f"{dr['parameters']:,} / {dr['dtype']}")]
    if dr["kind"] == "draft_model":
        tok = dr["tokenizer"]
        return [("  model", f"{dr['architecture']} {dr['num_layers']}L×{dr['hidden_size']}, "
                            f"{dr['parameters']:,} params, {dr['dtype']}"),
                ("  tokenizer", f"{tok['vocab_tokens']} tokens with the target's ids, files "
                                f"{'identical' if tok['files_identical'] else 'differ'}; vocab rows "
                                f"{tok['draft_vocab_size']} / {tok['target_vocab_size']}")]
    return [("  lookup", f"n {dr['min_n']}..{dr['max_n']}, draft length {dr['draft_len']}")]
