"""Drafters trained in the test session, published in their trainers' layouts, and the acceptance
their independent reference forward reaches.

Each head learns the tiny target's own greedy continuations of text prompts (so `run` and `serve`,
which take text, see exactly the token ids it learned), through the reference forwards only
(eagle_fixtures.ref_layer, block_reference: plain ops, no cache, no specpack code), and is then
written in a published layout: EAGLE-3 as SGLang / SpecForge, the official release or ModelOpt
ship it; DFlash as z-lab's; DSpark as DeepSpec's; LiLiCorr as ModelOpt's `LiLiCorrDraftModel`. `reference_acceptance` runs the same reference
forward in a greedy speculative loop against the target's own output and counts acceptance as the
engine reports it: 1 + accepted / verifications that carried a draft.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

import block_layouts as bl
import block_reference as ref
import eagle_fixtures as ef
import eagle_layouts as el
import tiny

# Prompts `run` and `serve` get as text; training sequences start with exactly their token ids.
PROMPTS = ("def add(a, b):", "The quick brown fox", "for i in range(10):", "Speculative decoding drafts",
           "import torch", "Hello, how are you", "class Point:", "x = torch.zeros(3, 4)",
           "print(i * i)", "I am fine, thank you", "return a + b", "jumps over the lazy dog.")
NEW = 24  # tokens a guard generates per prompt
LENGTH = 64  # every training sequence: prompt + greedy continuation, this many tokens
BLOCK_IDS_OUT = (0, 2, 4)  # target layers (output of layer i, as z-lab and DeepSpec count) = input of 1, 3, 5
HEADS = {"dflash": ("zlab-dflash", bl.Head(block_size=5, ids_out=BLOCK_IDS_OUT)),
         "dspark": ("deepspec-dspark", bl.Head(block_size=5, ids_out=BLOCK_IDS_OUT, markov=(16, "vanilla"),
                                               confidence=True)),
         "lilicorr": ("lilicorr", bl.Head(block_size=5, ids_out=BLOCK_IDS_OUT,
                                          lilicorr=bl.LILICORR))}


@functools.cache
def corpus(family: str = "llama") -> tuple[tuple[int, ...], torch.Tensor]:
    """(each prompt's token count, the target's greedy sequences [B, LENGTH] that start with them)."""
    model = tiny.build_model(family)
    tok = _tokenizer(family)
    rows, lengths = [], []
    for text in PROMPTS:
        ids = torch.tensor([tok(text).input_ids])
        rows.append(ef.greedy_sequences(model, ids, LENGTH - ids.shape[1])[0])
        lengths.append(ids.shape[1])
    return tuple(lengths), torch.stack(rows)


@functools.cache
def _tokenizer(family: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ef.target_dir(family))


@functools.cache
def hidden_states(family: str = "llama") -> tuple[torch.Tensor, ...]:
    """The target's hidden states over every training sequence (hidden_states[i]: input of layer i)."""
    with torch.no_grad():
        return tiny.build_model(family)(corpus(family)[1], output_hidden_states=True).hidden_states


# ---- EAGLE-3 ----

@functools.cache
def eagle3_head(family: str = "llama") -> Path:
    """A canonical EAGLE-3 dir trained on the text corpus (aux ids: eagle_fixtures.AUX, input of layer)."""
    return ef.train_head(tiny.build_model(family), corpus(family)[1], steps=200)


def eagle3_layout(layout: str, out: Path, family: str = "llama") -> tuple[Path, list[str]]:
    """The trained head written as `layout` publishes it, and the `build` flags it needs (the
    official release states no aux ids)."""
    from safetensors.torch import load_file

    tensors, cfg = load_file(eagle3_head(family) / "model.safetensors"), tiny.tiny_config(family)
    ids_out = [i - 1 for i in ef.AUX]  # SpecForge and ModelOpt count the output of layer i
    if layout == "official":
        flags = ["--aux-layer-ids", ",".join(map(str, ef.AUX)), "--aux-convention", "input"]
        return el.write_official(out, tensors, cfg), flags
    if layout == "modelopt":
        return el.write_modelopt(out, tensors, cfg, aux_ids=ids_out), []
    return el.write_sglang(out, tensors, cfg, aux_ids=ids_out), []


