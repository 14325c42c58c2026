// int4 weights in the tiled layout (formats.h, TiledLayout: made at load by pack_int4_tiled),
// float / bf16 activations (W4A16). Included per ISA inside kiln::<isa> after gemv.h.
//
//   linear_w4_tiled_ref         float inputs, one group at a time (the scalar reference)
//   linear_w4_tiled_dp          inputs as two 15-bit int8 planes against the nibbles in integer
//                               dot products (tiles_w4t, shared with W4A8 in w4a8.h): on AVX-512
//                               one vpdpbusd multiplies 16 rows by four inputs; on AVX2 two
//                               vpmaddubsw multiply 8 rows by four inputs into int16 pairs
//                               (with AVX-VNNI, one 256-bit vpdpbusd); from 15 rows on plain
//                               AVX2, tiled_w4_lanes: the rows in the lanes, one vpmaddwd
//                               multiplies 8 rows by two inputs (lanes.h, lane_rows); with AMX
//                               from kAmxRowsFrom rows, tiled_w4_amx: tdpbssd, 16 rows by 64
//                               inputs by 16 outputs (shared with W4A8)
//   dequantize_int4_tiled_avx512 / _rows  the weights back to [out, in] in the model dtype
//                               (prefill's GEMM)

// The reference path: float inputs, one group at a time, as linear_w4_float
template <typename T>
void linear_w4_tiled_ref(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                         int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  std::vector<float> xf(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) xf[i] = to_f32(x[i]);
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t m = 0; m < rows; ++m) {
        float total = 0.f;
        for (int64_t g = 0; g < L.groups; ++g) {
          float acc = 0.f;
          for (int64_t i = g * group; i < std::min(k, (g + 1) * group); ++i)
            acc += xf[m * k + i] * static_cast<float>(tiled_nibble(w, L, o, i) - 8);
          total += acc * s[L.scale(o, g)];
        }
        store_as(out + m * n + o, total + (bias ? to_f32(bias[o]) : 0.f));
      }
  });
}

