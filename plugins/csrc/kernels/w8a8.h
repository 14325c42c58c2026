// SmoothQuant W8A8: int8 weights [out, in] with one scale per output channel, the activations
// quantized per row to int8 at run time (absmax / 127), int8 x int8 -> int32 dot products
// (VNNI vpdpbusd on CPUs with it, 512- or 256-bit (AVX-VNNI): u8 x s8, so x is offset by 128 and
// 128 * rowsum(W) taken off;
// vpmaddwd on int16-widened bytes otherwise), then * x_scale[m] * w_scale[n]. With
// input_scale > 0 the activations use that one static scale instead (Model Optimizer's
// W8A8_SQ_PER_CHANNEL). Included per ISA inside kiln::<isa> after gemv.h.
//
// Quantize one row to u8 = round(x / s) + 128 with s = absmax / 127 (0 for an all-zero row).
template <typename T>
float quantize_row_u8(const T* x, uint8_t* q, int64_t k, float static_scale) {
  float amax = 0.f;
  if (static_scale <= 0.f)
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(to_f32(x[i])));
  const float s = static_scale > 0.f ? static_scale : amax / 127.f;
  const float inv = static_scale > 0.f ? 1.f / static_scale : amax > 0.f ? 127.f / amax : 0.f;
  const float lowest = static_scale > 0.f ? -128.f : -127.f;  // static: the full int8 range, as Model Optimizer
  for (int64_t i = 0; i < k; ++i) {
    const float v = std::nearbyint(to_f32(x[i]) * inv);
    q[i] = static_cast<uint8_t>(static_cast<int>(std::min(127.f, std::max(lowest, v))) + 128);
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
#elif defined(KILN_ISA_AVXVNNI)
  __m256i acc = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();  // two chains: vpdpbusd's latency
  for (; i + 64 <= n; i += 64) {
    acc = _mm256_dpbusd_avx_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i)),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)));
    acc1 = _mm256_dpbusd_avx_epi32(acc1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i + 32)),
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 32)));
  }
  for (; i + 32 <= n; i += 32)
    acc = _mm256_dpbusd_avx_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i)),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)));
  total = sum8_i32(_mm256_add_epi32(acc, acc1));
#elif defined(KILN_ISA_AVX2)
  __m256i acc = _mm256_setzero_si256();
  for (; i + 16 <= n; i += 16) {
    const __m256i av = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256i bv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(av, bv));
  }
  total = sum8_i32(acc);
#endif
  for (; i < n; ++i) total += static_cast<int32_t>(a[i]) * static_cast<int32_t>(b[i]);
  return total;
}

template <typename T>
void linear_w8a8_rows(const T* x, const int8_t* w, const float* scale, const int32_t* wsum, float static_scale,
                      const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  std::vector<uint8_t> xq(rows * k);
  std::vector<float> xs(rows);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) xs[m] = quantize_row_u8(x + m * k, xq.data() + m * k, k, static_scale);
  });
  // weight rows in tiles of 4 (L1-resident) against every input row
  const WeightRows stream{w, k};
  at::parallel_for(0, (n + 3) / 4, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * 4, o1 = std::min(n, o0 + 4);
      for (int64_t o = o0; o < o1; ++o) stream.ahead(o);
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