def eagle3_drafts(family: str = "llama"):
    """draft(seq_index, context, k) -> the reference head's k greedy drafts after `context`."""
    w, cfg = ef.load_weights(eagle3_head(family))
    aux = torch.cat([hidden_states(family)[i] for i in ef.AUX], -1)
    embed = tiny.build_model(family).get_input_embeddings().weight.detach()

    def draft(b: int, context: list[int], k: int) -> list[int]:
        n = len(context)
        return ef.ref_draft(w, cfg, embed, aux[b, : n - 1], torch.tensor(context[1:]), k)

    return draft


# ---- block drafters ----

def block_reference_config(algorithm: str, family: str = "llama") -> dict:
    """The canonical meaning of HEADS[algorithm] (what the reference runs), from the published
    semantics of its layout: z-lab's DFlash and LiLiCorr's backbone fill in B - 1 masked slots,
    DeepSpec's DSpark drafts B slots anchor-first."""
    from block_fixtures import block_config

    _, head = HEADS[algorithm]
    target = tiny.read_json(ef.target_dir(family) / "config.json")
    layout = "anchor_first" if algorithm == "dspark" else "fill_in"
    over = {"markov": {"rank": head.markov[0], "type": head.markov[1]},
            "confidence": {"with_markov": True}} if head.markov else {}
    if head.lilicorr:
        over["lilicorr"] = dict(head.lilicorr)
    geometry = bl.target_geometry(ef.target_dir(family))  # the layouts' heads take the target's geometry
    over.update(hidden_size=geometry["hidden"], intermediate_size=geometry["inter"], num_attention_heads=geometry["heads"],
                num_key_value_heads=geometry["kv"], head_dim=geometry["head_dim"])
    return block_config(target, algorithm, layout, head.block_size, head.layers, tuple(i + 1 for i in head.ids_out),
                        mask_token_id=head.mask_token_id, rms_norm_eps=target["rms_norm_eps"], **over)


@functools.cache
def block_weights(algorithm: str, family: str = "llama", steps: int | None = None, seed: int = 0) -> dict:
    """Canonical tensors of HEADS[algorithm] trained on the corpus: every slot's cross-entropy to the
    target's token, the Markov head by teacher forcing, the confidence head to each slot's accuracy."""
    _, head = HEADS[algorithm]
    cfg = block_reference_config(algorithm, family)
    steps = steps or (700 if head.lilicorr else 400)  # the correlator learns from a few walks a step
    w = {k: v.clone().requires_grad_() for k, v in bl.canonical_tensors(replace(head, seed=seed),
                                                                        ef.target_dir(family)).items()}
    embed, lm_head = _target_tables(family)
    feats = torch.cat([hidden_states(family)[i] for i in cfg["target_layer_ids"]], -1)
    seqs, slots = corpus(family)[1], cfg["draft_slots"]
    opt = torch.optim.Adam(list(w.values()), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        a = int(torch.randint(2, LENGTH - slots - 1, (), generator=g))  # every sequence's anchor position
        hidden, ctx = ref.backbone(w, cfg, embed, feats[:, :a], seqs[:, a])  # [B, slots, H], [B, a, H]
        labels, prev = seqs[:, a + 1: a + 1 + slots], seqs[:, a: a + slots]
        logits = hidden @ lm_head.T
        if cfg["markov"]:
            e = w["markov_head.markov_w1.weight"][prev]  # teacher forcing: the true previous token
            logits = logits + e @ w["markov_head.markov_w2.weight"].T
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if cfg["confidence"]:
            right = (logits.argmax(-1) == labels).float()
            conf = ref.lin(torch.cat([hidden, e], -1).detach(), w, "confidence_head.proj")[..., 0]
            loss = loss + F.binary_cross_entropy_with_logits(conf, right)
        if cfg["lilicorr"]:
            walks = torch.randperm(len(labels), generator=g)[:4].tolist()  # a few a step: the walk runs one at a time
            loss = loss + sum(_walk_loss(w, cfg, embed, lm_head, hidden[b], ctx[b, -1], labels[b]) for b in walks) / 4
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in w.items()}


