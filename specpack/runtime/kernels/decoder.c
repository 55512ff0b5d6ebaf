/* A run of dense decoder layers (Llama / Mistral / Qwen2 / Qwen3) in one call: per layer the same
 * kernel calls, in the same order, as kernels/layers.py would make one by one from Python, so the
 * bits are the same; what goes is the Python between them (~40 us a layer: argument checks,
 * allocations, ctypes conversions), which at one row and 16-bit or int8 weights is a tenth of a
 * decode step.
 *
 *   x ─ RMSNorm ─ q/k/v ─ RoPE + KV-cache write ─ attention ─ o_proj (+ x) ─ x2
 *   x2 ─ RMSNorm ─ gate/up ─ SiLU·up ─ down (+ x2) ─ x
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "kernels.h"

typedef struct { /* one packed linear layer (linear.c's format and speed settings) */
    const void *w;
    const float *bias; /* or NULL */
    int64_t n, k;
    int32_t fmt, threads, group, prefetch, isa;
} sp_lin_t;

typedef struct { /* one layer's weights */
    const float *in_norm, *post_norm, *q_norm, *k_norm; /* q/k norms: NULL unless Qwen3 */
    sp_lin_t qkv, o, gate_up, down;
} sp_layer_t;

typedef struct { /* what every layer of a forward shares */
    int64_t hidden, heads, kv_heads, hd, inter;
    float eps, scale;
    int32_t threads; /* attention */
    void *k, *v; /* the caches of layer 0; layer i at + i * layer_stride elements */
    int64_t layer_stride, slot_stride, head_stride, ld;
    int64_t rows;
    const float *cos, *sin; /* [rows, hd] */
    const int64_t *slot, *write, *ctx, *end;
    const uint8_t *mask; /* [rows, ldm] or NULL */
    int64_t ldm;
    int64_t kv16; /* cache elements: fp32 (0) or fp16 (1) */
} sp_forward_t;

/* y [R, l->n] = x [R, l->k] (row stride ldx) @ W^T (+ bias) (+ res, row stride ldr; NULL: none). */
static void linear_ld(const sp_lin_t *l, const float *x, int64_t ldx, int64_t R, const float *res, int64_t ldr,
                      float *y)
{
    sp_linear(x, R, l->k, ldx, l->w, l->fmt, l->n, l->bias, res, res ? ldr : 0, y, l->n, l->threads, l->group,
              l->prefetch, l->isa);
}

static void linear(const sp_lin_t *l, const float *x, int64_t R, const float *res, float *y)
{
    linear_ld(l, x, l->k, R, res, l->n, y);
}

/* The rows of x [R, H] into column block c of aux (row stride ldaux) for every c with capture[c] == at. */
static void capture_rows(const float *x, int64_t R, int64_t H, int64_t at, const int64_t *capture, int64_t ncap,
                         float *aux, int64_t ldaux)
{
    for (int64_t c = 0; c < ncap; c++)
        if (capture[c] == at)
            for (int64_t r = 0; r < R; r++) memcpy(aux + r * ldaux + c * H, x + r * H, H * sizeof(float));
}

/* Layers first..first+n-1 of `layers` over x [rows, hidden], in place. scratch: rows x
 * (2 hidden + (heads + 2 kv_heads) hd + heads hd + 3 inter) floats. capture: ncap layer ids whose
 * input (id first + n: the last layer's output) is copied, as the layers reach it, into column block
 * c of aux [rows, ncap * hidden] (ncap 0: aux unused), so a forward that feeds a drafter stays one
 * call. */
