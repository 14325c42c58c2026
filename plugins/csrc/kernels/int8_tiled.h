// int8 weights in the tiled layout (formats.h: blocks of 4 inputs, 16 rows x 4 bytes per vector,
// stored + 128; made at load by pack_int8_tiled), one scale per output channel, float / bf16
// activations (W8A16). Included per ISA inside kiln::<isa> after gemv.h.
//
//   linear_w8_tiled_ref          plain loops (the layout is used on AVX-512 hosts only: select.h)
//   linear_w8_tiled_avx512       the input's two 15-bit planes each meet a vector with one
//                                vpdpbusd (64 multiply-adds); the + 128 comes off once per row as
//                                128 * sum(q); int32 sums go to float every kTiled8Flush blocks;
//                                with AMX from kAmxRowsFrom rows, tiled_w8_amx: tdpbsud, the
//                                layout's vectors a B tile as they lie
//   dequantize_int8_tiled_avx512 / _ref   the weights back to [out, in] (prefill)

constexpr int64_t kTiled8Flush = 1024;  // blocks of 4 inputs: 4,096 inputs

template <typename T>
void linear_w8_tiled_ref(const T* x, const uint8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                         int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t m = 0; m < rows; ++m) {
        float acc = 0.f;
        for (int64_t i = 0; i < k; ++i) acc += to_f32(x[m * k + i]) * static_cast<float>(tiled_int8_at(w, L, o, i));
        store_as(out + m * n + o, acc * scale[o] + (bias ? to_f32(bias[o]) : 0.f));
      }
  });
}

#if defined(KILN_ISA_AVX512)
// vpdpbusd for any u8 (without VNNI exactly: the bytes split into nibbles, as vpmaddubsw's int16
// pairs would saturate on 255 * 128 * 2)
inline __m512i dpbusd_u8(__m512i acc, __m512i u, __m512i s) {
#if defined(KILN_ISA_VNNI)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i low = dpbusd(_mm512_setzero_si512(), _mm512_and_si512(u, nib), s);
  const __m512i high = dpbusd(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(u, 4), nib), s);
  return _mm512_add_epi32(acc, _mm512_add_epi32(low, _mm512_slli_epi32(high, 4)));
#endif
}

