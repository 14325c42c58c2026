// bf16 linears on the tiled bf16 layout (formats.h, made at load on the avx512bf16 and avx512amx
// levels): out = x @ w^T (+ bias) for bf16 x and w.
//
//   linear_bf16_tiled_amx  AMX-BF16: tdpbf16ps at every row count, one row included
//   linear_bf16_tiled_dp   AVX512-BF16 without AMX: vdpbf16ps at every row count
//   linear_bf16_tiled_ref  plain loops in float32, in input order (every other level; tests)
//
// A row's sums come from the tiles alone: one tdpbf16ps adds 32 inputs' products to each of 16 rows
// x 16 outputs, and each row's sums depend only on that row and the weights. How the tile unit adds
// the 32 products is its own (it is neither vdpbf16ps' order nor float32 in input order: in a
// scratch program, not kept, 60-220 of 256 sums differed from each), so no vector kernel could
// reproduce it for the row counts below a tile. Every row count therefore takes the tiles, one row
// padded to 16 with zero rows: a decode row streams the weights from memory 1.09-1.28x as fast as
// the row layout's AVX512-BF16 kernel (dense.h; 0.82-1.08x with them in cache; gemv_isa.py, one
// thread, docs/benchmarks.md), and a row's bits are the same alone, among 63 others, or in a
// prefill.
// Included per ISA inside kiln::<isa> after amx.h.

// out rows [m0, m0 + count) for outputs [o0, o0 + 16) from a C tile's sums c [16][16], + bias
inline void bf16_tile_out(const float* c, const bf16* bias, bf16* out, int64_t m0, int64_t count, int64_t n,
                          int64_t o0) {
  for (int64_t r = 0; r < count; ++r)
    store_row16(out + (m0 + r) * n + o0, c + r * kTileRows, bias ? bias + o0 : nullptr);
}

#if defined(KILN_ISA_AMX)
constexpr int64_t kBf16AmxK = 32;  // inputs one tdpbf16ps multiplies: 16 pairs, 64 bytes a row

