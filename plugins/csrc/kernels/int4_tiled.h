// int4 weights in the tiled layout (formats.h, TiledLayout: made at load by pack_int4_tiled),
// float / bf16 activations (W4A16). Included per ISA inside kiln::<isa> after gemv.h.
//
//   linear_w4_tiled_ref         float inputs, one group at a time (scalar, AVX2)
//   linear_w4_tiled_avx512      inputs as two 15-bit int8 planes, one vpdpbusd multiplies 16
//                               rows by four inputs (tiles_w4t, shared with W4A8 in w4a8.h)
//   dequantize_int4_tiled_avx512 / _rows  the weights back to [out, in] in the model dtype
//                               (prefill's GEMM)

// The reference path (scalar / AVX2): float inputs, one group at a time, as linear_w4_float
template <typename T>
void linear_w4_tiled_ref(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                         int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  std::vector<float> xf(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) xf[i] = to_f32(x[i]);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
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
                                         int64_t k, int64_t group, __m512* acc) {
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

// int4 rows: xs_row, each row's scale applied to its outputs (W4A16; W4A8's scales are per
// group, inside the tiles)
template <bool A8, typename T>
void tiled_w4_rows(const int8_t* hi, const int8_t* lo, const int32_t* xsum8, const float* xs_group,
                   const float* xs_row, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                   int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  tiled_gemv(L, bias, out, rows, n,
             [&](auto R, auto V, int64_t t0, int64_t U, int64_t u0, int64_t m0, __m512* acc) {
               tiles_w4t<decltype(R)::value, decltype(V)::value, A8>(
                   A8 ? nullptr : hi + m0 * k, lo + m0 * k, xsum8 + m0 * L.groups,
                   A8 ? xs_group + m0 * L.groups : nullptr, w + t0 * L.kb * 64, s + t0 * L.groups * kTileRows, L, U,
                   u0, k, group, acc);
             },
             [&](int64_t m, int64_t, __m512 acc, float* sums) {
               _mm512_storeu_ps(sums, _mm512_mul_ps(acc, _mm512_set1_ps(A8 ? 1.f : xs_row[m])));
             });
}

template <typename T>
void linear_w4_tiled_avx512(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                            int64_t rows, int64_t k, int64_t n) {
  const int64_t groups = (k + group - 1) / group;
  std::vector<int8_t> hi(rows * k), lo(rows * k);
  std::vector<float> xs(rows);
  std::vector<int32_t> hsum(rows * groups), xsum8(rows * groups);
  split_rows_i8(x, rows, k, k, group, hi.data(), lo.data(), xs.data(), hsum.data(), xsum8.data());
  for (int64_t i = 0; i < rows * groups; ++i) xsum8[i] = 8 * (256 * hsum[i] + xsum8[i]);  // the nibbles' + 8
  tiled_w4_rows<false>(hi.data(), lo.data(), xsum8.data(), nullptr, xs.data(), w, s, group, bias, out, rows, k, n);
}
// The tiled weights back to rows, in the order they are stored (one stream in, 16 rows out per
// tile), straight into the model dtype: prefill's one pass over the weights before its GEMM.
// int4: a vector's low and high nibbles interleaved by dwords give each row's 8 values in order.
template <typename T>
void dequantize_int4_tiled_avx512(const uint8_t* w, const float* s, int64_t group, T* out, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  at::parallel_for(0, (L.tiles + kTileGroup - 1) / kTileGroup, 1, [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
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