// V tiles x R input rows (two planes each, row stride k) of the int8 tiling; acc[v * R + r] =
// the integer dot products (weights still + 128) as float
template <int R, int V>
__attribute__((noinline)) void tiles_w8t(const int8_t* hi, const int8_t* lo, const uint8_t* w, const TiledLayout& L,
                                         int64_t U, int64_t u0, int64_t k, __m512* acc) {
  constexpr int C = V * R;
  static_assert(C <= 4, "at most four (tile, row) pairs");
  __m512 fh[C], fl[C];
  for (int c = 0; c < C; ++c) fh[c] = fl[c] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < L.kb; b0 += kTiled8Flush) {
    const int64_t b1 = std::min(L.kb, b0 + kTiled8Flush);
    __m512i h[C], l[C];
    for (int c = 0; c < C; ++c) h[c] = l[c] = _mm512_setzero_si512();
    for (int64_t b = b0; b < b1; ++b) {
      tiles_ahead(w, b, U, u0, V);
      __m512i xh[R], xl[R];
      for (int r = 0; r < R; ++r) xh[r] = broadcast4(hi + r * k + 4 * b), xl[r] = broadcast4(lo + r * k + 4 * b);
      for (int v = 0; v < V; ++v) {
        const __m512i wv = _mm512_loadu_si512(w + (b * U + u0 + v) * 64);
        for (int r = 0; r < R; ++r) {
          h[v * R + r] = dpbusd_u8(h[v * R + r], wv, xh[r]);
          l[v * R + r] = dpbusd_u8(l[v * R + r], wv, xl[r]);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      fh[c] = _mm512_add_ps(fh[c], _mm512_cvtepi32_ps(h[c]));
      fl[c] = _mm512_add_ps(fl[c], _mm512_cvtepi32_ps(l[c]));
    }
  }
  for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(fh[c], _mm512_set1_ps(256.f), fl[c]);
}

#if defined(KILN_ISA_AMX)
// W8A16 at many rows with AMX tiles: the tiled layout's vectors of one tile, 16 blocks of 4
// inputs apart by the tile group's width, are a B tile as they lie (tileloadd with that
// stride: 16 outputs x 64 inputs, unsigned, + 128 as stored). Each plane's 16 rows x 64 inputs
// (A, signed) meet it in one tdpbsud, two tiles of outputs at a time where the tile group has
// them (four independent sums: one tdpbsud's latency is several of its issue intervals); the
// int32 sums of a flush chunk (kTiled8Flush blocks) are tiles_w8t's exact integers and go to
// float in its order, then the row's offset, scale and the output scale as there: each row gets
// the bits it gets alone. Rows go 16 at a time (the last chunk padded with zero rows); inputs a
// multiple of 64.

// P (1 or 2) tiles from t's vectors wt (block b at wt + b * stride) against 16 rows of planes
// hc, lc: C tiles 0 (hi) and 1 (lo) for the first tile, 2 and 3 for the second; fh / fl [P][16];
// ahead: prefetch the weights (the first chunk of rows)
template <int P>
inline void amx_w8_tiles(const int8_t* hc, const int8_t* lc, const uint8_t* wt, int64_t stride, const TiledLayout& L,
                         int64_t k, bool ahead, __m512* fh, __m512* fl) {
  alignas(64) int32_t C[2 * P][kTileRows * kTileRows];  // [tile, plane][row][output]
  for (int i = 0; i < P * kTileRows; ++i) fh[i] = fl[i] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < L.kb; b0 += kTiled8Flush) {
    const int64_t b1 = std::min(L.kb, b0 + kTiled8Flush);
    _tile_zero(0);
    _tile_zero(1);
    if (P == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t b = b0; b < b1; b += kAmxK / 4) {
      if (ahead)  // the lines of the B tiles g_prefetch_ahead bytes on, as the GEMVs (gemv.h, tiles_ahead)
        for (int64_t j = 0; j < kAmxK / 4; ++j) tiles_ahead(wt, b + j, stride / 64, 0, P);
      _tile_loadd(4, hc + 4 * b, k);
      _tile_loadd(5, lc + 4 * b, k);
      _tile_loadd(6, wt + b * stride, stride);
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 5, 6);
      if (P == 2) {
        _tile_loadd(7, wt + 64 + b * stride, stride);
        _tile_dpbsud(2, 4, 7);
        _tile_dpbsud(3, 5, 7);
      }
    }
    _tile_stored(0, C[0], 64);
    _tile_stored(1, C[1], 64);
    if (P == 2) {
      _tile_stored(2, C[2], 64);
      _tile_stored(3, C[3], 64);
    }
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < kTileRows; ++r) {
        __m512& h = fh[p * kTileRows + r];
        __m512& l = fl[p * kTileRows + r];
        h = _mm512_add_ps(h, _mm512_cvtepi32_ps(_mm512_load_si512(C[2 * p] + r * kTileRows)));
        l = _mm512_add_ps(l, _mm512_cvtepi32_ps(_mm512_load_si512(C[2 * p + 1] + r * kTileRows)));
      }
  }
}

template <typename T>
void tiled_w8_amx(const int8_t* hi, const int8_t* lo, const float* xs, const float* offset, const uint8_t* w,
                  const float* scale, const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  const int64_t chunks = (rows + kTileRows - 1) / kTileRows, padded = chunks * kTileRows;
  std::vector<int8_t> hi_padded, lo_padded;
  hi = amx_pad_rows(hi, rows, padded, k, hi_padded);
  lo = amx_pad_rows(lo, rows, padded, k, lo_padded);
  parallel_for(0, L.tiles, 1, [&](int64_t begin, int64_t end) {
    amx_configure(8);  // C 0-3; A 4 (hi), 5 (lo); B 6, 7
    __m512 fh[2 * kTileRows], fl[2 * kTileRows];
    for (int64_t t = begin; t < end;) {
      const int64_t t0 = t / kTileGroup * kTileGroup, U = L.width(t0), u = t - t0;
      const int64_t P = (t + 1 < end && u + 1 < U) ? 2 : 1;  // tiles t and t + 1 of one group
      const uint8_t* wt = w + (t0 * L.kb + u) * 64;          // block b at wt + b * U * 64
      for (int64_t c = 0; c < chunks; ++c) {
        const int8_t *hc = hi + c * kTileRows * k, *lc = lo + c * kTileRows * k;
        if (P == 2) amx_w8_tiles<2>(hc, lc, wt, U * 64, L, k, c == 0, fh, fl);  // later chunks: in cache
        else amx_w8_tiles<1>(hc, lc, wt, U * 64, L, k, c == 0, fh, fl);
        // the sums to outputs from registers and locals (as tiled_w8a8_amx)
        const float* const row_offsets = offset + c * kTileRows;
        const float* const row_scales = xs + c * kTileRows;
        T* const out_rows = out + c * kTileRows * n;
        const int64_t chunk_rows = std::min<int64_t>(kTileRows, rows - c * kTileRows);
        for (int64_t p = 0; p < P; ++p) {
          const int64_t o0 = (t + p) * kTileRows;
          const __m512 s16 = _mm512_loadu_ps(scale + o0), b16 = bias16_of(bias, o0);
          for (int64_t r = 0; r < chunk_rows; ++r) {
            const __m512 acc = _mm512_fmadd_ps(fh[p * kTileRows + r], _mm512_set1_ps(256.f), fl[p * kTileRows + r]);
            const __m512 centred = _mm512_sub_ps(acc, _mm512_set1_ps(row_offsets[r]));
            const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(centred, _mm512_set1_ps(row_scales[r])), s16);
            store_row16(out_rows + r * n + o0, scaled, b16);
          }
        }
      }
      t += P;
    }
    _tile_release();
  });
}
#endif