void sp_decoder_layers(const sp_layer_t *layers, int64_t first, int64_t n, const sp_forward_t *f, float *x,
                       float *scratch, const int64_t *capture, int64_t ncap, float *aux)
{
    const int64_t R = f->rows, H = f->hidden, hd = f->hd, ldq = (f->heads + 2 * f->kv_heads) * hd;
    const int64_t ldo = f->heads * hd;
    float *h = scratch, *x2 = h + R * H, *qkv = x2 + R * H, *a = qkv + R * ldq, *gu = a + R * ldo;
    float *m = gu + R * 2 * f->inter;
    for (int64_t i = first; i < first + n; i++) {
        const sp_layer_t *L = layers + i;
        capture_rows(x, R, H, i, capture, ncap, aux, ncap * H);
        const int64_t at = i * f->layer_stride * (f->kv16 ? 2 : 4); /* bytes */
        void *kc = (char *)f->k + at, *vc = (char *)f->v + at;
        sp_rmsnorm(x, R, H, H, L->in_norm, f->eps, h, H);
        linear(&L->qkv, h, R, NULL, qkv);
        sp_rope_cache(qkv, R, ldq, f->heads, f->kv_heads, hd, f->cos, f->sin, hd, L->q_norm, L->k_norm, f->eps,
                      kc, vc, (int)f->kv16, f->slot_stride, f->head_stride, f->ld, f->slot, f->write);
        sp_attention(qkv, R, f->heads, ldq, kc, vc, (int)f->kv16, f->kv_heads, f->slot_stride, f->head_stride, f->ld, hd, hd,
                     f->slot, f->ctx, f->end, f->mask, f->ldm, f->scale, a, ldo, f->threads);
        linear(&L->o, a, R, x, x2);
        sp_rmsnorm(x2, R, H, H, L->post_norm, f->eps, h, H);
        linear(&L->gate_up, h, R, NULL, gu);
        sp_silu_mul(gu, R, f->inter, 2 * f->inter, m, f->inter);
        linear(&L->down, m, R, x2, x);
    }
    capture_rows(x, R, H, first + n, capture, ncap, aux, ncap * H);
}

/* A block drafter's context (drafters/block.py): the rows ctx [rows, hidden] (the target's features,
 * fc and hidden_norm applied) are the keys and values every layer first..first+n-1 attends, each
 * layer's own k/v projection of the same rows (no norm before it), k_norm, RoPE and the cache write
 * as a forward's. q comes out of the fused q/k/v product with them and is dropped.
 * scratch: rows (heads + 2 kv_heads) hd floats. */
void sp_context_kv(const sp_layer_t *layers, int64_t first, int64_t n, const sp_forward_t *f, const float *ctx,
                   float *scratch)
{
    const int64_t R = f->rows, ldq = (f->heads + 2 * f->kv_heads) * f->hd;
    for (int64_t i = first; i < first + n; i++) {
        const sp_layer_t *L = layers + i;
        const int64_t at = i * f->layer_stride * (f->kv16 ? 2 : 4); /* bytes */
        linear(&L->qkv, ctx, R, NULL, scratch);
        sp_rope_cache(scratch, R, ldq, f->heads, f->kv_heads, f->hd, f->cos, f->sin, f->hd, L->q_norm, L->k_norm,
                      f->eps, (char *)f->k + at, (char *)f->v + at, (int)f->kv16, f->slot_stride, f->head_stride,
                      f->ld, f->slot, f->write);
    }
}

typedef struct { /* an EAGLE-3 head (drafters/eagle3.py): its one layer, its norms, its draft-vocab head */
    sp_layer_t layer;      /* in_norm normalises the token embeddings; no q/k norms */
    const float *hidden_norm; /* normalises the incoming hidden states */
    const float *final_norm;  /* before `head` */
    sp_lin_t head;            /* lm_head over the draft vocabulary */
    int64_t norm_before_residual; /* the attention's residual: normed h (1) or h (0) */
} sp_eagle3_t;

/* One draft step of an EAGLE-3 head over the rows of f (f->k, f->v: the head's one-layer cache):
 * emb [R, H] the next tokens' embeddings and h [R, H] the hidden states they follow -> out [R, H]
 * (the layer's output, before the final norm) and, for the nlogits rows logit_rows, logits
 * [nlogits, head.n] = head(final_norm(out[row])). The kernels kernels/layers.py's
 * FusedEagle3Layer called one by one, in the same order, so the same bits, in one call from Python:
 *
 *     cat(RMSNorm(emb), RMSNorm(h)) ─ q/k/v ─ RoPE + KV-cache write ─ attention ─ o_proj (+ h)
 *     ─ RMSNorm ─ gate/up ─ SiLU·up ─ down (+ residual) ─ out ─ RMSNorm ─ lm_head ─ logits
 *
 * scratch: R (4 H + (heads + 2 kv_heads) hd + heads hd + 3 inter) + nlogits H floats. */
