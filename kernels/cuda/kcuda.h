/*
 * kcuda.h - the CUDA kernels of kvd, callable from C.
 *
 * Every kernel here has a C reference twin, named with each function (in
 * kernels/, or engine/sampler.c for the token choice), and a test in
 * tests/gpu that holds it against the twin; the fused and multi-matrix
 * launches are held against the separate kernels they replace, bit for bit. Callers
 * never see CUDA headers: streams are opaque, memory comes from the small
 * allocation API below, and results are the KVD_E* codes of err.h.
 *
 * Device pointers: every `const T *` or `T *` argument of a kernel launch is
 * device memory unless its comment says host. Launch functions check their
 * arguments, enqueue the kernel on `stream` (NULL: the default stream) and
 * return at once; errors of the launch itself are returned, errors of the
 * kernel's execution surface at the next kcuda_sync().
 *
 * The KV cache on the device has exactly the layout of the host cache
 * (engine/kvcache.h, shm/pool.h): block b of layer l holds
 *     [K heads][V heads], each head [token in block][row]
 * where a row is head_dim values of that half's type (F16, or Q8_0 / Q4_0
 * blocks of 32 values with their scales), at
 *     base + b * block_stride + l * n_head_kv * (k_head_stride + v_head_stride),
 * so a block written by either backend means the same to the other.
 *
 * Numerics: fp32 accumulation everywhere. Each output depends only on its own
 * inputs, never on the batch it ran in (per-token reduction orders are fixed
 * by the shapes alone). Attention is computed in splits of a fixed number of
 * positions whose partial results merge in split order; decode and prefill
 * attention give each (token, head) the same bits, so a prefix computed in a
 * prefill chunk and one decoded token by token agree exactly.
 */
#ifndef KVD_KCUDA_H
#define KVD_KCUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *kcuda_stream_t;  /* a CUDA stream; NULL is the default stream */

/* ---- devices and memory ------------------------------------------------------ */

struct kcuda_info {
    char name[96];          /* "NVIDIA H200" */
    int major, minor;       /* compute capability */
    int sm_count;           /* multiprocessors */
    uint64_t mem_bytes;     /* global memory */
    double mem_clock_khz;   /* memory clock (0 when the runtime does not say) */
    int bus_bits;           /* memory bus width (0 when the runtime does not say) */
};

/* Number of usable CUDA devices; 0 when there is no driver, no device, or the
 * driver is too old for this build's runtime, with the reason in why (which
 * may be NULL). Never fails otherwise. */
int kcuda_device_count(char *why, size_t whylen);

/* Makes dev the calling thread's device and fills *info (may be NULL).
 * 0, KVD_EUNAVAILABLE (no such device) or KVD_EINTERNAL. */
int kcuda_device_open(int dev, struct kcuda_info *info);

/* The message of the last CUDA failure seen by this thread ("" if none). */
const char *kcuda_last_error(void);

/* Device memory, 256-byte aligned; NULL when out of memory. kcuda_free accepts NULL. */
void *kcuda_malloc(size_t bytes);
void kcuda_free(void *p);

/* Synchronous copies between host and device, and device-to-device on a stream.
 * 0 or KVD_EINTERNAL. */
int kcuda_upload(void *dst_dev, const void *src_host, size_t bytes);
int kcuda_download(void *dst_host, const void *src_dev, size_t bytes);
int kcuda_copy(void *dst_dev, const void *src_dev, size_t bytes, kcuda_stream_t stream);
int kcuda_memset(void *dst_dev, int byte, size_t bytes, kcuda_stream_t stream);

/* Waits for all work on the device; 0, or KVD_EINTERNAL when a kernel failed. */
int kcuda_sync(void);

/* Elapsed-time measurement on a stream (CUDA events). */
typedef struct kcuda_timer kcuda_timer_t;
kcuda_timer_t *kcuda_timer_new(void);
void kcuda_timer_destroy(kcuda_timer_t **t);
void kcuda_timer_start(kcuda_timer_t *t, kcuda_stream_t stream);
/* Records the end, waits for it, returns milliseconds since the start (negative on error). */
double kcuda_timer_stop(kcuda_timer_t *t, kcuda_stream_t stream);

/* ---- the KV cache and attention -------------------------------------------- */

