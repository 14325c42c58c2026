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
// Included per ISA inside kiln::<isa> after vec.h.

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

template <typename T>
void paged_attention_impl(const T* qkv, const T* cos, const T* sin, T* k_pool, T* v_pool, T* out,
                          const int32_t* block_tables, const int32_t* query_start,
                          const int32_t* context_lens, const int32_t* token_seq,
                          const PagedShape& shape, float scale) {
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
  at::parallel_for(0, shape.tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t position = position_of(t);
      const int64_t slot = slot_of(token_seq[t], position);
      const T* k = qkv + t * qkv_row + q_size;
      for (int64_t g = 0; g < shape.kv_heads; ++g) {
        rope_into(rotated.data(), k + g * head_dim, cos + position * head_dim, sin + position * head_dim,
                  head_dim);
        for (int64_t d = 0; d < head_dim; ++d) store_as(k_pool + slot + g * head_dim + d, rotated[d]);
      }
      std::memcpy(v_pool + slot, k + row, sizeof(T) * row);
    }
  });

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
      for (int64_t d = 0; d < head_dim; ++d) qf[d] *= scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      float running_max = -std::numeric_limits<float>::infinity(), denom = 0.f;
      const int64_t context = position + 1;
      for (int64_t first = 0, b = 0; first < context; first += bs, ++b) {
        const int64_t n = std::min(bs, context - first);
        const T* kblock = k_pool + table[b] * block_stride + g * head_dim;
        const T* vblock = v_pool + table[b] * block_stride + g * head_dim;
        float block_max = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) {
          scores[i] = dot(qf.data(), kblock + i * row, head_dim);
          block_max = std::max(block_max, scores[i]);
        }
        if (block_max > running_max) {
          const float correction = std::exp(running_max - block_max);
          denom *= correction;
          scale_inplace(acc.data(), correction, head_dim);
          running_max = block_max;
        }
        for (int64_t i = 0; i < n; ++i) {
          const float p = std::exp(scores[i] - running_max);
          denom += p;
          axpy(acc.data(), p, vblock + i * row, head_dim);
        }
      }
      T* orow = out + (t * shape.heads + h) * head_dim;
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < head_dim; ++d) store_as(orow + d, acc[d] * inv);
    }
  });
}

void paged_attention_f32(const float* qkv, const float* cos, const float* sin, float* kp, float* vp,
                         float* out, const int32_t* bt, const int32_t* qs, const int32_t* cl,
                         const int32_t* ts, const PagedShape& shape, float scale) {
  paged_attention_impl<float>(qkv, cos, sin, kp, vp, out, bt, qs, cl, ts, shape, scale);
}
void paged_attention_bf16(const bf16* qkv, const bf16* cos, const bf16* sin, bf16* kp, bf16* vp,
                          bf16* out, const int32_t* bt, const int32_t* qs, const int32_t* cl,
                          const int32_t* ts, const PagedShape& shape, float scale) {
  paged_attention_impl<bf16>(qkv, cos, sin, kp, vp, out, bt, qs, cl, ts, shape, scale);
}