#if defined(KILN_ISA_AVX512)
// V tiles (u0.. of a tile group of width U; w and s at the group's start) x R input rows (row
// stride k); acc[v * R + r] = sum over groups of (the group's centred integer dot product) *
// scale. W4A16 (A8 false): two int8 planes per row (hi, lo), one vpdpbusd chain per plane, tile
// and row. W4A8 (A8 true): one int8 plane `lo` quantized per group, whose scales xs [R, groups]
// multiply the weight scales. (noinline: inlined into its callers the accumulators spilled.)
template <int R, int V, bool A8>
__attribute__((noinline)) void tiles_w4t(const int8_t* hi, const int8_t* lo, const int32_t* xsum8, const float* xs,
                                         const uint8_t* w, const float* s, const TiledLayout& L, int64_t U, int64_t u0,
                                         int64_t k, int64_t group, f32x16* acc) {
  constexpr int C = V * R;  // (tile, row) pairs, c = v * R + r; one-dimensional so they stay in registers
  static_assert(C <= 4, "at most four (tile, row) pairs: 3 * C accumulators");
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t kb = L.kb, groups = L.groups;
  __m512 facc[C];
  for (int c = 0; c < C; ++c) facc[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t b0 = g * group / 8, b1 = std::min(kb, (g + 1) * group / 8);
    __m512i h[C], l[C];
    for (int c = 0; c < C; ++c) h[c] = l[c] = _mm512_setzero_si512();
    for (int64_t b = b0; b < b1; ++b) {
      tiles_ahead(w, b, U, u0, V);
      __m512i xh0[R], xh1[R], xl0[R], xl1[R];
      for (int r = 0; r < R; ++r) {
        if (!A8) xh0[r] = broadcast4(hi + r * k + 8 * b), xh1[r] = broadcast4(hi + r * k + 8 * b + 4);
        xl0[r] = broadcast4(lo + r * k + 8 * b), xl1[r] = broadcast4(lo + r * k + 8 * b + 4);
      }
      for (int v = 0; v < V; ++v) {
        const __m512i wv = _mm512_loadu_si512(w + (b * U + u0 + v) * 64);
        const __m512i first = _mm512_and_si512(wv, nib), second = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);
        for (int r = 0; r < R; ++r) {
          const int c = v * R + r;
          if (!A8) h[c] = dpbusd(dpbusd(h[c], first, xh0[r]), second, xh1[r]);
          l[c] = dpbusd(dpbusd(l[c], first, xl0[r]), second, xl1[r]);
        }
      }
    }
    for (int v = 0; v < V; ++v) {
      const __m512 vs = _mm512_loadu_ps(s + (g * U + u0 + v) * kTileRows);
      for (int r = 0; r < R; ++r) {
        const int c = v * R + r;
        const __m512i sum = A8 ? l[c] : _mm512_add_epi32(_mm512_slli_epi32(h[c], 8), l[c]);
        const __m512i centred = _mm512_sub_epi32(sum, _mm512_set1_epi32(xsum8[r * groups + g]));
        const __m512 scales = A8 ? _mm512_mul_ps(vs, _mm512_set1_ps(xs[r * groups + g])) : vs;
        facc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), scales, facc[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) acc[c] = facc[c];
}

#endif

#if defined(KILN_ISA_AVX2)
// AVX2: a tile's 64-byte vector as two halves of 8 rows. vpmaddubsw multiplies the nibbles
// (unsigned) by the input bytes into int16 pairs (at most 2 * 15 * 128 each: no saturation),
// vpmaddwd sums the pairs into int32 lanes, the high plane's by 256; with AVX-VNNI one vpdpbusd
// per input vector does the same (the same integers: the two paths agree bit for bit). int32
// sums go to float at each group's end (no overflow: under 1.99e6 a block of 8 inputs, and a
// group is at most kTiledMaxGroup = 1,024 blocks).

// The tiles of a tile group for one row (decode) in one pass over their interleaved weights
// (measured: 1.6x faster SmolLM2 int4 decode than two passes of two tiles, whose half-used
// cache lines stall on memory), or two (tile, row) pairs for several rows (2 * 2 int32
// accumulators, the inputs in registers)
template <int R, int V, bool A8>
__attribute__((noinline)) void tiles_w4t_pairs(const int8_t* hi, const int8_t* lo, const int32_t* xsum8,
                                               const float* xs, const uint8_t* w, const float* s, const TiledLayout& L,
                                               int64_t U, int64_t u0, int64_t k, int64_t group, f32x16* acc) {
  constexpr int C = V * R;
  static_assert(C <= 2 || R == 1, "at most two (tile, row) pairs, or four tiles of one row");
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), c256 = _mm256_set1_epi16(256);
  const int64_t kb = L.kb, groups = L.groups;
  __m256 facc[C][2];
  for (int c = 0; c < C; ++c) facc[c][0] = facc[c][1] = _mm256_setzero_ps();
  auto bytes4 = [](const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  };
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t b0 = g * group / 8, b1 = std::min(kb, (g + 1) * group / 8);
    __m256i a[C][2];
    for (int c = 0; c < C; ++c) a[c][0] = a[c][1] = _mm256_setzero_si256();
    for (int64_t b = b0; b < b1; ++b) {
      tiles_ahead(w, b, U, u0, V);
      __m256i xh0[R], xh1[R], xl0[R], xl1[R];
      for (int r = 0; r < R; ++r) {
        if (!A8) xh0[r] = bytes4(hi + r * k + 8 * b), xh1[r] = bytes4(hi + r * k + 8 * b + 4);
        xl0[r] = bytes4(lo + r * k + 8 * b), xl1[r] = bytes4(lo + r * k + 8 * b + 4);
      }
      for (int v = 0; v < V; ++v)
        for (int half = 0; half < 2; ++half) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * U + u0 + v) * 64 + 32 * half));
          const __m256i first = _mm256_and_si256(wv, nib);
          const __m256i second = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib);
          for (int r = 0; r < R; ++r) {
#if defined(KILN_ISA_AVXVNNI)
            // the same integer sums, four multiply-adds per lane in one vpdpbusd
            __m256i sum = a[v * R + r][half];
            if (!A8) {
              const __m256i h = _mm256_dpbusd_avx_epi32(
                  _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), first, xh0[r]), second, xh1[r]);
              sum = _mm256_add_epi32(sum, _mm256_slli_epi32(h, 8));
            }
            a[v * R + r][half] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(sum, first, xl0[r]), second, xl1[r]);