#define KCUDA_ATTN_SPLIT 256    /* default positions per attention split */
#define KCUDA_MAX_GROUP 8       /* most query heads per KV head */

/* Rotation flags of a cache, the values of kvcache.h's KV_ROT_K / KV_ROT_V. */
#define KCUDA_ROT_K 1u
#define KCUDA_ROT_V 2u

/* One layer of the paged cache, as kern_attn_args describes it. */
struct kcuda_kv {
    uint8_t *k;             /* K of this layer in block 0 (kv_block_ptr(kv, 0, layer, 0)) */
    uint8_t *v;             /* V of this layer in block 0 */
    uint64_t block_stride;  /* bytes between blocks (kvcache.block_bytes) */
    uint64_t k_head_stride; /* bytes between K heads of a block (kvcache.k_head_bytes) */
    uint64_t v_head_stride; /* bytes between V heads of a block (kvcache.v_head_bytes) */
    uint32_t k_type;        /* KERN_F16, KERN_Q8_0 or KERN_Q4_0 (set it: KERN_F16 is not 0) */
    uint32_t v_type;        /* the same choices, for V */
    uint32_t rotate;        /* KCUDA_ROT_K | KCUDA_ROT_V: halves stored Hadamard-rotated;
                             * read by kcuda_rope_kv only (the queries meet K rotated, and
                             * the caller rotates outputs back with kcuda_hadamard) */
    int block_tokens;       /* positions per block */
    int head_dim;           /* 64, 128 or 256 */
    int n_head;             /* query heads */
    int n_head_kv;          /* KV heads; n_head / n_head_kv <= KCUDA_MAX_GROUP */
};

/* One sequence of a step: n_tok new tokens at positions pos .. pos+n_tok-1,
 * whose K/V are already in the cache (kcuda_rope_kv ran first). */
struct kcuda_seq {
    int32_t row;            /* row of its first token in q and out */
    int32_t n_tok;          /* new tokens, >= 1 (exactly 1 for decode) */
    int32_t pos;            /* position of the first new token (tokens cached before it) */
    uint32_t table;         /* index of its block table's first entry in `tables` */
};

struct kcuda_attn_args {
    struct kcuda_kv kv;     /* the layer */
    float *out;             /* (rows, n_head * head_dim): row i, head h at out + (i*n_head + h)*head_dim */
    const float *q;         /* (rows, n_head * head_dim), rotated; same layout */
    const struct kcuda_seq *seqs; /* (n_seq) */
    int n_seq;
    const uint32_t *tables; /* block tables: seq s's logical block j at tables[seqs[s].table + j] */
    int max_tok;            /* host: >= every n_tok (sizes the prefill grid) */
    int max_ctx;            /* host: >= every pos + n_tok (sizes the decode grid) */
    float scale;            /* 1 / sqrt(head_dim) */
    int split;              /* positions per split, a multiple of 32; 0: KCUDA_ATTN_SPLIT.
                             * Must stay the same for all calls whose results must agree. */
    float *scratch;         /* decode: kcuda_attn_scratch_bytes() bytes (NULL when that is 0) */
    int window;             /* a sliding-window layer: a query at position p sees [p + 1 - window,
                             * p] (kern_attn's skip); 0: everything before it */
};

/* Bytes of decode scratch for n_seq sequences of at most max_ctx positions. */
size_t kcuda_attn_scratch_bytes(int n_seq, int n_head, int head_dim, int max_ctx, int split);

/*
 * Decode attention, twin of kern_attn / kern_attn_paged: one query token per
 * sequence (n_tok == 1) attending to positions [0, pos] (with a window, the
 * last `window` of them: splits wholly before it are not run, tiles wholly
 * before it not read).
 * One warp per (sequence, KV head, split) loads each K/V tile once for all
 * query heads of its group; sequences longer than one split are merged by
 * log-sum-exp in a second kernel. The query meets K in K's precision, as in
 * the twin: rounded to f16 over F16 K; over Q8_0 / Q4_0 K quantized to Q8_0
 * once per row, and q.k summed as integer dot products (dp4a) per 32-value
 * block, scaled by both blocks' scales. V rows are dequantized in registers.
 * KVD_EINVAL for a bad argument, KVD_EUNSUPPORTED for a head_dim other than
 * 64/128/256, a group above 8 (above 4 at 256 for prefill) or a K/V type other
 * than F16, Q8_0 and Q4_0.
 */