void sp_eagle3_step(const sp_eagle3_t *e, const sp_forward_t *f, const float *emb, const float *h, float *out,
                    const int64_t *logit_rows, int64_t nlogits, float *logits, float *scratch)
{
    const sp_layer_t *L = &e->layer;
    const int64_t R = f->rows, H = f->hidden, hd = f->hd, ldq = (f->heads + 2 * f->kv_heads) * hd;
    const int64_t ldo = f->heads * hd;
    float *x = scratch, *qkv = x + R * 2 * H, *a = qkv + R * ldq, *h2 = a + R * ldo, *y = h2 + R * H;
    float *gu = y + R * H, *m = gu + R * 2 * f->inter, *normed = m + R * f->inter;
    sp_rmsnorm(emb, R, H, H, L->in_norm, f->eps, x, 2 * H);
    sp_rmsnorm(h, R, H, H, e->hidden_norm, f->eps, x + H, 2 * H);
    linear(&L->qkv, x, R, NULL, qkv);
    sp_rope_cache(qkv, R, ldq, f->heads, f->kv_heads, hd, f->cos, f->sin, hd, NULL, NULL, f->eps, f->k, f->v,
                  (int)f->kv16, f->slot_stride, f->head_stride, f->ld, f->slot, f->write);
    sp_attention(qkv, R, f->heads, ldq, f->k, f->v, (int)f->kv16, f->kv_heads, f->slot_stride, f->head_stride,
                 f->ld, hd, hd, f->slot, f->ctx, f->end, f->mask, f->ldm, f->scale, a, ldo, f->threads);
    if (e->norm_before_residual)
        linear_ld(&L->o, a, ldo, R, x + H, 2 * H, h2);
    else
        linear_ld(&L->o, a, ldo, R, h, H, h2);
    sp_rmsnorm(h2, R, H, H, L->post_norm, f->eps, y, H);
    linear(&L->gate_up, y, R, NULL, gu);
    sp_silu_mul(gu, R, f->inter, 2 * f->inter, m, f->inter);
    linear(&L->down, m, R, h2, out);
    for (int64_t i = 0; i < nlogits; i++)
        sp_rmsnorm(out + logit_rows[i] * H, 1, H, H, e->final_norm, f->eps, normed + i * H, H);
    if (nlogits > 0) linear(&e->head, normed, nlogits, NULL, logits);
}

typedef struct { /* where token embeddings come from: an fp32 table, GGUF blocks, or an fp32 table in a file */
    const float *table;    /* [rows, hidden], or NULL: */
    const uint8_t *blocks; /* GGUF blocks (gguf_rows.c: kind, row_bytes), or NULL: */
    int64_t kind, row_bytes;
    int64_t fd, offset;    /* rows read with pread at offset + id * hidden * 4 (models.weights.FileEmbedding) */
    int64_t rows;
} sp_embed_t;

/* Row `id` of the embedding into out [H]: 0, or -1 (an id outside the table, or a short read). */
static int embed_row(const sp_embed_t *t, int64_t id, int64_t H, float *out)
{
    if (id < 0 || id >= t->rows)
        return -1;
    if (t->table) {
        memcpy(out, t->table + id * H, (size_t)H * sizeof(float));
        return 0;
    }
    if (t->blocks)
        return sp_gguf_rows((int)t->kind, t->blocks, t->rows, t->row_bytes, &id, 1, H, out) ? -1 : 0;
    const ssize_t want = (ssize_t)(H * (int64_t)sizeof(float));
    return pread((int)t->fd, out, (size_t)want, (off_t)(t->offset + id * want)) == want ? 0 : -1;
}

