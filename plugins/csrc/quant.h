// Quantized linear kernels. Included per ISA inside kiln::<isa> after vec.h.
//
//   linear_w8   out = x @ (int8 W * scale[n])^T        weights int8 [n, k], x float/bf16 (W8A16)
//   linear_w4   out = x @ (int4 W * scale[n, g])^T     weights two per byte along k (low nibble
//               = even k), stored offset by 8 (0..15 = -8..7), one scale per group of k (W4A16)
//   dequantize_int4                                    the same weights back to float
//   linear_w8a8 x quantized per row to int8 at run time (absmax / 127), int8 x int8 -> int32
//               dot products (VNNI vpdpbusd on CPUs with it: u8 x s8, so x is offset by 128 and
//               128 * rowsum(W) taken off), then * x_scale[m] * w_scale[n] (SmoothQuant W8A8)
//
// The W8A16 / W4A16 kernels are GEMVs for a few rows (decode steps): each weight byte is read
// once and widened once for up to four input rows. fp32 accumulation, one rounding at the end.

#if defined(KILN_ISA_AVX512)
inline vfloat vload_i8(const int8_t* p) {  // 16 int8 -> fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vfloat vcvt_i8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
#elif defined(KILN_ISA_AVX2)
inline vfloat vload_i8(const int8_t* p) {  // 8 int8 -> fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

template <typename T>
void linear_w8_impl(const T* x, const int8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                    int64_t k, int64_t n) {
  std::vector<float> xf(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) xf[i] = to_f32(x[i]);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const int8_t* wrow = w + o * k;
      const float b = bias ? to_f32(bias[o]) : 0.f;
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t mr = std::min<int64_t>(4, rows - m0);
        float sums[4] = {0.f, 0.f, 0.f, 0.f};
        int64_t i = 0;
#if !defined(KILN_ISA_SCALAR)
        vfloat acc[4] = {vzero(), vzero(), vzero(), vzero()};
        for (; i + kLanes <= k; i += kLanes) {
          const vfloat wv = vload_i8(wrow + i);
          for (int64_t r = 0; r < mr; ++r) acc[r] = vfma(vload(xf.data() + (m0 + r) * k + i), wv, acc[r]);
        }
        for (int64_t r = 0; r < mr; ++r) sums[r] = vsum(acc[r]);
#endif
        for (; i < k; ++i)
          for (int64_t r = 0; r < mr; ++r) sums[r] += xf[(m0 + r) * k + i] * static_cast<float>(wrow[i]);
        for (int64_t r = 0; r < mr; ++r) store_as(out + (m0 + r) * n + o, sums[r] * scale[o] + b);
      }
    }
  });
}

inline int int4_at(const uint8_t* row, int64_t i) {  // the signed value of element i
  const uint8_t byte = row[i >> 1];
  return static_cast<int>((i & 1) ? (byte >> 4) : (byte & 0x0F)) - 8;
}

#if defined(KILN_ISA_AVX512)
// 32 int4 (16 bytes) -> two vectors of 16 fp32 in k order
inline void unpack_int4x32(const uint8_t* p, vfloat& lo, vfloat& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  const __m128i even = _mm_sub_epi8(_mm_and_si128(bytes, mask), eight);
  const __m128i odd = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), eight);
  lo = vcvt_i8(_mm_unpacklo_epi8(even, odd));
  hi = vcvt_i8(_mm_unpackhi_epi8(even, odd));
}
#endif

