// Paged attention on AMX tiles (the avx512amx level), for pools in the model dtype bf16.
// attention.h's paged_attention_impl takes this route for every token of a call whose shape fits
// (amx_attention_fits), so decode steps and prefill chunks compute each token the same way.
//
// Work items are (tile, KV head, chunk): a tile is up to 16 / group consecutive tokens of one
// sequence (a decode token is a tile of its own), its rows the group's query heads of each token.
// For each block of the chunk:
//   - scores: one tdpbf16ps per 32 dims multiplies 16 keys (the A tile, loaded as the pool lays
//     them out) by the tile's queries (B, made once per item): C = S^T, a key a row, a query row
//     a lane; then scaled;
//   - softmax: down the rows, each lane a query row on its own: the block's max, the correction
//     of the sums so far, exp, and the sum of the weights key by key in order, in fp32;
//   - values: the weights rounded to bf16 (as Hugging Face's eager attention rounds its softmax
//     to the model dtype before multiplying the values) as A tiles, the values interleaved in
//     pairs of keys as B tiles, 32 keys a tdpbf16ps; the block's sums are added to the row's.
// A decode step reads each block from memory: its values are staged while the scores' tiles run,
// and the next block's lines are asked for a key at a time while the weights are made.
//
// A query row's arithmetic does not depend on the other rows of its tile: the tiles compute
// each row's dot products on their own; keys past a row's position get weight 0 (values past a
// block's last key are zeros), and blocks past its context leave its max and sums unchanged.
// Chunks are runs of 128 positions' blocks from position 0 (longer past 2,048 positions: at most
// 16 chunks), fixed by the token's own context, and a tile holds only tokens with the same chunk
// length, so a token's result is the same bits in any tile, in any batch and on any number of
// threads (tests/plugins/test_attention.py).
//
// The queries come in unscaled (bf16 values exactly: rotary embedding rounds to bf16) and the
// scale multiplies the scores, so the tiles add no rounding of the queries.
//
//   amx_attention_fits   whether a call's shape takes this route
//   amx_attend_items     the items of a call, on the library's threads
//
// Included by attention.h inside kiln::<isa> (after amx.h); empty below the avx512amx level.

#if defined(KILN_ISA_AMX)
constexpr int64_t kAmxAttnRows = 16;  // query rows a tile holds (C's lanes)

inline bool amx_attention_fits(const PagedShape& s) {
  const int64_t group = s.heads / s.kv_heads;
  return s.key_hadamard == 0 && s.window == 0 && s.head_dim % 32 == 0 && s.head_dim <= 128 &&
         s.block_size % kAmxAttnRows == 0 && group <= kAmxAttnRows;
}

// C = 16 keys (rows of `head_dim` bf16 at keys) x the query tiles 0 .. STEPS - 1, stored as 16
// rows of 16 floats at c; with TWO, the next 16 keys too (C tiles 5 and 7, A tiles 4 and 6: the
// two chains' loads and products overlap). The steps are written out: the tile intrinsics paste
// their tile numbers into the instruction, so each must be a literal.
template <int STEPS, bool TWO>
inline void amx_key_scores(const bf16* keys, int64_t head_dim, float* c) {
  const int64_t stride = head_dim * static_cast<int64_t>(sizeof(bf16));
  const bf16* next = keys + kAmxAttnRows * head_dim;
  _tile_zero(5);
  if constexpr (TWO) _tile_zero(7);
  _tile_loadd(4, keys, stride);
  if constexpr (TWO) _tile_loadd(6, next, stride);
  _tile_dpbf16ps(5, 4, 0);
  if constexpr (TWO) _tile_dpbf16ps(7, 6, 0);
  if constexpr (STEPS > 1) {
    _tile_loadd(4, keys + 32, stride);
    if constexpr (TWO) _tile_loadd(6, next + 32, stride);
    _tile_dpbf16ps(5, 4, 1);
    if constexpr (TWO) _tile_dpbf16ps(7, 6, 1);
  }
  if constexpr (STEPS > 2) {
    _tile_loadd(4, keys + 64, stride);
    if constexpr (TWO) _tile_loadd(6, next + 64, stride);
    _tile_dpbf16ps(5, 4, 2);
    if constexpr (TWO) _tile_dpbf16ps(7, 6, 2);
  }
  if constexpr (STEPS > 3) {
    _tile_loadd(4, keys + 96, stride);
    if constexpr (TWO) _tile_loadd(6, next + 96, stride);
    _tile_dpbf16ps(5, 4, 3);
    if constexpr (TWO) _tile_dpbf16ps(7, 6, 3);
  }
  _tile_stored(5, c, 64);
  if constexpr (TWO) _tile_stored(7, c + kAmxAttnRows * kAmxAttnRows, 64);
}