#else
            const __m256i l16 = _mm256_add_epi16(_mm256_maddubs_epi16(first, xl0[r]), _mm256_maddubs_epi16(second, xl1[r]));
            __m256i sum = _mm256_madd_epi16(l16, ones);
            if (!A8) {
              const __m256i h16 =
                  _mm256_add_epi16(_mm256_maddubs_epi16(first, xh0[r]), _mm256_maddubs_epi16(second, xh1[r]));
              sum = _mm256_add_epi32(sum, _mm256_madd_epi16(h16, c256));
            }
            a[v * R + r][half] = _mm256_add_epi32(a[v * R + r][half], sum);
#endif
          }
        }
    }
    for (int v = 0; v < V; ++v)
      for (int r = 0; r < R; ++r)
        for (int half = 0; half < 2; ++half) {
          const int c = v * R + r;
          const __m256 vs = _mm256_loadu_ps(s + (g * U + u0 + v) * kTileRows + 8 * half);
          const __m256i centred = _mm256_sub_epi32(a[c][half], _mm256_set1_epi32(xsum8[r * groups + g]));
          const __m256 scales = A8 ? _mm256_mul_ps(vs, _mm256_set1_ps(xs[r * groups + g])) : vs;
          facc[c][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), scales, facc[c][half]);
        }
  }
  for (int c = 0; c < C; ++c) acc[c] = {facc[c][0], facc[c][1]};
}

// V tiles x R rows as tiles_w4t on AVX-512 (at most four pairs): one row in one pass, several
// rows two at a time
template <int R, int V, bool A8>
void tiles_w4t(const int8_t* hi, const int8_t* lo, const int32_t* xsum8, const float* xs, const uint8_t* w,
               const float* s, const TiledLayout& L, int64_t U, int64_t u0, int64_t k, int64_t group, f32x16* acc) {
  if constexpr (V * R <= 2 || R == 1) {
    tiles_w4t_pairs<R, V, A8>(hi, lo, xsum8, xs, w, s, L, U, u0, k, group, acc);
  } else {  // one tile, three or four rows: two rows at a time
    static_assert(V == 1, "several tiles for one row only");
    tiles_w4t_pairs<2, 1, A8>(hi, lo, xsum8, xs, w, s, L, U, u0, k, group, acc);
    tiles_w4t_pairs<R - 2, 1, A8>(A8 ? hi : hi + 2 * k, lo + 2 * k, xsum8 + 2 * L.groups,
                                  A8 ? xs + 2 * L.groups : xs, w, s, L, U, u0, k, group, acc + 2);
  }
}

// W4A16 at many rows on AVX2: the input rows in the vector lanes. Each input is one 15-bit
// int16 (256 * hi + lo: the integer the two planes make) and each weight a signed int16 (nibble
// - 8), so one vpmaddwd multiplies 8 rows by a pair of one output's weights: 16 multiply-adds a
// multiplying instruction, where tiles_w4t_pairs spends six (four vpmaddubsw, two vpmaddwd) on 64.
// A tile's weights are widened once per call and serve every row; the rows go 16 at a time (two
// vectors), 4 outputs of the tile at a time in 8 accumulators (lanes.h). The int32 sums per group are the
// same integers (no overflow: 8 * 16,383 * kTiledMaxGroup < 2^31), turned to float and scaled in
// the same order, so every output has the bits tiles_w4t_pairs gives it (the tests compare the
// rows together with each row alone). Plain AVX2 only: AVX-VNNI's path (vpdpbusd) is not
// measured against it. docs/benchmarks.md: 1.13-1.27x tiles_w4t_pairs at 16-128 rows, one thread.

// A block of 8 inputs as 4 pairs in the order a tile vector's nibbles widen to (lanes_weights):
// inputs (0, 2), (4, 6), (1, 3), (5, 7)
constexpr int kLanePairFirst[4] = {0, 4, 1, 5}, kLanePairSecond[4] = {2, 6, 3, 7};