template <typename T>
void linear_w4_impl(const T* x, const uint8_t* w, const float* scale, int64_t group, const T* bias, T* out,
                    int64_t rows, int64_t k, int64_t n) {
  const int64_t row_bytes = (k + 1) / 2, groups = (k + group - 1) / group;
  std::vector<float> xf(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) xf[i] = to_f32(x[i]);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* wrow = w + o * row_bytes;
      const float* srow = scale + o * groups;
      const float b = bias ? to_f32(bias[o]) : 0.f;
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t mr = std::min<int64_t>(4, rows - m0);
        float sums[4] = {0.f, 0.f, 0.f, 0.f};
#if defined(KILN_ISA_AVX512)
        vfloat total[4] = {vzero(), vzero(), vzero(), vzero()};
#endif
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
          const float s = srow[g];
          int64_t i = g0;
#if defined(KILN_ISA_AVX512)
          vfloat acc[4] = {vzero(), vzero(), vzero(), vzero()};
          for (; i + 32 <= g1 && (i & 1) == 0; i += 32) {
            vfloat lo, hi;
            unpack_int4x32(wrow + i / 2, lo, hi);
            for (int64_t r = 0; r < mr; ++r) {
              const float* xr = xf.data() + (m0 + r) * k + i;
              acc[r] = vfma(vload(xr), lo, acc[r]);
              acc[r] = vfma(vload(xr + 16), hi, acc[r]);
            }
          }
          const vfloat vs = vset1(s);
          for (int64_t r = 0; r < mr; ++r) total[r] = vfma(acc[r], vs, total[r]);
#endif
          for (int64_t r = 0; r < mr; ++r) {
            float tail = 0.f;
            for (int64_t j = i; j < g1; ++j) tail += xf[(m0 + r) * k + j] * static_cast<float>(int4_at(wrow, j));
            sums[r] += tail * s;
          }
        }
#if defined(KILN_ISA_AVX512)
        for (int64_t r = 0; r < mr; ++r) sums[r] += vsum(total[r]);
#endif
        for (int64_t r = 0; r < mr; ++r) store_as(out + (m0 + r) * n + o, sums[r] + b);
      }
    }
  });
}

template <typename T>
void dequantize_int4_impl(const uint8_t* w, const float* scale, int64_t group, T* out, int64_t k, int64_t n) {
  const int64_t row_bytes = (k + 1) / 2, groups = (k + group - 1) / group;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* wrow = w + o * row_bytes;
      T* orow = out + o * k;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
        const float s = scale[o * groups + g];
        int64_t i = g0;
#if defined(KILN_ISA_AVX512)
        float buf[32];
        const vfloat vs = vset1(s);
        for (; i + 32 <= g1 && (i & 1) == 0; i += 32) {
          vfloat lo, hi;
          unpack_int4x32(wrow + i / 2, lo, hi);
          vstore(buf, vmul(lo, vs));
          vstore(buf + 16, vmul(hi, vs));
          for (int j = 0; j < 32; ++j) store_as(orow + i + j, buf[j]);
        }
#endif
        for (; i < g1; ++i) store_as(orow + i, static_cast<float>(int4_at(wrow, i)) * s);
      }
    }
  });
}

// --- W8A8 -------------------------------------------------------------------------------
// Quantize one row to u8 = round(x / s) + 128 with s = absmax / 127 (0 for an all-zero row).
template <typename T>
float quantize_row_u8(const T* x, uint8_t* q, int64_t k) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(to_f32(x[i])));
  const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < k; ++i) {
    const float v = std::nearbyint(to_f32(x[i]) * inv);
    q[i] = static_cast<uint8_t>(static_cast<int>(std::min(127.f, std::max(-127.f, v))) + 128);
  }
  return s;
}

// sum_i a_u8[i] * b_s8[i] (exact, int32)
inline int32_t dot_u8s8(const uint8_t* a, const int8_t* b, int64_t n) {
  int64_t i = 0;
  int32_t total = 0;
#if defined(KILN_ISA_VNNI)
  __m512i acc = _mm512_setzero_si512();
  for (; i + 64 <= n; i += 64)
    acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i));
  if (i < n) {
    const __mmask64 tail = (n - i) >= 64 ? ~0ULL : ((1ULL << (n - i)) - 1);
    acc = _mm512_dpbusd_epi32(acc, _mm512_maskz_loadu_epi8(tail, a + i), _mm512_maskz_loadu_epi8(tail, b + i));
    i = n;
  }
  total = _mm512_reduce_add_epi32(acc);
