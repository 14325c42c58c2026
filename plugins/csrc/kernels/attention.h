// Paged attention with the KV write fused in, for a packed batch of sequences.
//
// The batch holds, back to back, the new tokens of several sequences (decode steps and
// prefill chunks together, no padding): sequence s owns tokens [query_start[s],
// query_start[s+1]) at positions context_lens[s] + 0, 1, ... Keys and values live in a pool
// of blocks [num_blocks, kv_heads, block_size, head_dim]; block_tables[s][i] is the pool
// block holding the sequence's positions [i * block_size, (i + 1) * block_size). Within a block
// each KV head's keys (and values) are one contiguous run, the order its attention reads them.
//
// The input is the fused QKV projection [tokens, (heads + 2 kv_heads) * head_dim]. Rotary
// embedding (rotate-half convention, cos/sin tables [positions, rotary_dim] in the model dtype,
// rotary_dim = head_dim or, partial rotary, the first rotary_dim values of each head) is applied
// inside, rounded step by step as Hugging Face's apply_rotary_pos_emb rounds it.
// First every new token's rotated k and its v are written to their slot, then each (token, head) attends
// causally to positions [0, its own] of its sequence, or with a sliding window W (shape.window) to
// the last W of them, (p - W, p], as Hugging Face's sliding-window mask has it (Mistral, Gemma 3's
// local layers): one pass over the blocks with an online softmax in fp32, rescaled once per block. Grouped-query attention: head h reads kv head
// h / (heads / kv_heads).
// The pool holds T (the model dtype) or a quantized P (int8, FP8 E4M3) with one scale per
// channel of K and of V (kv_scales [2, kv_heads * head_dim]): k / k_scale and v / v_scale
// are stored; K's scales are folded into the query (q . (k_q * s) = (q * s) . k_q) and V's
// into the output, so the loops over the blocks only widen the stored bytes.
// With key_hadamard = B (a power of two dividing head_dim), q and k are multiplied by the
// orthonormal Walsh-Hadamard matrix of size B (blockwise) after rotary embedding: q . k is
// unchanged, but the few channels where RoPE'd keys are large are spread over all B, so the
// cache's per-value rounding error (FP8's is relative to each value) no longer lands on the
// channels that dominate the scores (hadamard.h; plugins/formats.py).
// A block's scores are computed kLanes keys at a time (one transposing reduction for the kLanes
// dot products), exponentiated kLanes at a time, and the weighted values summed in registers.
// The query heads that share a KV head go through its blocks together, so each key and value is
// loaded and widened once for all of them, and a decode token's next blocks of keys and values
// are prefetched while one block runs (a prefill chunk's are in cache). Each (token, KV head)
// takes its context in chunks of whole blocks that threads run separately; their partial
// softmaxes are merged in chunk order. The chunks depend on the token's context alone, so a
// token's result is the same bits in any batch and on any number of threads
// (benchmarks/ablations/attention_context.py; tests/plugins/test_attention.py).
// Where AMX multiplies bf16 (the avx512amx level), a bf16 pool's calls take attention_amx.h's
// route instead: the tokens of a prefill chunk share tiles (scores and values on AMX), and
// every token of such a call, decode steps' included, goes that way.
// Included per ISA inside kiln::<isa> after vec.h, hadamard.h and amx.h.

