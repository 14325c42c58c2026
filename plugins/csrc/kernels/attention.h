// Paged attention with the KV write fused in, for a packed batch of sequences.
//
// The batch holds, back to back, the new tokens of several sequences (decode steps and
// prefill chunks together, no padding): sequence s owns tokens [query_start[s],
// query_start[s+1]) at positions context_lens[s] + 0, 1, ... Keys and values live in a pool
// of blocks [num_blocks, block_size, kv_heads, head_dim]; block_tables[s][i] is the pool
// block holding the sequence's positions [i * block_size, (i + 1) * block_size).
//
// The input is the fused QKV projection [tokens, (heads + 2 kv_heads) * head_dim]. Rotary
// embedding (rotate-half convention, cos/sin tables [positions, head_dim] in the model dtype)
// is applied inside, rounded step by step as Hugging Face's apply_rotary_pos_emb rounds it.
// First every new token's rotated k and its v are written to their slot, then each (token, head) attends
// causally to positions [0, its own] of its sequence: one pass over the blocks with an online
// softmax in fp32, rescaled once per block. Grouped-query attention: head h reads kv head
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
// With AVX-512 a block's scores are computed sixteen keys at a time (one transposing reduction
// for the sixteen dot products), exponentiated sixteen at a time, and the weighted values summed
// in registers: 1.6-2x the scalar-reduction loop with warm caches (190-4,000 cached tokens;
// benchmarks/ablations/attention_context.py).
// Included per ISA inside kiln::<isa> after vec.h and hadamard.h.

// x * cos + rotate_half(x) * sin for one head vector, into fp32 (values rounded to T).
template <typename T>
inline void rope_into(float* dst, const T* x, const T* cos, const T* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < head_dim; ++d) {
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
#endif

#if !defined(KILN_ISA_SCALAR)
// scores[i] = q . k_i for the n keys of a block (key i at k + i * stride), kLanes at a time
template <typename P>
inline void block_scores(const float* q, const P* k, int64_t stride, int64_t n, int64_t head_dim, float* scores) {
  int64_t i = 0;
  if (head_dim % kLanes == 0) {
    vfloat acc[kLanes];
    for (; i + kLanes <= n; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const P* kj = k + (i + j) * stride;
        vfloat a = vmul(vload(q), vload(kj));
        for (int64_t d = kLanes; d < head_dim; d += kLanes) a = vfma(vload(q + d), vload(kj + d), a);
        acc[j] = a;
      }
      vstore(scores + i, sum_lanes(acc));
    }
  }
  for (; i < n; ++i) scores[i] = dot(q, k + i * stride, head_dim);
}

// acc[0, kLanes C) += sum_i p[i] * v_i (value i at v + i * stride), the accumulators in registers
template <int C, typename P>
inline void block_pv_c(float* acc, const float* p, const P* v, int64_t stride, int64_t n) {
  vfloat a[C];
  for (int c = 0; c < C; ++c) a[c] = vload(acc + kLanes * c);
  for (int64_t i = 0; i < n; ++i) {
    const vfloat pi = vset1(p[i]);
    const P* vi = v + i * stride;
    for (int c = 0; c < C; ++c) a[c] = vfma(pi, vload(vi + kLanes * c), a[c]);
  }
  for (int c = 0; c < C; ++c) vstore(acc + kLanes * c, a[c]);
}

template <typename P>
inline void block_pv(float* acc, const float* p, const P* v, int64_t stride, int64_t n, int64_t head_dim) {
  const int64_t vectors = head_dim % kLanes == 0 ? head_dim / kLanes : 0;
#if defined(KILN_ISA_AVX2)
  if (vectors > 8 && vectors % 8 == 0) {  // e.g. head_dim 128: eight vectors at a time
    for (int64_t c0 = 0; c0 < vectors; c0 += 8) block_pv_c<8>(acc + c0 * kLanes, p, v + c0 * kLanes, stride, n);
    return;
  }
#endif
  switch (vectors) {
    case 2: return block_pv_c<2>(acc, p, v, stride, n);
    case 3: return block_pv_c<3>(acc, p, v, stride, n);
    case 4: return block_pv_c<4>(acc, p, v, stride, n);
    case 6: return block_pv_c<6>(acc, p, v, stride, n);
    case 8: return block_pv_c<8>(acc, p, v, stride, n);
    default:
      for (int64_t i = 0; i < n; ++i) axpy(acc, p[i], v + i * stride, head_dim);
  }
}
#else
template <typename P>
inline void block_pv(float* acc, const float* p, const P* v, int64_t stride, int64_t n, int64_t head_dim) {
  for (int64_t i = 0; i < n; ++i) axpy(acc, p[i], v + i * stride, head_dim);
}

template <typename P>
inline void block_scores(const float* q, const P* k, int64_t stride, int64_t n, int64_t head_dim, float* scores) {
  for (int64_t i = 0; i < n; ++i) scores[i] = dot(q, k + i * stride, head_dim);
}

inline float exp_shifted(float* scores, int64_t n, float shift) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += scores[i] = std::exp(scores[i] - shift);
  return total;
}
#endif

