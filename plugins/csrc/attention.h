// Causal grouped-query attention over one sequence's contiguous KV cache, with the KV write
// fused in: the new tokens' k/v are stored at rows [start, start + tokens) of the cache, then
// each new token attends to cache rows [0, start + its index].
// One pass over the cache per (token, head) with an online softmax in fp32, keys visited in
// tiles so the running maximum is rescaled once per tile rather than once per key.
// Included per ISA inside kiln::<isa> after vec.h.

constexpr int64_t kScoreTile = 64;

template <typename T>
void attention_impl(const T* q, const T* k, const T* v, T* k_cache, T* v_cache, T* out,
                    int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    int64_t start, float scale) {
  const int64_t row = kv_heads * head_dim;
  std::memcpy(k_cache + start * row, k, sizeof(T) * tokens * row);
  std::memcpy(v_cache + start * row, v, sizeof(T) * tokens * row);
  const int64_t group = heads / kv_heads;

  at::parallel_for(0, tokens * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(head_dim), acc(head_dim), scores(kScoreTile);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads, g = h / group;
      const T* qrow = q + (t * heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) qf[d] = to_f32(qrow[d]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      float running_max = -std::numeric_limits<float>::infinity(), denom = 0.f;
      const int64_t context = start + t + 1;
      for (int64_t tile = 0; tile < context; tile += kScoreTile) {
        const int64_t n = std::min(kScoreTile, context - tile);
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < n; ++s) {
          scores[s] = dot(qf.data(), k_cache + (tile + s) * row + g * head_dim, head_dim);
          tile_max = std::max(tile_max, scores[s]);
        }
        if (tile_max > running_max) {
          const float correction = std::exp(running_max - tile_max);
          denom *= correction;
          scale_inplace(acc.data(), correction, head_dim);
          running_max = tile_max;
        }
        for (int64_t s = 0; s < n; ++s) {
          const float p = std::exp(scores[s] - running_max);
          denom += p;
          axpy(acc.data(), p, v_cache + (tile + s) * row + g * head_dim, head_dim);
        }
      }
      T* orow = out + (t * heads + h) * head_dim;
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < head_dim; ++d) store_as(orow + d, acc[d] * inv);
    }
  });
}

void attention_f32(const float* q, const float* k, const float* v, float* kc, float* vc,
                   float* out, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                   int64_t start, float scale) {
  attention_impl<float>(q, k, v, kc, vc, out, tokens, heads, kv_heads, head_dim, start, scale);
}
void attention_bf16(const bf16* q, const bf16* k, const bf16* v, bf16* kc, bf16* vc, bf16* out,
                    int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    int64_t start, float scale) {
  attention_impl<bf16>(q, k, v, kc, vc, out, tokens, heads, kv_heads, head_dim, start, scale);
}