// The planes' rows as int16 rows q [rows][k] (256 * hi + lo), each block of 8 inputs stored as
// the pairs (0, 2), (4, 6), (1, 3), (5, 7): the order a tile vector's nibbles widen to
// (lanes_weights), for lanes_inputs_i16
inline void lanes_rows_from_planes(const int8_t* hi, const int8_t* lo, int64_t rows, int64_t k, int16_t* q) {
  for (int64_t m = 0; m < rows; ++m) {
    const int8_t *h = hi + m * k, *l = lo + m * k;
    int16_t* qm = q + m * k;
    for (int64_t b = 0; b < k / 8; ++b)
      for (int p = 0; p < 4; ++p) {
        const int64_t i = 8 * b + kLanePairFirst[p], j = 8 * b + kLanePairSecond[p];
        qm[8 * b + 2 * p] = static_cast<int16_t>(256 * h[i] + l[i]);
        qm[8 * b + 2 * p + 1] = static_cast<int16_t>(256 * h[j] + l[j]);
      }
  }
}

// Tile u0 of the tile group at w (U tiles wide) widened: Wt [k / 2 pairs][16 outputs] dwords of two
// signed int16 weights, the pairs as lanes_inputs orders the inputs. A row's 4 bytes of a block
// hold inputs 0-3 in their low nibbles and 4-7 in their high ones, so as two int16 the nibbles at
// bit 0 of each are inputs (0, 2), at bit 4 (4, 6), at bit 8 (1, 3), at bit 12 (5, 7).
inline void lanes_weights(const uint8_t* w, int64_t kb, int64_t U, int64_t u0, int32_t* Wt) {
  const __m256i nib = _mm256_set1_epi16(0x0F), eight = _mm256_set1_epi16(8);
  for (int64_t b = 0; b < kb; ++b)
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * U + u0) * 64 + 32 * half));
      const __m256i pairs[4] = {v, _mm256_srli_epi16(v, 4), _mm256_srli_epi16(v, 8), _mm256_srli_epi16(v, 12)};
      for (int p = 0; p < 4; ++p)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(Wt + (4 * b + p) * kTileRows + 8 * half),
                            _mm256_sub_epi16(_mm256_and_si256(pairs[p], nib), eight));
    }
}

// facc [16 outputs][kLaneRows rows] = one tile's float sums for one chunk of rows: each group's
// int32 sums (lanes_four_outputs) times the group's scales (group g's 16 at s_tile + g U 16),
// added in group order as tiles_w4t_pairs adds them
inline void lanes_tile(const int32_t* Xc, const int32_t* Wt, const float* s_tile, const TiledLayout& L, int64_t U,
                       int64_t group, float* facc) {
  const int64_t pairs = 4 * L.kb;
  alignas(32) int32_t sums[4 * kLaneRows];
  std::fill(facc, facc + kTileRows * kLaneRows, 0.f);
  for (int64_t g = 0; g < L.groups; ++g) {
    const int64_t j0 = g * group / 2, j1 = std::min(pairs, (g + 1) * group / 2);
    const float* sg = s_tile + g * U * kTileRows;
    for (int o0 = 0; o0 < kTileRows; o0 += 4) {
      lanes_four_outputs<1, kTileRows>(Xc + j0 * kLaneRows, Wt + j0 * kTileRows + o0, j1 - j0, sums);
      for (int o = 0; o < 4; ++o)
        for (int h = 0; h < kLaneRows; h += 8) {
          float* f = facc + (o0 + o) * kLaneRows + h;
          const __m256i sum = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums + o * kLaneRows + h));
          _mm256_store_ps(f, vfma(_mm256_cvtepi32_ps(sum), vset1(sg[o0 + o]), _mm256_load_ps(f)));
        }
    }
  }
}