// x * cos + rotate_half(x) * sin for one head vector, into fp32 (values rounded to T). Only the
// first `rotary` values rotate (partial rotary, as Phi-4-mini has it: cos / sin hold `rotary`
// values a position); the rest pass through unchanged.
template <typename T>
inline void rope_into(float* dst, const T* x, const T* cos, const T* sin, int64_t head_dim, int64_t rotary) {
  const int64_t half = rotary / 2;
  for (int64_t d = rotary; d < head_dim; ++d) dst[d] = to_f32(x[d]);
#if !defined(KILN_ISA_SCALAR)
  if (half % kLanes == 0) {  // the same roundings, kLanes at a time
    const vfloat minus_one = vset1(-1.f);  // -x exactly, the sign of zero included
    for (int64_t d = 0; d < half; d += kLanes) {
      const vfloat lo = vload(x + d), hi = vload(x + d + half);
      const vfloat neg_hi = vmul(hi, minus_one);
      vstore(dst + d, vround_as<T>(vadd(vround_as<T>(vmul(lo, vload(cos + d))),
                                        vround_as<T>(vmul(neg_hi, vload(sin + d))))));
      vstore(dst + d + half, vround_as<T>(vadd(vround_as<T>(vmul(hi, vload(cos + d + half))),
                                               vround_as<T>(vmul(lo, vload(sin + d + half))))));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < rotary; ++d) {
    const float rotated = d < half ? -to_f32(x[d + half]) : to_f32(x[d - half]);
    dst[d] = round_as<T>(round_as<T>(to_f32(x[d]) * to_f32(cos[d])) +
                         round_as<T>(rotated * to_f32(sin[d])));
  }
}

#if defined(KILN_ISA_AVX512)
// Sixteen vectors -> one vector of their sums (lane i = the sum of v[i]), 45 instructions instead
// of sixteen horizontal reductions: pairs are interleaved and added within 128-bit lanes, then
// the 128-bit lanes are combined.
inline __m512 sum16(const __m512* v) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // lane L of s[i]: the lane-L sums of v[4i .. 4i+3]
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline vfloat sum_lanes(const vfloat* v) { return sum16(v); }

// scores[i] = exp(scores[i] - shift); returns their sum
inline float exp_shifted(float* scores, int64_t n, float shift) {
  __m512 total = _mm512_setzero_ps();
  const __m512 vs = _mm512_set1_ps(shift);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + i), vs));
    _mm512_storeu_ps(scores + i, e);
    total = _mm512_add_ps(total, e);
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + i), vs));
    _mm512_mask_storeu_ps(scores + i, m, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(total);
}
// the largest of x[0, n), n >= 1 (a block's scores: the softmax shift)
inline float max_of(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  float top = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}
#elif defined(KILN_ISA_AVX2)
// Eight vectors -> one vector of their sums (lane i = the sum of v[i])
inline __m256 sum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
inline vfloat sum_lanes(const vfloat* v) { return sum8(v); }

// scores[i] = exp(scores[i] - shift); returns their sum (the last n % 8 through a padded vector)
inline float exp_shifted(float* scores, int64_t n, float shift) {
  __m256 total = _mm256_setzero_ps();
  const __m256 vs = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vs));
    _mm256_storeu_ps(scores + i, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = vsum(total);
  if (i < n) {
    float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = i + j < n ? scores[i + j] : shift;
    _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), vs)));
    for (int64_t j = i; j < n; ++j) sum += scores[j] = tail[j - i];
  }
  return sum;
}

// the largest of x[0, n), n >= 1 (a block's scores: the softmax shift)
inline float max_of(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}
#endif

// The query heads that share a KV head (grouped-query attention) go through its blocks together:
// each key and value vector is loaded (and widened from bf16 / int8 / FP8) once for all of them.
// Each head's arithmetic is the one-head loop's, in the same order.

// acc_h += sum_i p_h[i] * v_i head by head (the scalar level, and head_dims off the vector width)
template <typename P>
inline void group_pv_plain(float* acc, int64_t heads, int64_t a_stride, const float* p, int64_t p_stride, const P* v,
                           int64_t stride, int64_t n, int64_t head_dim) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < n; ++i) axpy(acc + h * a_stride, p[h * p_stride + i], v + i * stride, head_dim);
}