int kcuda_attn_decode(const struct kcuda_attn_args *a, kcuda_stream_t stream);

/*
 * Prefill attention, causal over the paged cache: token i of sequence s
 * attends to [0, pos + i], the prefix cached before the chunk included (with a
 * window, its last `window` positions).
 * Gives each (token, head) the same bits as kcuda_attn_decode would with the
 * same split. Needs no scratch. Errors as kcuda_attn_decode.
 */
int kcuda_attn_prefill(const struct kcuda_attn_args *a, kcuda_stream_t stream);

/*
 * RoPE of q (in place) and k, and the K/V write into the cache: twin of
 * kern_rope_angles + kern_rope + the K/V store of the CPU forward step
 * (engine/forward.c rope_run): halves named in kv.rotate are rotated by the
 * orthonormal Walsh-Hadamard transform first (and q with K), then each row is
 * stored as its type: F16 rounded; Q8_0 as kern_quantize_act; Q4_0 with the
 * least-squares scale search of kern_quantize_q4_0_lsq. Rotation and the
 * quantized types need head_dim 64, 128 or 256 (KVD_EUNSUPPORTED otherwise).
 *   q:     (T, n_head * head_dim), rotated in place
 *   k, v:  (T, n_head_kv * head_dim) new keys and values (k is not modified)
 *   pos:   (T) position of each token
 *   block: (T) physical block of each token's position (its table's entry pos / block_tokens)
 *   step:  powf(rope_base, -2.0f / head_dim), computed on the host as the C twin does
 */
struct kcuda_rope_args {
    struct kcuda_kv kv;     /* the layer written */
    float *q;
    const float *k;
    const float *v;
    const int32_t *pos;
    const uint32_t *block;
    int T;                  /* tokens */
    float step;
    bool neox;              /* pairs (i, i + head_dim/2), as kern_rope_neox (Gemma); else
                             * adjacent pairs (2i, 2i+1), as kern_rope */
};
int kcuda_rope_kv(const struct kcuda_rope_args *a, kcuda_stream_t stream);

/*
 * The keys of whole blocks turned by delta positions, in place: twin of
 * engine_kv_shift (engine/forward.c) for one layer. Every K row of blocks
 * blocks[0 .. n_blocks) (every KV head, every position of the block) is read
 * back as floats as kern_dequantize_row gives it, un-rotated (kern_hadamard)
 * where kv.rotate has KCUDA_ROT_K, turned by the RoPE angles of position
 * delta (kern_rope_angles(delta), then kern_rope or kern_rope_neox), rotated
 * again and stored as its type as kcuda_rope_kv stores K. RoPE's turns
 * compose, so a key written at position p then carries the angles of
 * p + delta, up to the rounding of its type. V is not read. K may be F16,
 * Q8_0, Q4_0 or F32 (rows of head_dim floats; only this kernel reads them);
 * head_dim 64, 128 or 256 (KVD_EUNSUPPORTED otherwise). Block ids must be
 * inside the cache (not checked here) and distinct.
 *   blocks: (n_blocks) physical block ids, device memory
 *   step:   powf(rope_base, -2.0f / head_dim) of the layer's base, computed on
 *           the host as the C twin does
 */
struct kcuda_kv_shift_args {
    struct kcuda_kv kv;     /* the layer turned (k, block_stride, k_head_stride, k_type,
                             * rotate, block_tokens, head_dim, n_head_kv are read) */
    const uint32_t *blocks;
    int n_blocks;
    int32_t delta;          /* positions: negative turns the keys earlier */
    float step;
    bool neox;              /* pairs (i, i + head_dim/2), as kern_rope_neox; else adjacent */
};
int kcuda_kv_shift(const struct kcuda_kv_shift_args *a, kcuda_stream_t stream);

/* The orthonormal Walsh-Hadamard transform (twin of kern_hadamard) of each of
 * the n consecutive vectors of head_dim (64, 128 or 256) floats at x, in place: the
 * attention outputs over a rotated V cache rotated back. */