// out [rows, n] from the planes (split_rows_i8), xs_row each row's scale, as tiled_w4_rows<false>
template <typename T>
void tiled_w4_lanes(const int8_t* hi, const int8_t* lo, const float* xs_row, const uint8_t* w, const float* s,
                    int64_t group, const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  const int64_t pairs = k / 2, chunks = (rows + kLaneRows - 1) / kLaneRows;
  std::vector<int16_t> q(rows * k);
  const LineBuffer<int32_t> X(chunks * pairs * kLaneRows);
  lanes_rows_from_planes(hi, lo, rows, k, q.data());
  lanes_inputs_i16(q.data(), rows, k, X.data);
  parallel_for(0, L.tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> Wt(pairs * kTileRows);
    alignas(32) float facc[kTileRows * kLaneRows];  // [output][row]
    for (int64_t t = begin; t < end; ++t) {
      const int64_t t0 = t / kTileGroup * kTileGroup, U = L.width(t0), u = t - t0;
      lanes_weights(w + t0 * L.kb * 64, L.kb, U, u, Wt.data());
      for (int64_t c = 0; c < chunks; ++c) {
        lanes_tile(X.data + c * pairs * kLaneRows, Wt.data(), s + (t0 * L.groups + u) * kTileRows, L, U, group,
                   facc);
        lanes_store_tile(facc, xs_row + c * kLaneRows, bias, out + c * kLaneRows * n, rows - c * kLaneRows, n,
                         t * kTileRows);
      }
    }
  });
}
#endif

#if defined(KILN_ISA_AMX)
// int4 at many rows with AMX tiles (W4A16 and W4A8). One tdpbssd multiplies 16 input rows by 64
// inputs of 16 outputs into int32 [16 rows][16 outputs] (16,384 multiply-adds): the tile A
// holds an int8 plane of the rows' inputs, the tile B a tiled-layout tile's weights as int8
// (the nibbles - 8): B's row 2j is block j's low nibbles (4 inputs x 16 outputs, dwords as AMX
// wants them), row 2j + 1 its high nibbles, so B is the weight vectors masked, shifted and
// centred, nothing moved between lanes (amx.h). The sums are the row kernel's exact integers
// (there: the nibbles as stored, minus 8 * sum(x)): W4A8 one plane; W4A16 two, hi * 256 + lo.
// Per group they go to float in tiles_w4t's order (one fmadd a group, from zero; W4A16's row
// scale at the end), so each row gets the bits it gets alone. Rows go 16 at a time (the last
// chunk padded with zero rows), two groups in flight (one group's sums go to float while the
// next one's multiply); inputs and group_size multiples of 64. The tile state is configured and
// released per thread share.
inline bool amx_tiles_fit(int64_t k, int64_t group) { return k % kAmxK == 0 && group % kAmxK == 0; }

// B for every 64 inputs of tiles u0 .. u0 + count - 1 of the tile group at t0, in one pass over
// their interleaved vectors (as the one-row GEMV reads them, prefetched alike: gemv.h): each
// tile's kb / 8 tiles of 16 x 64 int8 at B + v * kb * 128
inline void amx_weight_tiles(const uint8_t* w, const TiledLayout& L, int64_t t0, int64_t U, int64_t u0, int64_t count,
                             int8_t* B) {
  const __m512i nib = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  const uint8_t* group_w = w + t0 * L.kb * 64;
  for (int64_t b = 0; b < L.kb; ++b) {
    tiles_ahead(group_w, b, U, u0, static_cast<int>(count));
    for (int64_t v = 0; v < count; ++v) {
      const __m512i wv = _mm512_loadu_si512(group_w + (b * U + u0 + v) * 64);
      int8_t* Bv = B + v * L.kb * 128;
      _mm512_store_si512(Bv + 2 * b * 64, _mm512_sub_epi8(_mm512_and_si512(wv, nib), eight));
      _mm512_store_si512(Bv + (2 * b + 1) * 64,
                         _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(wv, 4), nib), eight));
    }
  }
}

// One group's sums into the C tiles of a slot: plane lo's into tile cl, plane hi's (W4A16; null
// for W4A8) into ch, each B tile loaded once for both planes. The two slots use different A tiles
// for lo and B tiles, so a group's loads need not wait for the previous group's multiply to have
// read them. (GCC's tile intrinsics take tile numbers as literals: one function per slot.)
#define KILN_AMX_GROUP(slot, cl, ch, al, ah, bt)                                                             \
  inline void amx_group_##slot(const int8_t* lo, const int8_t* hi, const int8_t* B, int64_t k, int64_t i0, \
                               int64_t i1) {                                                               \
    _tile_zero(cl);                                                                                        \
    if (hi) _tile_zero(ch);                                                                                \
    for (int64_t i = i0; i < i1; i += kAmxK) {                                                             \
      _tile_loadd(bt, B + i / 4 * 64, 64);                                                                 \
      _tile_loadd(al, lo + i, k);                                                                          \
      _tile_dpbssd(cl, al, bt);                                                                            \
      if (hi) {                                                                                            \
        _tile_loadd(ah, hi + i, k);                                                                        \
        _tile_dpbssd(ch, ah, bt);                                                                          \
      }                                                                                                    \
    }                                                                                                      \
  }