#if !defined(KILN_ISA_SCALAR)
// group_scores_n's whole chunks of kLanes keys for a head of DV vectors, the d loop unrolled and
// four keys' chains interleaved (one key's chain of DV dependent FMAs alone waits on each FMA's
// latency); each key's arithmetic as group_scores_n's. Returns the keys done.
template <int HG, int DV, typename P>
inline int64_t group_scores_dv(const float* q, int64_t q_stride, const P* k, int64_t stride, int64_t n,
                               float* scores, int64_t s_stride) {
  static_assert(kLanes % 4 == 0, "keys four at a time");
  int64_t i = 0;
  vfloat acc[HG][kLanes];
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; j += 4) {
      vfloat a[4][HG];
      for (int u = 0; u < 4; ++u) {
        const vfloat k0 = vload(k + (i + j + u) * stride);
        for (int h = 0; h < HG; ++h) a[u][h] = vmul(vload(q + h * q_stride), k0);
      }
      for (int d = 1; d < DV; ++d)
        for (int u = 0; u < 4; ++u) {
          const vfloat kd = vload(k + (i + j + u) * stride + d * kLanes);
          for (int h = 0; h < HG; ++h) a[u][h] = vfma(vload(q + h * q_stride + d * kLanes), kd, a[u][h]);
        }
      for (int u = 0; u < 4; ++u)
        for (int h = 0; h < HG; ++h) acc[h][j + u] = a[u][h];
    }
    for (int h = 0; h < HG; ++h) vstore(scores + h * s_stride + i, sum_lanes(acc[h]));
  }
  return i;
}

// scores[h * s_stride + i] = q_h . k_i for HG heads (q_h at q + h * q_stride) and the n keys of a
// block (key i at k + i * stride), kLanes keys at a time
template <int HG, typename P>
inline void group_scores_n(const float* q, int64_t q_stride, const P* k, int64_t stride, int64_t n, int64_t head_dim,
                           float* scores, int64_t s_stride) {
  int64_t i = 0;
  if (head_dim == 4 * kLanes) {  // 64 on AVX-512, 32 on AVX2
    i = group_scores_dv<HG, 4>(q, q_stride, k, stride, n, scores, s_stride);
  } else if (head_dim == 8 * kLanes) {  // 128 on AVX-512, 64 on AVX2
    i = group_scores_dv<HG, 8>(q, q_stride, k, stride, n, scores, s_stride);
  } else if (head_dim % kLanes == 0) {
    vfloat acc[HG][kLanes];
    for (; i + kLanes <= n; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const P* kj = k + (i + j) * stride;
        const vfloat k0 = vload(kj);
        vfloat a[HG];
        for (int h = 0; h < HG; ++h) a[h] = vmul(vload(q + h * q_stride), k0);
        for (int64_t d = kLanes; d < head_dim; d += kLanes) {
          const vfloat kd = vload(kj + d);
          for (int h = 0; h < HG; ++h) a[h] = vfma(vload(q + h * q_stride + d), kd, a[h]);
        }
        for (int h = 0; h < HG; ++h) acc[h][j] = a[h];
      }
      for (int h = 0; h < HG; ++h) vstore(scores + h * s_stride + i, sum_lanes(acc[h]));
    }
  }
  for (; i < n; ++i)
    for (int h = 0; h < HG; ++h) scores[h * s_stride + i] = dot(q + h * q_stride, k + i * stride, head_dim);
}

// acc_h[0, kLanes C) += sum_i p_h[i] * v_i for HG heads (acc_h at acc + h * a_stride, p_h at
// p + h * p_stride; value i at v + i * stride), the accumulators in registers
template <int HG, int C, typename P>
inline void group_pv_c(float* acc, int64_t a_stride, const float* p, int64_t p_stride, const P* v, int64_t stride,
                       int64_t n) {
  vfloat a[HG][C];
  for (int h = 0; h < HG; ++h)
    for (int c = 0; c < C; ++c) a[h][c] = vload(acc + h * a_stride + kLanes * c);
  for (int64_t i = 0; i < n; ++i) {
    vfloat pi[HG];
    for (int h = 0; h < HG; ++h) pi[h] = vset1(p[h * p_stride + i]);
    const P* vi = v + i * stride;
    for (int c = 0; c < C; ++c) {
      const vfloat vc = vload(vi + kLanes * c);
      for (int h = 0; h < HG; ++h) a[h][c] = vfma(pi[h], vc, a[h][c]);
    }
  }
  for (int h = 0; h < HG; ++h)
    for (int c = 0; c < C; ++c) vstore(acc + h * a_stride + kLanes * c, a[h][c]);
}

