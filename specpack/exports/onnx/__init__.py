"""Export an artifact's target and drafter as the ONNX graphs the speculative loop runs.

    export_onnx(ART, key=...)  ->  ART/exports/onnx/{target.onnx, eagle3.onnx | draft_model.onnx |
                                       mtp.{k}.onnx... | block_context.onnx + block_step.onnx,
                                       weights.bin, index.json}

Graphs (fp32, opset 17, weights in one external data file shared by all graphs):

- `target_step`: the T new rows of B sequences (layers.Batch): a sequence verifying D drafts has
  D+1 rows, one being prefilled a chunk. Inputs `tokens [T]`, `positions [T]`, `logits_index [K]`
  (rows whose logits to compute), `seq_rows [B, Q]` (each sequence's rows, padded to Q),
  `row_place [T]` (where each row sits among the B*Q), `cache_rows [B, P]` (the cache buffer row of
  each sequence's cached positions, padded to P), `mask [B, Q, P+Q]` (bool, True = may attend: the
  cached keys, then the sequence's new rows), then the whole cache buffer of every sequence slot
  per layer i: `past_key.{i}`, `past_value.{i}` `[N, kv_heads, head_dim]` (Llama / Mistral / Qwen2 /
  Qwen3), or `past_latent.{i}` `[N, kv_lora_rank + rope_dim]` (DeepSeek-V3's MLA). Outputs
  `logits [K, V]`, `aux [T, n_aux*H]` (EAGLE-3 and block drafters: hidden states entering the aux
  layers), `hidden [T, H]` (MTP only: the state its first layer reads) and `new_key.{i}`,
  `new_value.{i}` or `new_latent.{i}` `[T, ...]`: only the T new slots, which the runtime writes into
  the buffer. Linear layers run once over all T rows; attention per sequence.
- `eagle3_step`: the head's fc + one layer + norm/lm_head, the target graph's many-sequence inputs
  over its own KV buffer.
  Inputs `feats [R, n_aux*Ht]` (target features; fc is applied to them) and `hidden [U, H]` (the
  head's own earlier outputs), whose rows are concatenated in that order, and `tokens [R+U]`;
  outputs `hidden_out [R+U, H]`, `logits [K, draft_vocab]` and the new KV.
- `draft_model_step`: a draft model's own `target_step` graph (no aux).
- `mtp_step`, one graph per MTP layer (`layer` in the index): input `hidden [T, H]`, then the step
  inputs and the layer's own cache (`past_key`/`past_value` or `past_latent`); outputs
  `hidden_out [T, H]`, `logits [K, V]` and the new slots (module `mtp`).

- `block_context` and `block_step`, a block drafter's (DFlash, DSpark, LiLiCorr): the per-layer
  context K/V of newly committed positions (written into the drafter's own cache as `new_*`), and
  one query block over that cache; the algorithms' heads run on the host (module `block`).

n-gram needs no drafter graph. One module per graph family: `target`, `eagle3`, `mtp`, `block` over
the layer families `dense` and `deepseek` (`layers` holds what they share), `pipeline` the export.

Why the cache is slot-major `[slots, ...]` per layer with only the new slots out: the runtime keeps
one preallocated buffer per layer. A drafter graph gets its sequence's first P slots as `past` (a
contiguous prefix: no copy) and has `new_*` bound to slots P..P+T of the same buffer, so it writes the
new keys and values in place. The target graph gets the buffer of every slot whole (no copy either)
and gathers each sequence's rows; its new rows come back in one [T, ...] output per entry, scattered
into the buffer in one indexed copy. Rolling back is lowering a length, as in the torch runtime. A
graph returning the whole updated cache would copy every cached slot on every step instead.
"""

from specpack.exports.onnx.layers import linear_params
from specpack.exports.onnx.pipeline import DATA_NAME, INDEX_NAME, ONNX_DIR, OPSET, export_onnx
from specpack.packager.artifact import read_onnx_index as read_index

__all__ = ["DATA_NAME", "INDEX_NAME", "ONNX_DIR", "OPSET", "export_onnx", "linear_params",
           "read_index"]