KILN_AMX_GROUP(0, 0, 2, 4, 5, 6)  // slot 0: C 0 (lo), 2 (hi); A 4 (lo), 5 (hi); B 6
KILN_AMX_GROUP(1, 1, 3, 5, 4, 7)  // slot 1: C 1, 3; A 5 (lo), 4 (hi); B 7
#undef KILN_AMX_GROUP

// out [rows, n]. W4A8 (A8): the plane lo [rows, k] and its scales per row and group xs_group
// [rows, groups]. W4A16: the planes hi and lo (split_rows_i8) and each row's scale xs_row.
template <bool A8, typename T>
void tiled_w4_amx(const int8_t* hi, const int8_t* lo, const float* xs_group, const float* xs_row, const uint8_t* w,
                  const float* s, int64_t group, const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  const int64_t groups = L.groups, chunks = (rows + kTileRows - 1) / kTileRows, padded = chunks * kTileRows;
  std::vector<int8_t> hi_padded, lo_padded;
  std::vector<float> xs_by_group;
  lo = amx_pad_rows(lo, rows, padded, k, lo_padded);
  if (A8) {  // the row scales group by group ([groups][padded rows]): a chunk's 16 scales of a group in a row
    xs_by_group.assign(groups * padded, 0.f);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t g = 0; g < groups; ++g) xs_by_group[g * padded + m] = xs_group[m * groups + g];
  } else {
    hi = amx_pad_rows(hi, rows, padded, k, hi_padded);
  }
  parallel_for(0, L.tiles, 1, [&](int64_t begin, int64_t end) {
    amx_configure(8);  // C 0-3, A 4-5, B 6-7
    const LineBuffer<int8_t> Bs(kTileGroup * L.kb * 128);
    alignas(64) int32_t C[2][2][kTileRows * kTileRows];  // [slot][lo, hi][row][output]
    int64_t B_t0 = -1, B_u0 = 0;  // the tiles whose B tiles Bs holds: from u0 of the group at t0
    const uint8_t* next_w = nullptr;
    int64_t next_lines = 0, per_group = 0, issued = 0;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t t0 = t / kTileGroup * kTileGroup, U = L.width(t0), u = t - t0;
      if (t0 != B_t0) {  // this share's tiles of the group, in one pass
        B_t0 = t0, B_u0 = u;
        const int64_t count = std::min(end, t0 + U) - t;
        amx_weight_tiles(w, L, t0, U, u, count, Bs.data);
        // the next group's lines (if in this share) into L2 while these tiles' first rows
        // multiply, spread over their groups: the pass above then reads them from cache
        next_w = w + (t0 + U) * L.kb * 64;
        next_lines = (g_prefetch_ahead > 0 && t0 + U < end) ? L.width(t0 + U) * L.kb : 0;
        per_group = (next_lines + count * groups - 1) / (count * groups);
        issued = 0;
      }
      const int8_t* B = Bs.data + (u - B_u0) * L.kb * 128;
      const float* st = s + t0 * groups * kTileRows;
      for (int64_t c = 0; c < chunks; ++c) {
        const int8_t *hc = A8 ? nullptr : hi + c * kTileRows * k, *lc = lo + c * kTileRows * k;
        auto start = [&](int64_t g) {  // group g's multiplies, into the C tiles of slot g % 2
          const int64_t i0 = g * group, i1 = std::min(k, i0 + group);
          if (g % 2 == 0) amx_group_0(lc, hc, B, k, i0, i1);
          else amx_group_1(lc, hc, B, k, i0, i1);
        };
        auto finish = [&](int64_t g) {  // slot g % 2's sums to memory
          if (g % 2 == 0) {
            _tile_stored(0, C[0][0], 64);
            if (!A8) _tile_stored(2, C[0][1], 64);
          } else {
            _tile_stored(1, C[1][0], 64);
            if (!A8) _tile_stored(3, C[1][1], 64);
          }
        };
        __m512 facc[kTileRows];
        for (int r = 0; r < kTileRows; ++r) facc[r] = _mm512_setzero_ps();
        start(0);
        for (int64_t g = 0; g < groups; ++g) {  // the next group's multiplies issued before this one's
          if (g + 1 < groups) start(g + 1);      // sums are stored, so they overlap the store and its
          finish(g);                             // conversion to float
          if (c == 0)
            for (int64_t j = 0; j < per_group && issued < next_lines; ++j, ++issued)
              _mm_prefetch(reinterpret_cast<const char*>(next_w + issued * 64), _MM_HINT_T1);
          const int32_t *lsum = C[g % 2][0], *hsum = C[g % 2][1];
          const __m512 vs = _mm512_loadu_ps(st + (g * U + u) * kTileRows);
          const float* xg = A8 ? xs_by_group.data() + g * padded + c * kTileRows : nullptr;
          for (int r = 0; r < kTileRows; ++r) {  // every row, so that facc stays in registers
            __m512i sum = _mm512_load_si512(lsum + r * kTileRows);
            if (!A8) sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hsum + r * kTileRows), 8), sum);
            const __m512 scales =
                A8 ? _mm512_mul_ps(vs, _mm512_set1_ps(xg[r])) : vs;
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scales, facc[r]);
          }
        }
        // the sums to outputs from registers and locals (as tiled_w8a8_amx)
        T* const out_rows = out + c * kTileRows * n + t * kTileRows;
        const __m512 b16 = bias16_of(bias, t * kTileRows);
        const float* const row_scales = A8 ? nullptr : xs_row + c * kTileRows;
        for (int64_t r = 0; r < std::min<int64_t>(kTileRows, rows - c * kTileRows); ++r)
          store_row16(out_rows + r * n, A8 ? facc[r] : scaled16(facc[r], row_scales[r]), b16);
      }
    }
    _tile_release();
  });
}
#endif