int kcuda_hadamard(float *x, int64_t n, int head_dim, kcuda_stream_t stream);

/* ---- matrix products ------------------------------------------------------- */

/*
 * out[t * ldo + r] (=, or += when add) the dot product of weight row r with
 * activation row t, for r < rows, t < T: twin of kern_gemm / kern_vec_dot.
 * Weights: KERN_Q4_1 (activations Q8_1), KERN_Q8_0 and KERN_Q5_0 (activations
 * Q8_0), KERN_Q4_K and KERN_Q6_K (activations Q8_K, n a multiple of 256) or
 * KERN_F16 (activations F32): kern_vec_dot_type(wtype), made by
 * kcuda_quantize_act. The K-quants are taken a sub-block of 32 at a time, their
 * float terms formed per sub-block (the twin: per super-block, in 8 lanes). Integer dot per block, the block's float terms as the C
 * twin forms them, fp32 sums. Each warp takes one or two weight rows and
 * tokens in groups of up to 16 that share the unpacked rows, with the
 * activations staged in shared memory; a token's result never depends on T.
 * Alignment: act and act_stride 16 bytes; w and row_bytes 4 bytes (Q4_1,
 * Q4_K), 2 (Q8_0, Q5_0), 16 (F16, with n % 8 == 0); Q6_K: w 4, row_bytes 2. ldo >= rows when T > 1 (KVD_EINVAL otherwise);
 * out must not overlap w or act (they are read through the read-only cache).
 */
struct kcuda_gemm_args {
    uint32_t wtype;         /* enum kern_type of the weights */
    const void *w;          /* rows x row_bytes */
    size_t row_bytes;       /* bytes per weight row */
    int64_t rows;           /* output features */
    int64_t n;              /* input features (a multiple of 32 for quantized types) */
    const void *act;        /* T activation rows */
    size_t act_stride;      /* bytes between activation rows */
    int T;                  /* tokens */
    float *out;
    size_t ldo;             /* floats between output rows (tokens) */
    bool add;               /* accumulate (residual) instead of storing */
};
int kcuda_gemm(const struct kcuda_gemm_args *a, kcuda_stream_t stream);

/* n_mat (1..KCUDA_GEMM_MAX_MATS) products in one launch, each exactly as
 * kcuda_gemm would compute it (same bits): a[i] may differ only in w,
 * row_bytes, rows, out and ldo; KVD_EINVAL when the type, width,
 * activations, T or add differ. For Q, K and V of a layer, or gate and up. */
#define KCUDA_GEMM_MAX_MATS 3
int kcuda_gemm_n(const struct kcuda_gemm_args *a, int n_mat, kcuda_stream_t stream);

/* Quantizes T rows of n floats (row t at x + t * ldx) into activation rows of
 * act_type (KERN_Q8_0, KERN_Q8_1, KERN_Q8_K or KERN_F32) at dst + t * dst_stride:
 * twin of kern_quantize_act, bit for bit. n % 32 == 0 for Q8_0 / Q8_1, n % 256
 * for Q8_K. */
int kcuda_quantize_act(uint32_t act_type, const float *x, size_t ldx, void *dst, size_t dst_stride,
                       int64_t n, int T, kcuda_stream_t stream);

/* out[t * n ..] = row ids[t] of a (n_rows, n) matrix of type (F32, F16, Q4_0,
 * Q4_1, Q8_0) dequantized: twin of kern_dequantize_row, bit for bit (the
 * token embedding lookup). Ids must be < n_rows (the engine checks them). */
int kcuda_get_rows(uint32_t type, const void *w, size_t row_bytes, int64_t n, const int32_t *ids,
                   int T, float *out, kcuda_stream_t stream);

/* ---- element-wise and reductions ------------------------------------------- */

/* out row i = x row (rows ? rows[i] : i), RMS-normalized and scaled by w (n):
 * twin of kern_rmsnorm (sum of squares in double). out may alias x when rows is NULL. */
int kcuda_rmsnorm(float *out, const float *x, const float *w, const int32_t *rows, int n, int T,
                  float eps, kcuda_stream_t stream);

/* gate[i] = silu(gate[i]) * up[i] for T rows of n: twin of kern_swiglu. */
int kcuda_swiglu(float *gate, const float *up, int64_t n, int T, kcuda_stream_t stream);