// the columns [c0, ...) of the head vectors in passes of C vectors while C of them remain
template <int HG, int C, typename P>
inline void group_pv_passes(float* acc, int64_t a_stride, const float* p, int64_t p_stride, const P* v, int64_t stride,
                            int64_t n, int64_t vectors, int64_t& c0) {
  for (; c0 + C <= vectors; c0 += C)
    group_pv_c<HG, C>(acc + c0 * kLanes, a_stride, p, p_stride, v + c0 * kLanes, stride, n);
}

template <int HG, typename P>
inline void group_pv_n(float* acc, int64_t a_stride, const float* p, int64_t p_stride, const P* v, int64_t stride,
                       int64_t n, int64_t head_dim) {
  if (head_dim % kLanes != 0) return group_pv_plain(acc, HG, a_stride, p, p_stride, v, stride, n, head_dim);
  // columns per pass: the accumulators (HG x C) stay within the registers (16 AVX2, 32 AVX-512),
  // and the widest pass that fits the head goes first (a 64-wide head is 4 AVX-512 vectors: one
  // pass of 4, not four of 1, each of which would walk the block's values again)
  constexpr int kBudget = kLanes == 16 ? 24 : 12;
  constexpr int C = kBudget / HG >= 8 ? 8 : kBudget / HG >= 4 ? 4 : kBudget / HG >= 2 ? 2 : 1;
  const int64_t vectors = head_dim / kLanes;
  int64_t c0 = 0;
  group_pv_passes<HG, C>(acc, a_stride, p, p_stride, v, stride, n, vectors, c0);
  if constexpr (C > 4) group_pv_passes<HG, 4>(acc, a_stride, p, p_stride, v, stride, n, vectors, c0);
  if constexpr (C > 2) group_pv_passes<HG, 2>(acc, a_stride, p, p_stride, v, stride, n, vectors, c0);
  if constexpr (C > 1) group_pv_passes<HG, 1>(acc, a_stride, p, p_stride, v, stride, n, vectors, c0);
}
#else
template <int HG, typename P>
inline void group_scores_n(const float* q, int64_t q_stride, const P* k, int64_t stride, int64_t n, int64_t head_dim,
                           float* scores, int64_t s_stride) {
  for (int64_t i = 0; i < n; ++i)
    for (int h = 0; h < HG; ++h) scores[h * s_stride + i] = dot(q + h * q_stride, k + i * stride, head_dim);
}

template <int HG, typename P>
inline void group_pv_n(float* acc, int64_t a_stride, const float* p, int64_t p_stride, const P* v, int64_t stride,
                       int64_t n, int64_t head_dim) {
  group_pv_plain(acc, HG, a_stride, p, p_stride, v, stride, n, head_dim);
}

inline float exp_shifted(float* scores, int64_t n, float shift) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += scores[i] = std::exp(scores[i] - shift);
  return total;
}

inline float max_of(const float* x, int64_t n) { return *std::max_element(x, x + n); }
#endif

// run(std::integral_constant<int, HG>, h): heads [h, h + HG) of `heads`, four at a time, then the rest
template <typename Run>
inline void by_head_groups(int64_t heads, Run run) {
  int64_t h = 0;
  for (; h + 4 <= heads; h += 4) run(std::integral_constant<int, 4>{}, h);
  switch (heads - h) {
    case 3: return run(std::integral_constant<int, 3>{}, h);
    case 2: return run(std::integral_constant<int, 2>{}, h);
    case 1: return run(std::integral_constant<int, 1>{}, h);
  }
}

template <typename P>
inline void group_scores(const float* q, int64_t heads, int64_t q_stride, const P* k, int64_t stride, int64_t n,
                         int64_t head_dim, float* scores, int64_t s_stride) {
  by_head_groups(heads, [&](auto hg, int64_t h) {
    group_scores_n<decltype(hg)::value>(q + h * q_stride, q_stride, k, stride, n, head_dim, scores + h * s_stride,
                                        s_stride);
  });
}