template <typename T, typename P>
void paged_attention_impl(const T* qkv, const T* cos, const T* sin, P* k_pool, P* v_pool, T* out,
                          const int32_t* block_tables, const int32_t* query_start,
                          const int32_t* context_lens, const int32_t* token_seq,
                          const PagedShape& shape, float scale, const float* kv_scales) {
  constexpr bool quantized = !std::is_same_v<P, T>;
  const int64_t row = shape.kv_heads * shape.head_dim;  // one token's keys in a block
  const int64_t block_stride = shape.block_size * row;
  const int64_t head_dim = shape.head_dim, bs = shape.block_size;
  auto position_of = [&](int64_t token) {
    const int32_t s = token_seq[token];
    return static_cast<int64_t>(context_lens[s]) + (token - query_start[s]);
  };
  auto slot_of = [&](int64_t seq, int64_t position) {
    return block_tables[seq * shape.max_blocks + position / bs] * block_stride + (position % bs) * row;
  };

  const int64_t qkv_row = (shape.heads + 2 * shape.kv_heads) * head_dim;
  const int64_t q_size = shape.heads * head_dim;
  std::vector<float> inv_scales(quantized ? 2 * row : 0);  // 1 / k_scale, then 1 / v_scale
  for (size_t i = 0; i < inv_scales.size(); ++i) inv_scales[i] = 1.f / kv_scales[i];
  at::parallel_for(0, shape.tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t position = position_of(t);
      const int64_t slot = slot_of(token_seq[t], position);
      const T* k = qkv + t * qkv_row + q_size;
      for (int64_t g = 0; g < shape.kv_heads; ++g) {
        rope_into(rotated.data(), k + g * head_dim, cos + position * head_dim, sin + position * head_dim,
                  head_dim);
        if (shape.key_hadamard) hadamard_inplace(rotated.data(), head_dim, shape.key_hadamard);
        if constexpr (quantized)
          store_scaled(k_pool + slot + g * head_dim, rotated.data(), inv_scales.data() + g * head_dim, head_dim);
        else
          for (int64_t d = 0; d < head_dim; ++d) store_as(k_pool + slot + g * head_dim + d, rotated[d]);
      }
      if constexpr (quantized) {
        store_scaled(v_pool + slot, k + row, inv_scales.data() + row, row);
      } else {
        std::memcpy(v_pool + slot, k + row, sizeof(T) * row);
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
      at::parallel_for(0, shape.seqs, 1, [&](int64_t begin, int64_t end) {
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

  const int64_t group = shape.heads / shape.kv_heads;
  at::parallel_for(0, shape.tokens * shape.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(head_dim), acc(head_dim), scores(bs);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / shape.heads, h = item % shape.heads, g = h / group;
      const int64_t s = token_seq[t];
      const int32_t* table = block_tables + s * shape.max_blocks;
      const int64_t position = position_of(t);
      rope_into(qf.data(), qkv + t * qkv_row + h * head_dim, cos + position * head_dim,
                sin + position * head_dim, head_dim);
      if (shape.key_hadamard) hadamard_inplace(qf.data(), head_dim, shape.key_hadamard);
      for (int64_t d = 0; d < head_dim; ++d) qf[d] *= scale;
      if constexpr (quantized)
        for (int64_t d = 0; d < head_dim; ++d) qf[d] *= kv_scales[g * head_dim + d];
      std::fill(acc.begin(), acc.end(), 0.f);
      float running_max = -std::numeric_limits<float>::infinity(), denom = 0.f;
      const int64_t context = position + 1;
      // keys / values: the block storage; block_at(b): the storage block holding block b
      auto attend = [&](const auto* keys, const auto* values, auto block_at) {
        for (int64_t first = 0, b = 0; first < context; first += bs, ++b) {
          const int64_t n = std::min(bs, context - first);
          const int64_t at = block_at(b) * block_stride + g * head_dim;
          block_scores(qf.data(), keys + at, row, n, head_dim, scores.data());
          const float block_max = *std::max_element(scores.begin(), scores.begin() + n);
          if (block_max > running_max) {
            const float correction = std::exp(running_max - block_max);
            denom *= correction;
            scale_inplace(acc.data(), correction, head_dim);
            running_max = block_max;
          }
          denom += exp_shifted(scores.data(), n, running_max);
          block_pv(acc.data(), scores.data(), values + at, row, n, head_dim);
        }
      };
      if (widened.empty() || widened[s].empty()) {
        attend(k_pool, v_pool, [table](int64_t b) { return static_cast<int64_t>(table[b]); });
      } else {
        const std::vector<bf16>& copy = widened[s];
        attend(copy.data(), copy.data() + copy.size() / 2, [](int64_t b) { return b; });
      }
      T* orow = out + (t * shape.heads + h) * head_dim;
      const float inv = 1.f / denom;
      if constexpr (quantized) {
        const float* v_scale = kv_scales + row + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) store_as(orow + d, acc[d] * inv * v_scale[d]);
      } else {
        for (int64_t d = 0; d < head_dim; ++d) store_as(orow + d, acc[d] * inv);
      }
    }
  });
}