/* gate[i] = gelu(gate[i]) * up[i] for T rows of n: twin of kern_geglu, bit for
 * bit. table: a device copy of kern_gelu_table() (65536 floats: GELU of every
 * half, rounded to a half), read at the half nearest each gate value in
 * (-10, 10); 0 at or below -10, the value itself at or above 10. */
int kcuda_geglu(float *gate, const float *up, int64_t n, int T, const float *table, kcuda_stream_t stream);

/* Gemma's norm after a sublayer: y = RMSNorm(y) * w in place, then x += y,
 * for T rows of n (twin: engine/forward.c's post_norm_run). */
int kcuda_rmsnorm_add(float *x, float *y, const float *w, int n, int T, float eps, kcuda_stream_t stream);

/* x[i] *= s for count floats (Gemma's embeddings times sqrt(n_embd)). */
int kcuda_scale(float *x, float s, int64_t count, kcuda_stream_t stream);

/* kcuda_rmsnorm (rows NULL), or kcuda_swiglu, followed by kcuda_quantize_act
 * of the result into act (act_type KERN_Q8_0 or KERN_Q8_1, rows act_stride
 * bytes apart), in one kernel and with the same bits as the two: the input
 * of the next products without a launch of its own. n % 32 == 0. */
int kcuda_rmsnorm_quant(float *out, const float *x, const float *w, int n, int T, float eps,
                        uint32_t act_type, void *act, size_t act_stride, kcuda_stream_t stream);
int kcuda_swiglu_quant(float *gate, const float *up, int64_t n, int T, uint32_t act_type, void *act,
                       size_t act_stride, kcuda_stream_t stream);

/* ids[t] = index of the largest of the n logits of row t (rows ld floats
 * apart), lowest index on a tie: twin of sampler_argmax, NaNs included (a NaN
 * is never chosen, except at index 0, which then wins as in the twin). */
int kcuda_argmax(int32_t *ids, const float *logits, int64_t n, size_t ld, int T,
                 kcuda_stream_t stream);

/* ---- token choice ------------------------------------------------------------ */

#define KCUDA_SAMPLE_MAX_K 1024 /* most candidates a sampled draw keeps */

/* One draw over one row of logits: struct sampler_draw (engine/sampler.h)
 * with its penalized ids in a device array. */
struct kcuda_draw {
    int32_t row;            /* row of logits; < 0: no draw (its id is -1) */
    int32_t top_k;          /* candidates kept: the twin's k (top_k, or n when that is off or
                             * larger), 1 .. KCUDA_SAMPLE_MAX_K when temperature > 0 */
    float temperature;      /* <= 0: greedy */
    float top_p;            /* 1: off */
    float min_p;            /* 0: off */
    float repeat_penalty;   /* divides positive, multiplies negative logits of the ids below */
    double log_min_p;       /* log(min_p) as the host computed it */
    double u;               /* uniform in [0, 1) */
    uint32_t pen_off;       /* the row's penalized ids: pen[pen_off .. pen_off + n_pen) */
    uint32_t n_pen;         /* distinct, each < n */
    uint32_t bias_off;      /* the ids that get an addend after the penalty: pen[bias_off ..
                             * bias_off + n_bias), the addends at the same places of pen_add */
    uint32_t n_bias;        /* distinct, each < n */
};

/*
 * ids[i] = the token draw i chooses from its row of logits (rows ld floats
 * apart, n per row), for i < R: twin of sampler_pick. The penalty is applied
 * to the row in place. Greedy draws are kcuda_argmax's; sampled ones keep the
 * twin's k best (larger logit, then lower id), its top-p and min-p cuts and
 * its temperature, and add the probabilities in its order, so the choice is
 * the twin's unless u falls within a rounding error (the last bit of the
 * CUDA libm's exp) of a boundary between two tokens. A row with NaNs gets
 * some valid id. One block of KCUDA_SAMPLE_MAX_K threads per draw.
 */
int kcuda_sample(int32_t *ids, float *logits, int64_t n, size_t ld, const struct kcuda_draw *draws, int R,
                 const int32_t *pen, const float *pen_add, kcuda_stream_t stream);

#ifdef __cplusplus
}
#endif

#endif