template <typename P>
inline void group_pv(float* acc, int64_t heads, int64_t a_stride, const float* p, int64_t p_stride, const P* v,
                     int64_t stride, int64_t n, int64_t head_dim) {
  by_head_groups(heads, [&](auto hg, int64_t h) {
    group_pv_n<decltype(hg)::value>(acc + h * a_stride, a_stride, p + h * p_stride, p_stride, v, stride, n, head_dim);
  });
}

// One KV head's keys and values for n positions of a block (a contiguous run of n x head_dim at
// `from` in each) requested ahead of their use: after the rest of a decode step they come from
// memory
template <typename P>
inline void prefetch_run(const P* keys, const P* values, int64_t from, int64_t n, int64_t head_dim) {
  const int64_t bytes = n * head_dim * static_cast<int64_t>(sizeof(P));
  for (int64_t at_byte = 0; at_byte < bytes; at_byte += 64) {
    prefetch_line(reinterpret_cast<const char*>(keys + from) + at_byte);
    prefetch_line(reinterpret_cast<const char*>(values + from) + at_byte);
  }
}

// a context's chunk for the work split (in tokens, rounded down to whole blocks), and the most
// chunks one token's context is split into
constexpr int64_t kChunkTokens = 128, kMaxChunks = 16;

// One chunk of a (token, head)'s context as the merge reads it: its running max, its softmax
// denominator, then its head_dim weighted sums
inline void store_partial(float* part, float running_max, float denom, const float* acc, int64_t head_dim) {
  part[0] = running_max;
  part[1] = denom;
  std::copy(acc, acc + head_dim, part + 2);
}

#include "attention_amx.h"

