// int4 weights in the row layout the engine stores (formats.h: two per byte along `in`, + 8),
// one scale per group of `group_size` inputs, float / bf16 activations (W4A16). Included per ISA
// inside kiln::<isa> after gemv.h.
//
//   linear_w4_float       inputs widened to fp32, nibbles unpacked to floats per group
//                         (vectorized on AVX2 and AVX-512, plain loops on scalar)
//   linear_w4_i16         AVX-512, in and group_size multiples of 32: inputs quantized to int16
//                         in the order the nibbles unpack, vpdpwssd / vpmaddwd
//   dequantize_int4_rows  the weights back to [out, in] floats (prefill's GEMM)
// Decode runs on the tiled layout (int4_tiled.h) wherever the shape allows it.

#if !defined(KILN_ISA_SCALAR)
// 32 int4 (16 bytes) -> 32 / kLanes vectors of fp32 in k order
inline void unpack_int4x32(const uint8_t* p, vfloat* out) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  const __m128i even = _mm_sub_epi8(_mm_and_si128(bytes, mask), eight);
  const __m128i odd = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), eight);
  const __m128i first = _mm_unpacklo_epi8(even, odd), second = _mm_unpackhi_epi8(even, odd);
#if defined(KILN_ISA_AVX512)
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second));
#else
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8)));
#endif
}
#endif

// R input rows against one int4 weight row, group by group
template <int R>
inline void dot_rows_w4(const float* xf, int64_t k, const uint8_t* wrow, const float* srow, int64_t group,
                        float* sums) {
  const int64_t groups = (k + group - 1) / group;
  for (int r = 0; r < R; ++r) sums[r] = 0.f;
#if !defined(KILN_ISA_SCALAR)
  vfloat total[R];
  for (int r = 0; r < R; ++r) total[r] = vzero();
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
    const float s = srow[g];
    int64_t i = g0;
#if !defined(KILN_ISA_SCALAR)
    vfloat acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero();
    for (; i + 32 <= g1 && (i & 1) == 0; i += 32) {
      vfloat v[32 / kLanes];
      unpack_int4x32(wrow + i / 2, v);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 32 / kLanes; ++j) acc[r] = vfma(vload(xf + r * k + i + j * kLanes), v[j], acc[r]);
    }
    const vfloat vs = vset1(s);
    for (int r = 0; r < R; ++r) total[r] = vfma(acc[r], vs, total[r]);
#endif
    for (int r = 0; r < R; ++r) {
      float tail = 0.f;
      for (int64_t j = i; j < g1; ++j) tail += xf[r * k + j] * static_cast<float>(int4_at(wrow, j));
      sums[r] += tail * s;
    }
  }
#if !defined(KILN_ISA_SCALAR)
  for (int r = 0; r < R; ++r) sums[r] += vsum(total[r]);
#endif
}

template <typename T>
void linear_w4_float(const T* x, const uint8_t* w, const float* scale, int64_t group, const T* bias, T* out,
                    int64_t rows, int64_t k, int64_t n) {
  const int64_t row_bytes = (k + 1) / 2, groups = (k + group - 1) / group;
  gemv_float_rows({w, row_bytes}, x, bias, out, rows, k, n, [&](auto R, const float* xr, int64_t o, float* sums) {
    dot_rows_w4<decltype(R)::value>(xr, k, w + o * row_bytes, scale + o * groups, group, sums);
  });
}

template <typename T>
void dequantize_int4_rows(const uint8_t* w, const float* scale, int64_t group, T* out, int64_t k, int64_t n) {
  const int64_t row_bytes = (k + 1) / 2, groups = (k + group - 1) / group;
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* wrow = w + o * row_bytes;
      T* orow = out + o * k;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
        const float s = scale[o * groups + g];
        int64_t i = g0;
#if !defined(KILN_ISA_SCALAR)
        float buf[32];
        const vfloat vs = vset1(s);
        for (; i + 32 <= g1 && (i & 1) == 0; i += 32) {
          vfloat v[32 / kLanes];
          unpack_int4x32(wrow + i / 2, v);
          for (int j = 0; j < 32 / kLanes; ++j) vstore(buf + j * kLanes, vmul(v[j], vs));
          for (int j = 0; j < 32; ++j) store_as(orow + i + j, buf[j]);
        }
#endif
        for (; i < g1; ++i) store_as(orow + i, static_cast<float>(int4_at(wrow, i)) * s);
      }
    }
  });
}

#if defined(KILN_ISA_AVX512)
// int4: 16 bytes -> 32 int16 in [0, 15]: the 16 even elements (low nibbles), then the 16 odd
// (or, WIDE, 32 bytes -> 64: evens of both halves, then odds; x is stored in the same order).
// The stored nibbles are value + 8: 8 * sum(x) of the group is taken off in the int domain.
template <int R, bool WIDE>
inline __m512i group_dot_w4(const int16_t* xq, int64_t kp, const uint8_t* w, int64_t g0, int64_t g1,
                            __m512i* acc) {
  __m512i acc_hi[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_hi[r] = _mm512_setzero_si512();
  if (WIDE) {
    const __m512i nib = _mm512_set1_epi16(0x0F);
    for (int64_t i = g0; i < g1; i += 64) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i / 2)));
      const __m512i lo = _mm512_and_si512(bytes, nib), hi = _mm512_srli_epi16(bytes, 4);
      for (int r = 0; r < R; ++r) {
        acc[r] = dp16(acc[r], _mm512_loadu_si512(xq + r * kp + i), lo);
        acc_hi[r] = dp16(acc_hi[r], _mm512_loadu_si512(xq + r * kp + i + 32), hi);
      }
    }
  } else {
    const __m256i nib = _mm256_set1_epi16(0x0F);
    for (int64_t i = g0; i < g1; i += 32) {
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i / 2)));
      const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nib)),
                                            _mm256_srli_epi16(bytes, 4), 1);
      for (int r = 0; r < R; ++r) acc[r] = dp16(acc[r], _mm512_loadu_si512(xq + r * kp + i), wv);
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm512_add_epi32(acc[r], acc_hi[r]);
  return acc[0];
}