def _walk_loss(w, cfg, embed, lm_head, hidden, anchor_hidden, labels):
    """LiLiCorr's lattice walk taught by teacher forcing: at each slot whose true token is among
    its candidates, cross-entropy of the walk's transition scores (from the true previous token's
    candidate) toward it."""
    cand, into, out, a_out = ref.lilicorr_factors(w, cfg, embed, lm_head, hidden, anchor_hidden)
    scale, loss, prev = cfg["lilicorr"]["logit_scale"], 0.0, None
    for s in range(len(cand)):
        hit = (cand[s] == labels[s]).nonzero()
        if len(hit) and (s == 0 or prev is not None):
            row = (into[0] @ a_out if s == 0 else into[s] @ out[s - 1, prev]) * scale
            loss = loss + F.cross_entropy(row[None], hit[0])
        prev = int(hit[0]) if len(hit) else None
    return loss


def block_layout(algorithm: str, out: Path, family: str = "llama") -> Path:
    """The trained block drafter written in its trainer's layout (z-lab DFlash, DeepSpec DSpark,
    ModelOpt's LiLiCorrDraftModel)."""
    layout, head = HEADS[algorithm]
    writer, _ = bl.WRITERS[layout]
    return writer(Path(out), head, block_weights(algorithm, family), ef.target_dir(family))


def block_drafts(algorithm: str, family: str = "llama"):
    """draft(seq_index, context, k) -> the reference drafter's k greedy drafts after `context`."""
    cfg, w = block_reference_config(algorithm, family), block_weights(algorithm, family)
    feats = torch.cat([hidden_states(family)[i] for i in cfg["target_layer_ids"]], -1)
    embed, lm_head = _target_tables(family)

    def draft(b: int, context: list[int], k: int) -> list[int]:
        with torch.no_grad():
            return ref.ref_draft(w, cfg, embed, lm_head, feats[b, : len(context) - 1], context, k)[0]

    return draft


def _target_tables(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    model = tiny.build_model(family)
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()


# ---- acceptance ----

def reference_acceptance(draft, draft_len: int, prompts=range(len(PROMPTS)), new: int = NEW,
                         family: str = "llama") -> float:
    """Acceptance length of `draft` (seq_index, context, k -> tokens) in a greedy speculative loop over
    the first `new` tokens after each prompt, drafting min(draft_len, tokens left - 1) a step as the
    engine does: 1 + accepted / verifications that carried a draft."""
    lengths, seqs = corpus(family)
    accepted = steps = 0
    for b in prompts:
        seq, n = seqs[b].tolist(), lengths[b] + 1  # the prefill's forward gives the first token
        while n < lengths[b] + new:
            k = min(draft_len, lengths[b] + new - n - 1)
            if k == 0:  # the last token: nothing left to draft for
                break
            tokens, kept = draft(b, seq[:n], k), 0
            while kept < k and tokens[kept] == seq[n + kept]:
                kept += 1
            accepted, steps, n = accepted + kept, steps + 1, n + kept + 1
    return 1 + accepted / max(steps, 1)


def prompt_ids(family: str = "llama") -> list[list[int]]:
    lengths, seqs = corpus(family)
    return [seqs[b, :n].tolist() for b, n in enumerate(lengths)]


def greedy(b: int, new: int = NEW, family: str = "llama") -> list[int]:
    """The target's own first `new` tokens after prompt b."""
    lengths, seqs = corpus(family)
    return seqs[b, lengths[b]: lengths[b] + new].tolist()


def config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