template <typename T>
void linear_w8_tiled_avx512(const T* x, const uint8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                            int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  std::vector<int8_t> hi(rows * k), lo(rows * k);
  std::vector<float> xs(rows), offset(rows);
  std::vector<int32_t> hsum(rows), lsum(rows);
  split_rows_i8(x, rows, k, k, k, hi.data(), lo.data(), xs.data(), hsum.data(), lsum.data());
  for (int64_t m = 0; m < rows; ++m)  // 128 * sum(q): the weights' + 128
    offset[m] = 128.f * (256.f * static_cast<float>(hsum[m]) + static_cast<float>(lsum[m]));
#if defined(KILN_ISA_AMX)
  if (rows >= kAmxRowsFrom && k % kAmxK == 0)
    return tiled_w8_amx(hi.data(), lo.data(), xs.data(), offset.data(), w, scale, bias, out, rows, k, n);
#endif
  tiled_gemv(L, bias, out, rows, n,
             [&](auto R, auto V, int64_t t0, int64_t U, int64_t u0, int64_t m0, __m512* acc) {
               tiles_w8t<decltype(R)::value, decltype(V)::value>(hi.data() + m0 * k, lo.data() + m0 * k,
                                                                 w + t0 * L.kb * 64, L, U, u0, k, acc);
             },
             [&](int64_t m, int64_t o0, __m512 acc, float* sums) {
               const __m512 centred = _mm512_sub_ps(acc, _mm512_set1_ps(offset[m]));
               _mm512_storeu_ps(sums, _mm512_mul_ps(_mm512_mul_ps(centred, _mm512_set1_ps(xs[m])),
                                                    _mm512_loadu_ps(scale + o0)));
             });
}
#endif

#if defined(KILN_ISA_AVX512)
// int8: a vector's 16 bytes q hold rows 4q .. 4q + 3, four inputs each
template <typename T>
void dequantize_int8_tiled_avx512(const uint8_t* w, const float* scale, T* out, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  parallel_for(0, (L.tiles + kTileGroup - 1) / kTileGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tg = begin; tg < end; ++tg) {
      const int64_t t0 = tg * kTileGroup, U = L.width(t0);
      for (int64_t u = 0; u < U; ++u) {
        T* rows = out + (t0 + u) * kTileRows * k;
        const __m512 s16 = _mm512_loadu_ps(scale + (t0 + u) * kTileRows);
        __m512 sq[4];
        for (int q = 0; q < 4; ++q)
          sq[q] = _mm512_permutexvar_ps(_mm512_set_epi32(4 * q + 3, 4 * q + 3, 4 * q + 3, 4 * q + 3, 4 * q + 2,
                                                         4 * q + 2, 4 * q + 2, 4 * q + 2, 4 * q + 1, 4 * q + 1,
                                                         4 * q + 1, 4 * q + 1, 4 * q, 4 * q, 4 * q, 4 * q), s16);
        for (int64_t b = 0; b < L.kb; ++b) {
          const uint8_t* p = w + (t0 * L.kb + b * U + u) * 64;
          for (int q = 0; q < 4; ++q) {
            const __m512i v = _mm512_sub_epi32(
                _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q))),
                _mm512_set1_epi32(128));
            store_rows4(rows + 4 * q * k + 4 * b, k, _mm512_mul_ps(_mm512_cvtepi32_ps(v), sq[q]));
          }
        }
      }
    }
  });
}
#endif

// The tiled int8 weights back to rows of T, one value at a time
template <typename T>
void dequantize_int8_tiled_ref(const uint8_t* w, const float* scale, T* out, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      T* orow = out + o * k;
      const float s = scale[o];
      for (int64_t i = 0; i < k; ++i) store_as(orow + i, static_cast<float>(tiled_int8_at(w, L, o, i)) * s);
    }
  });
}