#if !defined(KILN_ISA_SCALAR)
// int4 rows: xs_row, each row's scale applied to its outputs (W4A16; W4A8's scales are per
// group, inside the tiles)
template <bool A8, typename T>
void tiled_w4_rows(const int8_t* hi, const int8_t* lo, const int32_t* xsum8, const float* xs_group,
                   const float* xs_row, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                   int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  tiled_gemv(L, bias, out, rows, n,
             [&](auto R, auto V, int64_t t0, int64_t U, int64_t u0, int64_t m0, f32x16* acc) {
               tiles_w4t<decltype(R)::value, decltype(V)::value, A8>(
                   A8 ? nullptr : hi + m0 * k, lo + m0 * k, xsum8 + m0 * L.groups,
                   A8 ? xs_group + m0 * L.groups : nullptr, w + t0 * L.kb * 64, s + t0 * L.groups * kTileRows, L, U,
                   u0, k, group, acc);
             },
             [&](int64_t m, int64_t, f32x16 acc, float* sums) { store16(sums, A8 ? acc : scaled16(acc, xs_row[m])); });
}

template <typename T>
void linear_w4_tiled_dp(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                            int64_t rows, int64_t k, int64_t n) {
  const int64_t groups = (k + group - 1) / group;
  std::vector<int8_t> hi(rows * k), lo(rows * k);
  std::vector<float> xs(rows);
  std::vector<int32_t> hsum(rows * groups), xsum8(rows * groups);
  split_rows_i8(x, rows, k, k, group, hi.data(), lo.data(), xs.data(), hsum.data(), xsum8.data());
#if defined(KILN_ISA_AMX)
  if (rows >= kAmxRowsFrom && amx_tiles_fit(k, group))
    return tiled_w4_amx<false>(hi.data(), lo.data(), nullptr, xs.data(), w, s, group, bias, out, rows, k, n);
#endif
  int64_t m0 = 0;  // the rows from m0 on go to the row kernel
#if defined(KILN_ISA_AVX2) && !defined(KILN_ISA_AVXVNNI)
  m0 = lane_rows(rows);
  if (m0 > 0) tiled_w4_lanes(hi.data(), lo.data(), xs.data(), w, s, group, bias, out, m0, k, n);
  if (m0 == rows) return;
#endif
  for (int64_t i = m0 * groups; i < rows * groups; ++i) xsum8[i] = 8 * (256 * hsum[i] + xsum8[i]);  // the nibbles' + 8
  tiled_w4_rows<false>(hi.data() + m0 * k, lo.data() + m0 * k, xsum8.data() + m0 * groups, nullptr, xs.data() + m0, w,
                       s, group, bias, out + m0 * n, rows - m0, k, n);
}
#endif

