/* Rows of a GGUF block table as fp32 (kernels/gguf.py's BlockEmbedding: a lookup of a few token ids): the values
 * families/gguf_blocks.py's `dequantize` gives, bit for bit, in one call instead of ten torch ops (each of which
 * costs 50-100 us right after a weight stream: a decode step's lookup took ~80 us, four a speculative step).
 *
 * The arithmetic is gguf_blocks.Affine.dense's (llama.cpp's dequantize_row_*): per group a scale and an optional
 * offset, value = (float)q * scale, then + offset, one rounding each (no fused multiply-add):
 *   Q8_0 d * q;  Q4_0 d * q + (-8 d);  Q4_1 d * q + m;  Q5_0 d * (q - 16);  Q5_1 d * q + m  (per 32 values)
 *   Q4_K, Q5_K (d * sc_j) * q + -(dmin * m_j) per 32;  Q6_K (d * sc_j) * (q - 32) per 16  (per 256: the K-quants)
 * Layouts: gguf_blocks.py's table (ggml-quants.c). */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

enum { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K }; /* gguf_blocks.TYPES' order */

static float f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* A 32-value block: q[i] (0..31 or signed) times `scale` plus `offset` (has_offset) into out[0..31]. */
static void affine32(const int32_t *q, float scale, float offset, int has_offset, float *out)
{
    for (int i = 0; i < 32; i++) {
        const float v = (float)q[i] * scale;
        out[i] = has_offset ? v + offset : v;
    }
}

/* Q4_0 .. Q5_1: values i < 16 from the low nibbles of qs[i], i >= 16 from the high nibbles of qs[i - 16];
 * the 5-bit types add bit i of the 32-bit qh as bit 4. */
static void small_block(int kind, const uint8_t *b, float *out)
{
    const int wide = kind == Q4_1 || kind == Q5_1, fifth = kind == Q5_0 || kind == Q5_1;
    const float d = f16(b), m = wide ? f16(b + 2) : 0.0f;
    uint32_t qh = 0;
    if (fifth)
        memcpy(&qh, b + (wide ? 4 : 2), 4);
    const uint8_t *qs = b + 2 + (wide ? 2 : 0) + (fifth ? 4 : 0);
    int32_t q[32];
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 0x0F;
        q[i + 16] = qs[i] >> 4;
    }
    if (fifth)
        for (int i = 0; i < 32; i++) q[i] |= (int32_t)((qh >> i) & 1) << 4;
    if (kind == Q5_0)
        for (int i = 0; i < 32; i++) q[i] -= 16;
    if (kind == Q4_0)
        affine32(q, d, -8 * d, 1, out);
    else
        affine32(q, d, m, wide, out);
}

/* Q4_K / Q5_K: eight sub-blocks of 32, 6-bit scales and mins (get_scale_min_k4); values of sub-block 2c and
 * 2c + 1 from the low and high nibbles of qs[32c .. 32c + 31]; Q5_K's bit 4 of value l in sub-block s is bit
 * s of qh[l]. */
static void k_block(int kind, const uint8_t *b, float *out)
{
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *s = b + 4, *qh = b + 16, *qs = b + (kind == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        int32_t q[32];
        for (int l = 0; l < 32; l++) {
            const uint8_t byte = qs[32 * (j / 2) + l];
            q[l] = j % 2 ? byte >> 4 : byte & 0x0F;
            if (kind == Q5_K)
                q[l] |= ((qh[l] >> j) & 1) << 4;
        }
        affine32(q, d * (float)sc, -(dmin * (float)mn), 1, out + 32 * j);
    }
}

/* Q6_K: two halves of 128 values; in half h, run r (0..3) of 32: the low 4 bits from ql[64h + 32 (r % 2) + l]
 * (low nibble for r < 2, high for r >= 2), the high 2 bits from qh[32h + l] >> 2r; a scale per 16 values. */
static void q6_block(const uint8_t *b, float *out)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < 32; l++) {
                const uint8_t low = ql[64 * h + 32 * (r % 2) + l];
                const int q = ((r < 2 ? low & 0x0F : low >> 4) | (((qh[32 * h + l] >> (2 * r)) & 3) << 4)) - 32;
                const int i = 128 * h + 32 * r + l;
                out[i] = (float)q * (d * (float)sc[i / 16]);
            }
}

/* out [n, cols] = the rows ids[0..n) of `raw` (`rows` rows of row_bytes bytes of `kind` blocks, cols values
 * each). Returns 0, or 1 + the index of the first id outside 0..rows-1 (nothing written then). */
int64_t sp_gguf_rows(int kind, const uint8_t *raw, int64_t rows, int64_t row_bytes, const int64_t *ids, int64_t n,
                     int64_t cols, float *out)
{
    const int qk = kind >= Q4_K ? 256 : 32;
    const int64_t size = row_bytes / (cols / qk);
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows)
            return r + 1;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = raw + ids[r] * row_bytes;
        float *y = out + r * cols;
        for (int64_t g = 0; g < cols / qk; g++) {
            const uint8_t *b = row + g * size;
            if (kind == Q8_0) {
                int32_t q[32];
                for (int i = 0; i < 32; i++) q[i] = ((const int8_t *)b)[2 + i];
                affine32(q, f16(b), 0.0f, 0, y + 32 * g);
            } else if (kind <= Q5_1)
                small_block(kind, b, y + 32 * g);
            else if (kind == Q6_K)
                q6_block(b, y + 256 * g);
            else
                k_block(kind, b, y + 256 * g);
        }
    }
    return 0;
}