/* The greedy chain an EAGLE-3 head drafts after its first step (drafters/eagle3.py's draft loop, one C call):
 * J sequences in cache slots slot[j], the head's cache holding start[j] positions of each; h [J, H] each one's
 * state after the first step (updated in place), drafts [J, kmax] with drafts[j][0] given (target ids); each
 * sequence drafts up to k[j] tokens. Step s feeds the tokens of step s - 1 at position start + s - 1 (RoPE from
 * the tables cos / sin [positions, hd]), takes each row's argmax over the draft vocabulary and maps it through
 * d2t [vd] to a target id. f: the head's forward (threads, caches, strides; rows and row arrays are set here).
 * The same kernels as sp_eagle3_step from Python, in the same order: the same drafts. Returns 0, or -1 when
 * an embedding row could not be read (an id outside the table, a file that shrank). scratch: 7 J int64, then
 * J (2 hd + 3 H + vd) floats and sp_eagle3_step's for J rows and J logits. */
int64_t sp_eagle3_chain(const sp_eagle3_t *e, const sp_forward_t *f, const float *cos, const float *sin,
                        const sp_embed_t *embed, const int64_t *d2t, int64_t vd, int64_t J, const int64_t *slot,
                        const int64_t *start, const int64_t *k, int64_t kmax, float *h, int64_t *drafts,
                        float *scratch)
{
    const int64_t H = f->hidden, hd = f->hd;
    int64_t *iv = (int64_t *)scratch, *live = iv, *rs = iv + J, *rw = iv + 2 * J, *re = iv + 3 * J;
    int64_t *picked = iv + 4 * J, *best = iv + 5 * J;
    float *cs = (float *)(iv + 7 * J), *emb = cs + 2 * J * hd, *hs = emb + J * H, *out = hs + J * H;
    float *logits = out + J * H, *step = logits + J * vd;
    for (int64_t s = 1; s < kmax; s++) {
        int64_t R = 0;
        for (int64_t j = 0; j < J; j++)
            if (k[j] > s) live[R++] = j;
        for (int64_t r = 0; r < R; r++) {
            const int64_t j = live[r], w = start[j] + s - 1;
            rs[r] = slot[j], rw[r] = w, re[r] = w + 1, picked[r] = r;
            memcpy(cs + r * hd, cos + w * hd, (size_t)hd * sizeof(float));
            memcpy(cs + (R + r) * hd, sin + w * hd, (size_t)hd * sizeof(float));
            memcpy(hs + r * H, h + j * H, (size_t)H * sizeof(float));
            if (embed_row(embed, drafts[j * kmax + s - 1], H, emb + r * H))
                return -1;
        }
        sp_forward_t g = *f;
        g.rows = R, g.cos = cs, g.sin = cs + R * hd, g.slot = rs, g.write = rw, g.ctx = rw, g.end = re;
        g.mask = NULL, g.ldm = 0;
        sp_eagle3_step(e, &g, emb, hs, out, picked, R, logits, step);
        sp_argmax(logits, R, vd, vd, best);
        for (int64_t r = 0; r < R; r++) {
            const int64_t j = live[r];
            drafts[j * kmax + s] = d2t[best[r]];
            memcpy(h + j * H, out + r * H, (size_t)H * sizeof(float));
        }
    }
    return 0;
}

typedef struct { /* a block drafter (drafters/block.py) around its layers */
    sp_lin_t fc;              /* the target's features -> hidden */
    const float *hidden_norm; /* after fc: the context rows */
    const float *final_norm;  /* before `head` */
    sp_lin_t head;            /* lm_head over the draft vocabulary */
    sp_embed_t embed;         /* the token embeddings */
    const float *mask_embed;  /* the mask token's own embedding, or NULL (the table's row) */
    int64_t mask_token;
    const uint8_t *causal;    /* per layer: 1 when the block's rows see each other causally */
    const float *cos, *sin;   /* RoPE tables [positions, hd] */
} sp_block_t;