#if defined(KILN_ISA_AVX512)
// The tiled weights back to rows, in the order they are stored (one stream in, 16 rows out per
// tile), straight into the model dtype: prefill's one pass over the weights before its GEMM.
// int4: a vector's low and high nibbles interleaved by dwords give each row's 8 values in order.
template <typename T>
void dequantize_int4_tiled_avx512(const uint8_t* w, const float* s, int64_t group, T* out, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  parallel_for(0, (L.tiles + kTileGroup - 1) / kTileGroup, 1, [&](int64_t begin, int64_t end) {
    const __m512i nib = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t tg = begin; tg < end; ++tg) {
      const int64_t t0 = tg * kTileGroup, U = L.width(t0);
      for (int64_t u = 0; u < U; ++u) {
        T* rows = out + (t0 + u) * kTileRows * k;
        for (int64_t b = 0; b < L.kb; ++b) {
          const __m512i wv = _mm512_loadu_si512(w + (t0 * L.kb + b * U + u) * 64);
          const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(wv, nib), eight);
          const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(wv, 4), nib), eight);
          const __m512i pairs[2] = {_mm512_unpacklo_epi32(lo, hi), _mm512_unpackhi_epi32(lo, hi)};
          const __m512 s16 = _mm512_loadu_ps(s + (t0 * L.groups + (8 * b / group) * U + u) * kTileRows);
          for (int h = 0; h < 2; ++h)  // pairs[h]'s 128-bit lane q: rows 4q + 2h and 4q + 2h + 1
            for (int q = 0; q < 4; ++q) {
              const int r = 4 * q + 2 * h;
              const __m512i idx = _mm512_set_epi32(r + 1, r + 1, r + 1, r + 1, r + 1, r + 1, r + 1, r + 1,
                                                   r, r, r, r, r, r, r, r);
              const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(pairs[h], q)));
              store_rows2(rows + r * k + 8 * b, k, _mm512_mul_ps(v, _mm512_permutexvar_ps(idx, s16)));
            }
        }
      }
    }
  });
}

#endif

// The same, a row at a time (AVX2: one block of 8 values per vector; scalar: one by one)
template <typename T>
void dequantize_int4_tiled_rows(const uint8_t* w, const float* s, int64_t group, T* out, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      T* orow = out + o * k;
      for (int64_t b = 0; b < L.kb; ++b) {
        const float sc = s[L.scale(o, 8 * b / group)];  // group % 8 == 0: one scale per block
#if !defined(KILN_ISA_SCALAR)
        int32_t word;
        std::memcpy(&word, w + L.byte(o, b, 0), 4);
        const __m128i v = _mm_cvtsi32_si128(word), nib = _mm_set1_epi8(0x0F);
        const __m128i q = _mm_sub_epi8(_mm_unpacklo_epi32(_mm_and_si128(v, nib), _mm_and_si128(_mm_srli_epi16(v, 4), nib)),
                                       _mm_set1_epi8(8));  // the block's 8 values in input order
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(sc));
        if constexpr (std::is_same_v<T, float>) {
          _mm256_storeu_ps(orow + 8 * b, f);
        } else {
          float buf[8];
          _mm256_storeu_ps(buf, f);
          for (int j = 0; j < 8; ++j) store_as(orow + 8 * b + j, buf[j]);
        }
#else
        for (int64_t i = 8 * b; i < 8 * b + 8; ++i)
          store_as(orow + i, static_cast<float>(tiled_nibble(w, L, o, i) - 8) * sc);
#endif
      }
    }
  });
}