// G (1 or 2) output groups from wg (group g at wg + g * 16k) against R (1 or 2) chunks of 16
// rows from a (chunk r at a + r * 16k): C tile 2r + g; c [R * 2 + G][16 x 16]. ahead: prefetch
// the weights' lines g_prefetch_ahead bytes on (the first chunks of rows; later ones find them
// in cache).
template <int G, int R>
inline void amx_bf16_block(const bf16* a, const bf16* wg, int64_t k, bool ahead, float (*c)[kTileRows * kTileRows]) {
  const int64_t stride = k * static_cast<int64_t>(sizeof(bf16));
  _tile_zero(0);
  if constexpr (G == 2) _tile_zero(1);
  if constexpr (R == 2) _tile_zero(2);
  if constexpr (R == 2 && G == 2) _tile_zero(3);
  for (int64_t i = 0; i < k; i += kBf16AmxK) {
    const bf16* b0 = wg + i * kTileRows;  // the 1 KB B tile of inputs [i, i + 32)
    if (ahead && g_prefetch_ahead > 0)
      for (int g = 0; g < G; ++g)
        prefetch_bytes(reinterpret_cast<const char*>(b0 + g * kTileRows * k) + g_prefetch_ahead, 1024);
    _tile_loadd(4, a + i, stride);
    if constexpr (R == 2) _tile_loadd(5, a + kTileRows * k + i, stride);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (R == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (G == 2) {
      _tile_loadd(7, b0 + kTileRows * k, 64);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (R == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  if constexpr (G == 2) _tile_stored(1, c[1], 64);
  if constexpr (R == 2) _tile_stored(2, c[2], 64);
  if constexpr (R == 2 && G == 2) _tile_stored(3, c[3], 64);
}

// Threads split the output groups two at a time; each share runs every chunk of rows against its
// groups, two chunks at a time (four C tiles: each B tile loaded serves two chunks, each A tile
// two groups). In: k a multiple of 32, n of 16 (bf16_tiles_fit).
inline void linear_bf16_tiled_amx(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t rows, int64_t k,
                                  int64_t n) {
  const int64_t chunks = (rows + kTileRows - 1) / kTileRows, padded = chunks * kTileRows;
  const int64_t groups = n / kTileRows, pairs = (groups + 1) / 2;
  std::vector<bf16> x_padded;
  const bf16* a = amx_pad_rows(x, rows, padded, k, x_padded);
  parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    amx_configure(8);  // C 0-3; A 4, 5; B 6, 7
    alignas(64) float c[4][kTileRows * kTileRows];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t g0 = 2 * p, G = std::min<int64_t>(2, groups - g0);
      const bf16* wg = w + g0 * kTileRows * k;
      for (int64_t ch = 0; ch < chunks; ch += 2) {
        const bf16* ac = a + ch * kTileRows * k;
        const bool two = ch + 1 < chunks, ahead = ch == 0;
        if (G == 2 && two) amx_bf16_block<2, 2>(ac, wg, k, ahead, c);
        else if (G == 2) amx_bf16_block<2, 1>(ac, wg, k, ahead, c);
        else if (two) amx_bf16_block<1, 2>(ac, wg, k, ahead, c);
        else amx_bf16_block<1, 1>(ac, wg, k, ahead, c);
        for (int64_t r = 0; r < (two ? 2 : 1); ++r) {
          const int64_t m0 = (ch + r) * kTileRows, count = std::min(kTileRows, rows - m0);
          for (int64_t g = 0; g < G; ++g)
            bf16_tile_out(c[2 * r + g], bias, out, m0, count, n, (g0 + g) * kTileRows);
        }
      }
    }
    _tile_release();
  });
}
#endif

#if defined(KILN_ISA_AVX512BF16)
// AVX512-BF16 without AMX (Zen 4): vdpbf16ps on the same layout. A B tile's row of 64 bytes is
// one input pair for 16 outputs, so one vdpbf16ps adds a row's pair (broadcast) times 16 outputs'
// pairs into 16 sums, and each weight vector loaded serves every row of a block. Each output is
// summed in two chains (the even pairs of inputs and the odd ones, added at the end) whatever the
// block, the row count or the thread, so a row's bits are the same alone, among 63 others, or in
// a prefill. One row takes one group at a time: one stream from memory (two or four groups'
// streams side by side read memory 0.69-1.05x as fast on the Zen 4 host;
// docs/benchmarks-history.md).
constexpr int kBf16DpRows = 6, kBf16DpGroups = 2;  // a block: 24 accumulators, 4 weight vectors

// R rows from x (stride k) against G groups of 16 outputs from wg (group g at wg + g * 16k):
// sums[g * R + r]. ahead: prefetch the weights' lines g_prefetch_ahead bytes on (the first rows;
// later ones find them in cache).
template <int R, int G>
inline void bf16_dp_block(const bf16* x, int64_t k, const bf16* wg, bool ahead, __m512* sums) {
  __m512 even[R * G], odd[R * G];
  for (int i = 0; i < R * G; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  const int64_t group = kTileRows * k;
  for (int64_t p = 0; p < k; p += 4) {  // inputs p, p + 1 to the even chain, p + 2, p + 3 to the odd
    __m512bh w0[G], w1[G];
    for (int g = 0; g < G; ++g) {
      const bf16* wp = wg + g * group + p * kTileRows;
      if (ahead && g_prefetch_ahead > 0) prefetch_bytes(reinterpret_cast<const char*>(wp) + g_prefetch_ahead, 128);
      w0[g] = load_bf16x32(wp);
      w1[g] = load_bf16x32(wp + 2 * kTileRows);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pairs[2];
      std::memcpy(pairs, x + r * k + p, sizeof(pairs));
      const __m512bh x0 = (__m512bh)_mm512_set1_epi32(pairs[0]), x1 = (__m512bh)_mm512_set1_epi32(pairs[1]);
      for (int g = 0; g < G; ++g) {
        even[g * R + r] = _mm512_dpbf16_ps(even[g * R + r], x0, w0[g]);
        odd[g * R + r] = _mm512_dpbf16_ps(odd[g * R + r], x1, w1[g]);
      }
    }
  }
  for (int i = 0; i < R * G; ++i) sums[i] = _mm512_add_ps(even[i], odd[i]);
}

// bf16_dp_block for a block of `rows` (1..kBf16DpRows) and `groups` (1..kBf16DpGroups)
inline void bf16_dp_any(int64_t rows, int64_t groups, const bf16* x, int64_t k, const bf16* wg, bool ahead,
                        __m512* sums) {
  static_assert(kBf16DpRows == 6 && kBf16DpGroups == 2, "the switch below covers 1..6 rows, 1..2 groups");
  auto run = [&](auto R) {
    if (groups == 2) bf16_dp_block<decltype(R)::value, 2>(x, k, wg, ahead, sums);
    else bf16_dp_block<decltype(R)::value, 1>(x, k, wg, ahead, sums);
  };
  switch (rows) {
    case 6: run(std::integral_constant<int, 6>{}); break;
    case 5: run(std::integral_constant<int, 5>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    default: run(std::integral_constant<int, 1>{});
  }
}

// Threads split the groups of 16 outputs; each share takes kBf16DpGroups groups at a time (one
// row: one) against every row, kBf16DpRows rows a block (the groups' weights stay in L1 / L2 for
// the later rows). In: k a multiple of 32, n of 16 (bf16_tiles_fit).
inline void linear_bf16_tiled_dp(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t rows, int64_t k,
                                 int64_t n) {
  const int64_t step = rows == 1 ? 1 : kBf16DpGroups;
  parallel_for(0, n / kTileRows, 1, [&](int64_t begin, int64_t end) {
    __m512 sums[kBf16DpRows * kBf16DpGroups];
    for (int64_t g0 = begin; g0 < end; g0 += step) {
      const int64_t G = std::min<int64_t>(step, end - g0);
      for (int64_t m0 = 0; m0 < rows; m0 += kBf16DpRows) {
        const int64_t R = std::min<int64_t>(kBf16DpRows, rows - m0);
        bf16_dp_any(R, G, x + m0 * k, k, w + g0 * kTileRows * k, m0 == 0, sums);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t o0 = (g0 + g) * kTileRows;
          const __m512 b16 = bias16_of(bias, o0);
          for (int64_t r = 0; r < R; ++r) store_row16(out + (m0 + r) * n + o0, sums[g * R + r], b16);
        }
      }
    }
  });
}
#endif

// The reference: each (row, output) summed in float32 in input order, as formats.h lays w out
inline void linear_bf16_tiled_ref(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t rows, int64_t k,
                                  int64_t n) {
  parallel_for(0, n / kTileRows, 1, [&](int64_t begin, int64_t end) {
    float c[kTileRows * kTileRows];
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m0 = 0; m0 < rows; m0 += kTileRows) {
        const int64_t count = std::min(kTileRows, rows - m0);
        for (int64_t r = 0; r < count; ++r)
          for (int64_t j = 0; j < kTileRows; ++j) {
            float s = 0.f;
            for (int64_t i = 0; i < k; ++i)
              s += to_f32(x[(m0 + r) * k + i]) * to_f32(w[tiled_bf16_index(g * kTileRows + j, i, k)]);
            c[r * kTileRows + j] = s;
          }
        bf16_tile_out(c, bias, out, m0, count, n, g * kTileRows);
      }
  });
}