#elif defined(KILN_ISA_AVX512)
  __m512i acc = _mm512_setzero_si512();
  for (; i + 32 <= n; i += 32) {
    const __m512i av = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i)));
    const __m512i bv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)));
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(av, bv));
  }
  total = _mm512_reduce_add_epi32(acc);
#elif defined(KILN_ISA_AVX2)
  __m256i acc = _mm256_setzero_si256();
  for (; i + 16 <= n; i += 16) {
    const __m256i av = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256i bv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(av, bv));
  }
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  total = _mm_cvtsi128_si32(s);
#endif
  for (; i < n; ++i) total += static_cast<int32_t>(a[i]) * static_cast<int32_t>(b[i]);
  return total;
}

template <typename T>
void linear_w8a8_impl(const T* x, const int8_t* w, const float* scale, const int32_t* wsum, const T* bias, T* out,
                      int64_t rows, int64_t k, int64_t n) {
  std::vector<uint8_t> xq(rows * k);
  std::vector<float> xs(rows);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) xs[m] = quantize_row_u8(x + m * k, xq.data() + m * k, k);
  });
  // weight rows in tiles of 4 (L1-resident) against every input row
  at::parallel_for(0, (n + 3) / 4, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * 4, o1 = std::min(n, o0 + 4);
      for (int64_t m = 0; m < rows; ++m) {
        const uint8_t* xr = xq.data() + m * k;
        for (int64_t o = o0; o < o1; ++o) {
          const int32_t acc = dot_u8s8(xr, w + o * k, k) - 128 * wsum[o];
          store_as(out + m * n + o, static_cast<float>(acc) * xs[m] * scale[o] + (bias ? to_f32(bias[o]) : 0.f));
        }
      }
    }
  });
}

void linear_w8_f32(const float* x, const int8_t* w, const float* s, const float* b, float* o, int64_t r, int64_t k,
                   int64_t n) { linear_w8_impl<float>(x, w, s, b, o, r, k, n); }
void linear_w8_bf16(const bf16* x, const int8_t* w, const float* s, const bf16* b, bf16* o, int64_t r, int64_t k,
                    int64_t n) { linear_w8_impl<bf16>(x, w, s, b, o, r, k, n); }
void linear_w4_f32(const float* x, const uint8_t* w, const float* s, int64_t g, const float* b, float* o, int64_t r,
                   int64_t k, int64_t n) { linear_w4_impl<float>(x, w, s, g, b, o, r, k, n); }
void linear_w4_bf16(const bf16* x, const uint8_t* w, const float* s, int64_t g, const bf16* b, bf16* o, int64_t r,
                    int64_t k, int64_t n) { linear_w4_impl<bf16>(x, w, s, g, b, o, r, k, n); }
void dequantize_int4_f32(const uint8_t* w, const float* s, int64_t g, float* o, int64_t k, int64_t n) {
  dequantize_int4_impl<float>(w, s, g, o, k, n);
}
void dequantize_int4_bf16(const uint8_t* w, const float* s, int64_t g, bf16* o, int64_t k, int64_t n) {
  dequantize_int4_impl<bf16>(w, s, g, o, k, n);
}
void linear_w8a8_f32(const float* x, const int8_t* w, const float* s, const int32_t* ws, const float* b, float* o,
                     int64_t r, int64_t k, int64_t n) { linear_w8a8_impl<float>(x, w, s, ws, b, o, r, k, n); }
void linear_w8a8_bf16(const bf16* x, const int8_t* w, const float* s, const int32_t* ws, const bf16* b, bf16* o,
                      int64_t r, int64_t k, int64_t n) { linear_w8a8_impl<bf16>(x, w, s, ws, b, o, r, k, n); }