/* f with its cos/sin rows taken from the tables at pos[r], into cs (2 rows hd floats). */
static sp_forward_t at_positions(const sp_block_t *b, const sp_forward_t *f, const int64_t *pos, float *cs)
{
    sp_forward_t g = *f;
    const int64_t R = f->rows, hd = f->hd;
    for (int64_t r = 0; r < R; r++) {
        memcpy(cs + r * hd, b->cos + pos[r] * hd, (size_t)hd * sizeof(float));
        memcpy(cs + (R + r) * hd, b->sin + pos[r] * hd, (size_t)hd * sizeof(float));
    }
    g.cos = cs;
    g.sin = cs + R * hd;
    return g;
}

/* A block drafter's new context rows: ctx [rows, hidden] = hidden_norm(fc(feats [rows, fc.k])), then
 * every layer's keys and values of them into the cache at f's rows (sp_context_kv), RoPE at pos[r].
 * The operations drafters/block.py runs one by one, in one call. scratch: rows (2 hd + hidden +
 * (heads + 2 kv_heads) hd) floats. */
void sp_block_context(const sp_layer_t *layers, int64_t n, const sp_block_t *b, const sp_forward_t *f,
                      const int64_t *pos, const float *feats, float *ctx, float *scratch)
{
    const int64_t R = f->rows, H = f->hidden;
    float *cs = scratch, *y = cs + 2 * R * f->hd, *kv = y + R * H;
    const sp_forward_t g = at_positions(b, f, pos, cs);
    linear(&b->fc, feats, R, NULL, y);
    sp_rmsnorm(y, R, H, H, b->hidden_norm, f->eps, ctx, H);
    sp_context_kv(layers, 0, n, &g, ctx, kv);
}

/* A block drafter's query blocks: rows of tokens[r] embedded (the mask token as mask_embed when
 * given; GGUF-block rows dequantized, a file's rows read, as needed), at positions pos[r], through the n
 * layers (a causal layer's rows see up to causal_end[r], a non-causal one's up to f->end[r]: the whole
 * block), then hidden [nh, hidden] = final_norm(x[hidden_rows]) and logits [nl, head.n] =
 * head(hidden[logit_rows]). x [rows, hidden]
 * is the layers' output. scratch: rows (2 hd + the layers' width) + nl hidden floats. Returns 0, or -1 when an
 * embedding row could not be read (a table file that shrank after loading: nothing else is computed). */
int64_t sp_block_draft(const sp_layer_t *layers, int64_t n, const sp_block_t *b, const sp_forward_t *f,
                    const int64_t *causal_end, const int64_t *pos, const int64_t *tokens, float *x,
                    const int64_t *hidden_rows, int64_t nh, float *hidden, const int64_t *logit_rows, int64_t nl,
                    float *logits, float *scratch)
{
    const int64_t R = f->rows, H = f->hidden;
    float *cs = scratch, *picked = cs + 2 * R * f->hd, *work = picked + nl * H;
    const sp_forward_t full = at_positions(b, f, pos, cs);
    sp_forward_t causal = full;
    causal.end = causal_end;
    for (int64_t r = 0; r < R; r++) {
        if (b->mask_embed && tokens[r] == b->mask_token)
            memcpy(x + r * H, b->mask_embed, (size_t)H * sizeof(float));
        else if (embed_row(&b->embed, tokens[r], H, x + r * H)) /* the caller checked the ids */
            return -1;
    }
    for (int64_t i = 0; i < n; i++)
        sp_decoder_layers(layers, i, 1, b->causal[i] ? &causal : &full, x, work, NULL, 0, NULL);
    for (int64_t i = 0; i < nh; i++)
        sp_rmsnorm(x + hidden_rows[i] * H, 1, H, H, b->final_norm, f->eps, hidden + i * H, H);
    for (int64_t i = 0; i < nl; i++) memcpy(picked + i * H, hidden + logit_rows[i] * H, (size_t)H * sizeof(float));
    if (nl > 0) linear(&b->head, picked, nl, NULL, logits);
    return 0;
}