template <bool TWO>
inline void amx_key_scores(int64_t steps, const bf16* keys, int64_t head_dim, float* c) {
  switch (steps) {
    case 1: return amx_key_scores<1, TWO>(keys, head_dim, c);
    case 2: return amx_key_scores<2, TWO>(keys, head_dim, c);
    case 3: return amx_key_scores<3, TWO>(keys, head_dim, c);
    default: return amx_key_scores<4, TWO>(keys, head_dim, c);
  }
}

// The weights times the values on tiles, 32 keys a step: A (tile 4) = P, 16 query rows x 32
// keys in bf16 pairs; B = 16 pairs of keys x 16 dims of V; C (tiles 0 .. D - 1) = 16 query rows x
// 16 dims, D dim tiles from dt0 (of `tiles` a step in vb), stored to out[d][16 x 16]
template <int D>
inline void amx_weights_values(int64_t ksteps, const bf16* pa, const bf16* vb, int64_t tiles, int64_t dt0,
                               float* out) {
  _tile_zero(0);
  if constexpr (D > 1) _tile_zero(1);
  if constexpr (D > 2) _tile_zero(2);
  if constexpr (D > 3) _tile_zero(3);
  for (int64_t ks = 0; ks < ksteps; ++ks) {
    const bf16* b = vb + (ks * tiles + dt0) * 512;
    _tile_loadd(4, pa + ks * 512, 64);
    _tile_loadd(5, b, 64);
    if constexpr (D > 1) _tile_loadd(6, b + 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (D > 2) _tile_loadd(7, b + 1024, 64);
    if constexpr (D > 1) _tile_dpbf16ps(1, 4, 6);
    if constexpr (D > 3) _tile_loadd(5, b + 1536, 64);
    if constexpr (D > 2) _tile_dpbf16ps(2, 4, 7);
    if constexpr (D > 3) _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, 64);
  if constexpr (D > 1) _tile_stored(1, out + 256, 64);
  if constexpr (D > 2) _tile_stored(2, out + 512, 64);
  if constexpr (D > 3) _tile_stored(3, out + 768, 64);
}

inline void amx_weights_values(int64_t d, int64_t ksteps, const bf16* pa, const bf16* vb, int64_t tiles, int64_t dt0,
                               float* out) {
  switch (d) {
    case 1: return amx_weights_values<1>(ksteps, pa, vb, tiles, dt0, out);
    case 2: return amx_weights_values<2>(ksteps, pa, vb, tiles, dt0, out);
    case 3: return amx_weights_values<3>(ksteps, pa, vb, tiles, dt0, out);
    default: return amx_weights_values<4>(ksteps, pa, vb, tiles, dt0, out);
  }
}

// A block's values [n keys x head_dim] as B tiles: step ks, dim tile dt at vb + (ks * tiles + dt)
// * 512, row kp = keys 32 ks + 2 kp and + 1 interleaved dim by dim; keys from n on are zeros
inline void amx_value_tiles(const bf16* v, int64_t n, int64_t head_dim, bf16* vb) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t tiles = head_dim / 16, ksteps = (n + 31) / 32;
  for (int64_t ks = 0; ks < ksteps; ++ks)
    for (int64_t kp = 0; kp < 16; ++kp) {
      const int64_t k0 = ks * 32 + 2 * kp;
      for (int64_t q = 0; q < head_dim / 32; ++q) {  // 32 dims: two dim tiles
        const __m512i a = k0 < n ? _mm512_loadu_si512(v + k0 * head_dim + 32 * q) : _mm512_setzero_si512();
        const __m512i b = k0 + 1 < n ? _mm512_loadu_si512(v + (k0 + 1) * head_dim + 32 * q) : _mm512_setzero_si512();
        _mm512_store_si512(vb + (ks * tiles + 2 * q) * 512 + kp * 32, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_store_si512(vb + (ks * tiles + 2 * q + 1) * 512 + kp * 32, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
}

// What a call's items read and write (attention.h makes the queries, the chunking and the
// partials' layout; the merge of a token's chunks stays there)
struct AmxAttentionCall {
  const bf16* queries;  // [tokens, heads, head_dim] rotated, unscaled (bf16 exactly)
  const bf16* k_pool;
  const bf16* v_pool;
  bf16* out;
  const int32_t* block_tables;
  const int32_t* token_seq;
  const int32_t* query_start;
  const int64_t* positions;   // each token's position
  const int64_t* chunks;      // each token's chunk count
  const int64_t* per_chunk;   // blocks a chunk, per token
  const int64_t* first_part;  // where each token's partials start (chunks > 1)
  float* parts;               // partials: running max, denominator, head_dim sums
  float scale;
};

inline void amx_attend_items(const AmxAttentionCall& call, const PagedShape& shape) {
  const int64_t heads = shape.heads, group = heads / shape.kv_heads, head_dim = shape.head_dim;
  const int64_t bs = shape.block_size, steps = head_dim / 32, tokens = shape.tokens;
  const int64_t row = shape.kv_heads * head_dim, block_stride = bs * row, head_run = bs * head_dim;
  const int64_t part_size = head_dim + 2;
  // tiles: consecutive tokens of one sequence with the same chunk length, up to 16 / group
  const int64_t per_tile = kAmxAttnRows / group;
  std::vector<int64_t> tile_first, first_item{0};
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t start = tile_first.empty() ? -1 : tile_first.back();
    if (start < 0 || call.token_seq[t] != call.token_seq[start] || call.per_chunk[t] != call.per_chunk[start] ||
        t - start == per_tile)
      tile_first.push_back(t);
  }
  tile_first.push_back(tokens);
  const int64_t tiles = static_cast<int64_t>(tile_first.size()) - 1;
  for (int64_t i = 0; i < tiles; ++i)
    first_item.push_back(first_item.back() + shape.kv_heads * call.chunks[tile_first[i + 1] - 1]);
  const int64_t items = first_item.back(), shares = std::min<int64_t>(items, thread_count());

  struct alignas(64) Counter {
    std::atomic<int64_t> value{0};
  } next_item;
  parallel_for(0, shares, 1, [&](int64_t, int64_t) {  // a call runs items until none is left
    amx_configure(8);                                 // Q 0-3, A 4 and 6, C 5 and 7
    // one allocation a share, not zeroed (each item writes what it reads): the query tiles, a
    // block's S^T as the tiles store it (a key a row, a query row a lane: scores, then weights),
    // the accumulators, the weights' A tiles (a step of 32 keys each), the values' B tiles, C's
    // sums, and a last run of fewer than 16 keys with zero rows after it
    const int64_t dim_tiles = head_dim / 16, max_ksteps = (bs + 31) / 32;
    const int64_t sizes[] = {4 * 512 * 2, bs * kAmxAttnRows * 4, kAmxAttnRows * head_dim * 4, max_ksteps * 512 * 2,
                             max_ksteps * dim_tiles * 512 * 2, 4 * 256 * 4, kAmxAttnRows * head_dim * 2};
    int64_t total = 64;
    for (int64_t bytes : sizes) total += (bytes + 63) / 64 * 64;
    const std::unique_ptr<char[]> storage(new char[total]);
    char* next_buffer = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(storage.get()) + 63) & ~uintptr_t{63});
    auto carve = [&](int64_t bytes) {
      char* p = next_buffer;
      next_buffer += (bytes + 63) / 64 * 64;
      return p;
    };
    bf16* qt = reinterpret_cast<bf16*>(carve(sizes[0]));
    float* scores = reinterpret_cast<float*>(carve(sizes[1]));
    float* acc = reinterpret_cast<float*>(carve(sizes[2]));
    bf16* pa = reinterpret_cast<bf16*>(carve(sizes[3]));
    bf16* vb = reinterpret_cast<bf16*>(carve(sizes[4]));
    float* block_sums = reinterpret_cast<float*>(carve(sizes[5]));
    bf16* staged = reinterpret_cast<bf16*>(carve(sizes[6]));
    alignas(64) int32_t context[kAmxAttnRows];
    const __m512i key_rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(kAmxAttnRows));
    for (int64_t item = next_item.value.fetch_add(1, std::memory_order_relaxed); item < items;
         item = next_item.value.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t tile = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t t0 = tile_first[tile], m = tile_first[tile + 1] - t0, rows = m * group;
      const int64_t last_chunks = call.chunks[t0 + m - 1];
      const int64_t g = (item - first_item[tile]) / last_chunks, c = (item - first_item[tile]) % last_chunks;
      const int64_t s = call.token_seq[t0];
      const int32_t* table = call.block_tables + s * shape.max_blocks;
      for (int64_t r = 0; r < kAmxAttnRows; ++r)
        context[r] = r < rows ? static_cast<int32_t>(call.positions[t0 + r / group] + 1) : 0;
      const int64_t last_context = context[rows - 1], blocks = (last_context + bs - 1) / bs;
      const int64_t b_first = c * call.per_chunk[t0], b_last = std::min(blocks, b_first + call.per_chunk[t0]);
      // the queries as B tiles: step st holds dims [32 st, 32 st + 32), row kp the pair of dims
      // 2 kp, 2 kp + 1 (one dword) of every query row
      uint32_t* qt32 = reinterpret_cast<uint32_t*>(qt);
      std::fill(qt32, qt32 + steps * 256, 0u);
      for (int64_t r = 0; r < rows; ++r) {
        const uint32_t* q = reinterpret_cast<const uint32_t*>(
            call.queries + ((t0 + r / group) * heads + g * group + r % group) * head_dim);
        for (int64_t pair = 0; pair < head_dim / 2; ++pair) qt32[pair * kAmxAttnRows + r] = q[pair];
      }
      std::fill(pa, pa + max_ksteps * 512, bf16(0.f));  // the rows past the tile's stay 0
      auto load_queries = [&] {  // tiles 0 .. steps - 1; again after each block (the values' sums take them)
        _tile_loadd(0, qt, 64);
        if (steps > 1) _tile_loadd(1, qt + 512, 64);
        if (steps > 2) _tile_loadd(2, qt + 1024, 64);
        if (steps > 3) _tile_loadd(3, qt + 1536, 64);
      };
      load_queries();
      std::fill(acc, acc + rows * head_dim, 0.f);
      const __m512i context_v = _mm512_load_si512(context);
      const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      const __m512 scale_v = _mm512_set1_ps(call.scale);
      __m512 running_max = minus_inf, denom = _mm512_setzero_ps();
      const bool fetch = m == 1 && call.query_start[s + 1] - call.query_start[s] == 1;
      const int64_t group_run = g * head_run;
      if (fetch)
        prefetch_run(call.k_pool, call.v_pool, table[b_first] * block_stride + group_run,
                     std::min(bs, last_context - b_first * bs), head_dim);
      for (int64_t b = b_first; b < b_last; ++b) {
        // the next block's keys and values asked for a key at a time while this block's weights
        // are made (measured faster than asking for a whole block's lines at once)
        const bool next = fetch && b + 1 < b_last;
        const int64_t next_at = next ? table[b + 1] * block_stride + group_run : 0;
        const int64_t base = b * bs, n = std::min(bs, last_context - base);  // keys any row has here
        const __m512i valid_v = _mm512_min_epi32(
            _mm512_max_epi32(_mm512_sub_epi32(context_v, _mm512_set1_epi32(static_cast<int32_t>(base))),
                             _mm512_setzero_si512()),
            _mm512_set1_epi32(static_cast<int32_t>(bs)));
        const int64_t at = table[b] * block_stride + group_run;
        // 16 keys a tile; a last run of fewer goes from a copy with zero rows after it (the
        // slots past a block's last key are not read)
        const int64_t whole = n / kAmxAttnRows * kAmxAttnRows;
        int64_t i0 = 0;
        for (; i0 + 2 * kAmxAttnRows <= whole; i0 += 2 * kAmxAttnRows)
          amx_key_scores<true>(steps, call.k_pool + at + i0 * head_dim, head_dim, scores + i0 * kAmxAttnRows);
        if (i0 < whole) {
          amx_key_scores<false>(steps, call.k_pool + at + i0 * head_dim, head_dim, scores + i0 * kAmxAttnRows);
          i0 += kAmxAttnRows;
        }
        if (i0 < n) {
          std::copy(call.k_pool + at + i0 * head_dim, call.k_pool + at + n * head_dim, staged);
          std::fill(staged + (n - i0) * head_dim, staged + kAmxAttnRows * head_dim, bf16(0.f));
          amx_key_scores<false>(steps, staged, head_dim, scores + i0 * kAmxAttnRows);
        }
        amx_value_tiles(call.v_pool + at, n, head_dim, vb);  // its loads overlap the scores' work
        // scores scaled, keys past each row's position masked; the block's max per row
        __m512 block_max = minus_inf;
        for (int64_t i = 0; i < n; ++i) {
          const __mmask16 valid = _mm512_cmpgt_epi32_mask(valid_v, _mm512_set1_epi32(static_cast<int32_t>(i)));
          const __m512 si = _mm512_mask_mul_ps(minus_inf, valid, _mm512_load_ps(scores + i * kAmxAttnRows), scale_v);
          _mm512_store_ps(scores + i * kAmxAttnRows, si);
          block_max = _mm512_max_ps(block_max, si);
        }
        // where a row's max rose, its sums so far scaled down (elsewhere by 1: no change)
        const __mmask16 raise = _mm512_cmp_ps_mask(block_max, running_max, _CMP_GT_OQ);
        if (raise) {
          const __m512 correction = _mm512_mask_blend_ps(raise, _mm512_set1_ps(1.f),
                                                         exp16(_mm512_sub_ps(running_max, block_max)));
          denom = _mm512_mul_ps(denom, correction);
          running_max = _mm512_mask_blend_ps(raise, running_max, block_max);
          alignas(64) float factor[kAmxAttnRows];
          _mm512_store_ps(factor, correction);
          for (int64_t r = 0; r < rows; ++r)
            if ((raise >> r) & 1) scale_inplace(acc + r * head_dim, factor[r], head_dim);
        }
        __m512 total = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; ++i) {  // p = exp(s - max), 0 where masked; summed key by key
          const __mmask16 valid = _mm512_cmpgt_epi32_mask(valid_v, _mm512_set1_epi32(static_cast<int32_t>(i)));
          const __m512 p = _mm512_maskz_mov_ps(
              valid, exp16(_mm512_sub_ps(_mm512_load_ps(scores + i * kAmxAttnRows), running_max)));
          _mm512_store_ps(scores + i * kAmxAttnRows, p);
          total = _mm512_add_ps(total, p);
          if (next)
            for (int64_t byte = 0; byte < head_dim * 2; byte += 64) {
              prefetch_line(reinterpret_cast<const char*>(call.k_pool + next_at + i * head_dim) + byte);
              prefetch_line(reinterpret_cast<const char*>(call.v_pool + next_at + i * head_dim) + byte);
            }
        }
        denom = _mm512_add_ps(denom, total);
        // the weights in bf16 as A tiles (row r: its weights for 32 keys, keys from n on 0), the
        // values as B tiles; the block's sums are added to each row's (already corrected above)
        const int64_t ksteps = (n + 31) / 32;
        for (int64_t ks = 0; ks < ksteps; ++ks) {
          const int64_t k0 = ks * 32;
          const __mmask16 first = k0 + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - k0)) - 1);
          const __mmask16 second =
              k0 + 32 <= n ? 0xFFFF : k0 + 16 >= n ? 0 : static_cast<__mmask16>((1u << (n - k0 - 16)) - 1);
          for (int64_t r = 0; r < rows; ++r) {
            const float* column = scores + k0 * kAmxAttnRows + r;
            const __m512 w0 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), first, key_rows, column, 4);
            const __m512 w1 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), second, key_rows,
                                                       column + 16 * kAmxAttnRows, 4);
            _mm512_store_si512(pa + ks * 512 + r * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
          }
        }
        for (int64_t dt0 = 0; dt0 < dim_tiles; dt0 += 4) {
          const int64_t d = std::min<int64_t>(4, dim_tiles - dt0);
          amx_weights_values(d, ksteps, pa, vb, dim_tiles, dt0, block_sums);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < d; ++j) {
              float* a = acc + r * head_dim + (dt0 + j) * 16;
              _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_load_ps(block_sums + j * 256 + r * 16)));
            }
        }
        load_queries();
      }
      alignas(64) float maxes[kAmxAttnRows], sums[kAmxAttnRows];
      _mm512_store_ps(maxes, running_max);
      _mm512_store_ps(sums, denom);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / group, h = g * group + r % group;
        if (call.chunks[t] <= c) continue;  // this token's context ends before the chunk
        const float* a = acc + r * head_dim;
        if (call.chunks[t] == 1) {
          const float inv = 1.f / sums[r];
          bf16* o = call.out + (t * heads + h) * head_dim;
          store_times_as(o, a, inv, head_dim);
        } else {
          store_partial(call.parts + (call.first_part[t] + h * call.chunks[t] + c) * part_size, maxes[r], sums[r], a,
                        head_dim);
        }
      }
    }
    _tile_release();
  });
}
#endif