template <typename T, typename P>
void paged_attention_impl(const T* qkv, const T* cos, const T* sin, P* k_pool, P* v_pool, T* out,
                          const int32_t* block_tables, const int32_t* query_start,
                          const int32_t* context_lens, const int32_t* token_seq,
                          const PagedShape& shape, float scale, const float* kv_scales) {
  constexpr bool quantized = !std::is_same_v<P, T>;
  const int64_t row = shape.kv_heads * shape.head_dim;  // one token's keys (qkv's and the scales' layout)
  const int64_t block_stride = shape.block_size * row;
  const int64_t head_run = shape.block_size * shape.head_dim;  // one KV head's keys in a block
  const int64_t head_dim = shape.head_dim, bs = shape.block_size, rotary = shape.rotary_dim;
  auto position_of = [&](int64_t token) {
    const int32_t s = token_seq[token];
    return static_cast<int64_t>(context_lens[s]) + (token - query_start[s]);
  };
  auto first_key = [&](int64_t position) {  // the first position a token at `position` attends to
    return shape.window > 0 ? std::max<int64_t>(0, position + 1 - shape.window) : int64_t{0};
  };
  auto slot_of = [&](int64_t seq, int64_t position) {
    return block_tables[seq * shape.max_blocks + position / bs] * block_stride + (position % bs) * head_dim;
  };

#if defined(KILN_ISA_AMX)  // a bf16 pool on tiles (attention_amx.h); int8 / FP8 pools and fp32 stay here
  const bool amx = std::is_same_v<T, bf16> && !quantized && amx_attention_fits(shape);
#else
  constexpr bool amx = false;
#endif
  const int64_t qkv_row = (shape.heads + 2 * shape.kv_heads) * head_dim;
  const int64_t q_size = shape.heads * head_dim;
  std::vector<float> inv_scales(quantized ? 2 * row : 0);  // 1 / k_scale, then 1 / v_scale
  for (size_t i = 0; i < inv_scales.size(); ++i) inv_scales[i] = 1.f / kv_scales[i];
  // each token's rotated queries, scaled (and with K's scales folded in), made once for every
  // chunk of its context that attends with them
  const int64_t group = shape.heads / shape.kv_heads, tokens = shape.tokens;
  // The FMA loop reads them as floats; the AMX route as bf16 (exactly: rotary embedding rounds
  // them to bf16), written here by the threads rather than converted after. Neither is zeroed:
  // every element is written.
  const int64_t query_count = tokens * shape.heads * head_dim;
  const std::unique_ptr<float[]> queries(amx ? nullptr : new float[query_count]);
  const std::unique_ptr<bf16[]> queries_bf16(amx ? new bf16[query_count] : nullptr);
  parallel_for(0, shape.tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(head_dim), rotated_query(amx ? head_dim : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t position = position_of(t);
      for (int64_t h = 0; h < shape.heads; ++h) {
        float* q = amx ? rotated_query.data() : queries.get() + (t * shape.heads + h) * head_dim;
        rope_into(q, qkv + t * qkv_row + h * head_dim, cos + position * rotary, sin + position * rotary,
                  head_dim, rotary);
        if (shape.key_hadamard) hadamard_inplace(q, head_dim, shape.key_hadamard);
        if (!amx)  // the AMX route scales the scores (its queries stay bf16 exactly)
          for (int64_t d = 0; d < head_dim; ++d) q[d] *= scale;
        if constexpr (quantized)
          for (int64_t d = 0; d < head_dim; ++d) q[d] *= kv_scales[(h / group) * head_dim + d];
        if (amx) widen_to_bf16(queries_bf16.get() + (t * shape.heads + h) * head_dim, q, head_dim);
      }
      const int64_t slot = slot_of(token_seq[t], position);
      const T* k = qkv + t * qkv_row + q_size;
      for (int64_t g = 0; g < shape.kv_heads; ++g) {
        rope_into(rotated.data(), k + g * head_dim, cos + position * rotary, sin + position * rotary,
                  head_dim, rotary);
        if (shape.key_hadamard) hadamard_inplace(rotated.data(), head_dim, shape.key_hadamard);
        if constexpr (quantized)
          store_scaled(k_pool + slot + g * head_run, rotated.data(), inv_scales.data() + g * head_dim, head_dim);
        else
          store_times_as(k_pool + slot + g * head_run, rotated.data(), 1.f, head_dim);  // x 1: exactly x
      }
      for (int64_t g = 0; g < shape.kv_heads; ++g) {
        const T* v = k + row + g * head_dim;
        if constexpr (quantized)
          store_scaled(v_pool + slot + g * head_run, v, inv_scales.data() + row + g * head_dim, head_dim);
        else
          std::memcpy(v_pool + slot + g * head_run, v, sizeof(T) * head_dim);
      }
    }
  });

  // A prefill chunk over an int8 / FP8 pool: its sequence's blocks are widened once into bf16
  // (which holds every int8 and E4M3 value exactly, so the scores are the same bits), and the
  // loops below read that copy instead of widening every block again for each of the chunk's
  // tokens and query heads.
  std::vector<std::vector<bf16>> widened;  // per sequence; empty where it has one new token
  if constexpr (quantized) {
    if (shape.tokens > shape.seqs) {  // some sequence brings several tokens (not a pure decode step)
      widened.resize(shape.seqs);
      parallel_for(0, shape.seqs, 1, [&](int64_t begin, int64_t end) {
        for (int64_t s = begin; s < end; ++s) {
          const int64_t count = query_start[s + 1] - query_start[s];
          if (count < 2) continue;
          const int64_t blocks = (context_lens[s] + count + bs - 1) / bs;
          std::vector<bf16>& copy = widened[s];
          copy.resize(2 * blocks * block_stride);
          for (int64_t b = 0; b < blocks; ++b) {
            const int64_t from = block_tables[s * shape.max_blocks + b] * block_stride;
            widen_to_bf16(copy.data() + b * block_stride, k_pool + from, block_stride);
            widen_to_bf16(copy.data() + (blocks + b) * block_stride, v_pool + from, block_stride);
          }
        }
      });
    }
  }

  // Work items: (token, KV head, chunk of the token's context). A chunk is a run of whole blocks,
  // sized by the token's context alone (kChunkTokens, at most kMaxChunks of them), so a token's
  // result is the same bits in any batch and on any number of threads; the chunks of a long
  // context go to different threads, and their partial softmaxes are merged afterwards.
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkTokens / bs);
  // Blocks requested ahead: an item's first chunk's worth when it starts, then while block b runs
  // blocks b + 1 (again) and b + ahead. Requesting only block b + 1, or a whole layer's blocks at
  // once, was slower (docs/benchmarks.md, "Where a decode step's time goes").
  const int64_t ahead = chunk_blocks;
  std::vector<int64_t> chunks(tokens), per_chunk(tokens), first_item(tokens + 1, 0), first_part(tokens + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t position = position_of(t);  // keys [first_key, position]: the blocks from first_key's
    const int64_t blocks = (position + bs) / bs - first_key(position) / bs;
    const int64_t most = std::min((blocks + chunk_blocks - 1) / chunk_blocks, kMaxChunks);
    // the AMX route's chunks start at whole multiples of one length, so that the tokens of a tile
    // share them
    per_chunk[t] = amx ? std::max(chunk_blocks, (blocks + kMaxChunks - 1) / kMaxChunks) : (blocks + most - 1) / most;
    chunks[t] = (blocks + per_chunk[t] - 1) / per_chunk[t];  // none of them empty
    first_item[t + 1] = first_item[t] + shape.kv_heads * chunks[t];
    first_part[t + 1] = first_part[t] + (chunks[t] > 1 ? shape.heads * chunks[t] : 0);
  }
  const int64_t part_size = head_dim + 2;  // a partial: running max, denominator, accumulator
  // every partial is written before the merge reads it: no need to zero what a long prefill chunk
  // at a long context makes large (tokens x heads x chunks)
  const std::unique_ptr<float[]> parts(first_part[tokens] > 0 ? new float[first_part[tokens] * part_size] : nullptr);

  auto write_out = [&](T* orow, const float* acc, float inv, int64_t g) {
    if constexpr (quantized) {
      const float* v_scale = kv_scales + row + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) store_as(orow + d, acc[d] * inv * v_scale[d]);
    } else {
      store_times_as(orow, acc, inv, head_dim);
    }
  };

  // Each thread takes the next item not yet taken (one counter for all of them) until none is
  // left: a prefill chunk's later tokens attend over more positions, and a decode token's last
  // chunk is often shorter than its others, so fixed shares leave one thread waiting for another
  // (items i, i + n, i + 2n, ... for thread i of n gave two threads every token's first, longer,
  // chunk on one side: attention 1.4x faster on two threads than on one). An item's result is
  // the same whichever thread computes it.
  if (amx) {
#if defined(KILN_ISA_AMX)
    if constexpr (std::is_same_v<T, bf16> && !quantized) {
      std::vector<int64_t> positions(tokens);
      for (int64_t t = 0; t < tokens; ++t) positions[t] = position_of(t);
      amx_attend_items({queries_bf16.get(), k_pool, v_pool, out, block_tables, token_seq, query_start,
                        positions.data(), chunks.data(), per_chunk.data(), first_part.data(), parts.get(), scale},
                       shape);
    }
#endif
  } else {
    const int64_t items = first_item[tokens];
    const int64_t shares = std::min<int64_t>(items, thread_count());
    // the counter on a cache line of its own, not on the one holding the locals every thread reads
    struct alignas(64) Counter {
      std::atomic<int64_t> value{0};
    } next_item;
    parallel_for(0, shares, 1, [&](int64_t, int64_t) {  // a call runs items until none is left
      std::vector<float> acc(group * head_dim), scores(group * bs), running_max(group), denom(group);
      for (int64_t item = next_item.value.fetch_add(1, std::memory_order_relaxed); item < items;
           item = next_item.value.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t t = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
        const int64_t g = (item - first_item[t]) / chunks[t], c = (item - first_item[t]) % chunks[t];
        const int64_t s = token_seq[t];
        const int32_t* table = block_tables + s * shape.max_blocks;
        const int64_t position = position_of(t), context = position + 1, first = first_key(position);
        const int64_t blocks = (context + bs - 1) / bs;
        const int64_t b_first = first / bs + c * per_chunk[t], b_last = std::min(blocks, b_first + per_chunk[t]);
        const float* qf = queries.get() + (t * shape.heads + g * group) * head_dim;  // the group's heads
        // a prefill chunk's keys and values were just written or are read by its other tokens too:
        // in cache, where requesting them again only costs instructions (decode steps read them
        // from memory)
        const bool fetch = query_start[s + 1] - query_start[s] == 1;
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
        std::fill(denom.begin(), denom.end(), 0.f);
        // keys / values: the block storage; block_at(b): the storage block holding block b
        auto attend = [&](const auto* keys, const auto* values, auto block_at) {
          auto prefetch_block = [&](int64_t b) {  // this KV head's keys and values of block b, if the item has it
            if (fetch && b < b_last)
              prefetch_run(keys, values, block_at(b) * block_stride + g * head_run, std::min(bs, context - b * bs),
                           head_dim);
          };
          for (int64_t b = b_first; b < b_first + ahead; ++b) prefetch_block(b);
          for (int64_t b = b_first; b < b_last; ++b) {
            const int64_t skip = std::max<int64_t>(0, first - b * bs);  // keys before the window
            const int64_t n = std::min(bs, context - b * bs) - skip;
            const int64_t at = block_at(b) * block_stride + g * head_run + skip * head_dim;
            prefetch_block(b + 1);  // again: a prefetch the CPU dropped while many were in flight gets another chance
            if (ahead > 1) prefetch_block(b + ahead);
            group_scores(qf, group, head_dim, keys + at, head_dim, n, head_dim, scores.data(), bs);
            for (int64_t j = 0; j < group; ++j) {
              float* sj = scores.data() + j * bs;
              const float block_max = max_of(sj, n);
              if (block_max > running_max[j]) {
                const float correction = std::exp(running_max[j] - block_max);
                denom[j] *= correction;
                scale_inplace(acc.data() + j * head_dim, correction, head_dim);
                running_max[j] = block_max;
              }
              denom[j] += exp_shifted(sj, n, running_max[j]);
            }
            group_pv(acc.data(), group, head_dim, scores.data(), bs, values + at, head_dim, n, head_dim);
          }
        };
        if (widened.empty() || widened[s].empty()) {
          attend(k_pool, v_pool, [table](int64_t b) { return static_cast<int64_t>(table[b]); });
        } else {
          const std::vector<bf16>& copy = widened[s];
          attend(copy.data(), copy.data() + copy.size() / 2, [](int64_t b) { return b; });
        }
        for (int64_t j = 0; j < group; ++j) {
          const int64_t h = g * group + j;
          if (chunks[t] == 1) {
            write_out(out + (t * shape.heads + h) * head_dim, acc.data() + j * head_dim, 1.f / denom[j], g);
          } else {
            store_partial(parts.get() + (first_part[t] + h * chunks[t] + c) * part_size, running_max[j], denom[j],
                          acc.data() + j * head_dim, head_dim);
          }
        }
      }
    });
  }
  if (!parts) return;
  // the chunks of each (token, head), merged in chunk order (a decode step's few on the calling thread)
  parallel_for(0, tokens * shape.heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / shape.heads, h = item % shape.heads;
      if (chunks[t] == 1) continue;
      const float* first = parts.get() + (first_part[t] + h * chunks[t]) * part_size;
      float top = -std::numeric_limits<float>::infinity(), denom = 0.f;
      for (int64_t c = 0; c < chunks[t]; ++c) top = std::max(top, first[c * part_size]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < chunks[t]; ++c) {
        const float* part = first + c * part_size;
        const float weight = std::exp(part[0] - top);
        denom += part[1] * weight;
        axpy(acc.data(), weight, part + 2, head_dim);
      }
      write_out(out + (t * shape.heads + h) * head_dim, acc.data(), 1.f / denom, h / group);
    }
  });
}