template <int R, int O, bool WIDE>
inline void tile_w4(const int16_t* xq, int64_t kp, const int32_t* xsum8, const uint8_t* w, int64_t row_bytes,
                    const float* scale, int64_t group, int64_t groups, float* sums) {
  static_assert(O == 1, "one weight row at a time");
  __m512 even[R], odd[R];  // per-group FMAs alternate between two chains
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  __m512i acc[R];
  int64_t g = 0;
  auto fold = [&](int64_t gi, __m512* into) {
    const __m512 vs = _mm512_set1_ps(scale[gi]);
    for (int r = 0; r < R; ++r) {
      const __m512i centred = _mm512_sub_epi32(acc[r], _mm512_maskz_set1_epi32(1, xsum8[r * groups + gi]));
      into[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), vs, into[r]);
    }
  };
  for (; g + 2 <= groups; g += 2) {
    group_dot_w4<R, WIDE>(xq, kp, w, g * group, std::min(kp, (g + 1) * group), acc);
    fold(g, even);
    group_dot_w4<R, WIDE>(xq, kp, w, (g + 1) * group, std::min(kp, (g + 2) * group), acc);
    fold(g + 1, odd);
  }
  if (g < groups) {
    group_dot_w4<R, WIDE>(xq, kp, w, g * group, std::min(kp, (g + 1) * group), acc);
    fold(g, even);
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

// Decode (one input row), WIDE layout: four weight rows at once, so four dot-product chains
// run side by side (one row alone is bound by vpdpwssd's latency). Measured 1.3-1.4x.
inline void four_rows_w4(const int16_t* xq, const int32_t* xsum8, const uint8_t* w, int64_t row_bytes,
                         const float* scale, int64_t group, int64_t groups, float* sums) {
  const __m512i nib = _mm512_set1_epi16(0x0F);
  four_rows_by_group(
      row_bytes * 2, group, groups,
      [&](int64_t i, __m512i* acc) {
        const __m512i x_lo = _mm512_loadu_si512(xq + i), x_hi = _mm512_loadu_si512(xq + i + 32);
        for (int r = 0; r < 4; ++r) {
          const __m512i bytes =
              _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + i / 2)));
          acc[r] = dp16(acc[r], x_lo, _mm512_and_si512(bytes, nib));
          acc[r] = dp16(acc[r], x_hi, _mm512_srli_epi16(bytes, 4));
        }
      },
      [&](int64_t g) { return xsum8[g]; }, [&](int r, int64_t g) { return scale[r * groups + g]; }, sums);
}

// one weight row after the other: streaming several rows side by side measured 2.5x slower
// once the weights come from memory rather than cache
template <int R, bool WIDE>
inline void rows_w4(const int16_t* xq, int64_t kp, const int32_t* xsum8, const uint8_t* w, int64_t row_bytes,
                    const float* scale, int64_t group, int64_t groups, int64_t o0, int64_t o1, float* sums) {
  int64_t o = o0;
  if (WIDE && R == 1)  // one input row: four weight rows side by side (four independent chains)
    for (; o + 4 <= o1; o += 4) four_rows_w4(xq, xsum8, w + o * row_bytes, row_bytes, scale + o * groups, group,
                                             groups, sums + (o - o0));
  for (; o < o1; ++o)
    tile_w4<R, 1, WIDE>(xq, kp, xsum8, w + o * row_bytes, row_bytes, scale + o * groups, group, groups,
                        sums + (o - o0) * R);
}

template <typename T>
void linear_w4_i16(const T* x, const uint8_t* w, const float* scale, int64_t group, const T* bias, T* out,
                   int64_t rows, int64_t k, int64_t n) {
  const int64_t kp = k, row_bytes = k / 2, groups = (k + group - 1) / group;  // k % 32 == 0 here
  std::vector<int16_t> xq(rows * kp);
  std::vector<float> xs(rows);
  const bool wide = k % 64 == 0 && group % 64 == 0;
  quantize_rows_i16(x, rows, k, kp, wide ? 64 : 32, 32767.f, xq.data(), xs.data());
  std::vector<int32_t> xsum8(rows * groups, 0);  // 8 * sum of each row's group (the nibble offset)
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < k; ++i) xsum8[m * groups + i / group] += 8 * xq[m * kp + i];
  tiles_i16(bias, out, xs.data(), rows, n, [&](auto R, int64_t m0, int64_t o0, int64_t o1, float* sums) {
    constexpr int r = decltype(R)::value;
    (wide ? rows_w4<r, true> : rows_w4<r, false>)(xq.data() + m0 * kp, kp, xsum8.data() + m0 * groups, w, row_bytes,
                                                    scale, group, groups, o0, o1, sums);
  }, [](int64_t) { return 1.f; });
}
#endif
