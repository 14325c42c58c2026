// FP8 E4M3 (round_fp8 and the loads are in vec.h). Included per ISA inside kiln::<isa> after gemv.h.
//
//   linear_fp8_float         out = x @ (e4m3 W * scale[n])^T: weights [n, k] widened to fp32
//                            per vector (exact), FMAs
//   linear_fp8_dp            AVX512-BF16, bf16 activations: the weights widened to bf16 (exact)
//                            and vdpbf16ps (32 multiply-adds per instruction)
//   dequantize_fp8_elements  E4M3 weights -> float32 / bf16 (exact; bf16 holds every E4M3 value)
//   quantize_fp8_elements    x * inv_scale rounded to the nearest E4M3 value (ties to even,
//                            saturating at +-448), in x's dtype: static per-tensor FP8
//                            activations (exact in bf16)

template <typename T>
void quantize_fp8_elements(const T* x, T* out, int64_t count, float inv_scale) {
  at::parallel_for(0, count, 4096, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(KILN_ISA_AVX512)
    for (; i + 16 <= end; i += 16) {  // to E4M3 bytes and back: both exact as round_fp8
      const __m512 r = fp8_to_f32(fp8_bytes(_mm512_mul_ps(vload(x + i), _mm512_set1_ps(inv_scale))));
      if constexpr (std::is_same_v<T, bf16>)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), exact_bf16(r));
      else
        _mm512_storeu_ps(out + i, r);
    }
#elif defined(KILN_ISA_AVX2)
    for (; i + 8 <= end; i += 8) {  // as above, 8 at a time
      const __m128i bytes = fp8_bytes8(_mm256_mul_ps(vload(x + i), _mm256_set1_ps(inv_scale)));
      const __m256 r = vload(reinterpret_cast<const fp8e4m3*>(&bytes));
      if constexpr (std::is_same_v<T, bf16>)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), exact_bf16x8(r));
      else
        _mm256_storeu_ps(out + i, r);
    }
#endif
    for (; i < end; ++i) store_as(out + i, round_fp8(to_f32(x[i]) * inv_scale));
  });
}

#if defined(KILN_ISA_AVX512)
// 32 E4M3 bytes -> 32 bf16, exactly. A normal E4M3 (exponent e, mantissa m) is the bf16 with
// exponent e + 120 and the same top mantissa bits: (bits & 0x7f) << 4 plus 120 << 7; the eight
// subnormals (e = 0: m * 2^-9) come from a table.
inline __m512i fp8x32_to_bf16(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  const __m512i subnormals = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
  const __mmask32 small = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  const __m512i value = _mm512_mask_blend_epi16(small, normal, _mm512_permutexvar_epi16(mag, subnormals));
  return _mm512_or_si512(value, sign);
}
#endif

template <typename T>
void dequantize_fp8_elements(const uint8_t* w, T* out, int64_t count) {
  at::parallel_for(0, count, 1 << 14, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(KILN_ISA_AVX512)
    for (; i + 32 <= end; i += 32) {
      const __m512i v = fp8x32_to_bf16(w + i);
      if constexpr (std::is_same_v<T, bf16>) {
        _mm512_storeu_si512(out + i, v);
      } else {
        _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16)));
        _mm512_storeu_ps(out + i + 16, _mm512_castsi512_ps(
                                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16)));
      }
    }
#elif defined(KILN_ISA_AVX2)
    for (; i + 8 <= end; i += 8) {  // exact: vload widens E4M3 through fp16
      const __m256 v = vload(reinterpret_cast<const fp8e4m3*>(w + i));
      if constexpr (std::is_same_v<T, bf16>)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), exact_bf16x8(v));
      else
        _mm256_storeu_ps(out + i, v);
    }
#endif
    for (; i < end; ++i) store_as(out + i, to_f32(fp8e4m3{w[i]}));
  });
}

#if defined(KILN_ISA_AVX512BF16)
// bf16 rows against one E4M3 weight row with vdpbf16ps: the weights become bf16 exactly (above)
// and 32 multiply-adds take one instruction per row; products are exact, sums fp32.
template <int R>
inline void dot_rows_fp8_dp(const bf16* x, int64_t k, const uint8_t* wrow, float* sums) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const __m512bh wv = (__m512bh)fp8x32_to_bf16(wrow + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], load_bf16x32(x + r * k + i), wv);
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
  for (; i < k; ++i)
    for (int r = 0; r < R; ++r) sums[r] += to_f32(x[r * k + i]) * to_f32(fp8e4m3{wrow[i]});
}

void linear_fp8_dp(const bf16* x, const uint8_t* w, const float* scale, const bf16* bias, bf16* out, int64_t rows,
                   int64_t k, int64_t n) {
  gemv_rows(x, bias, out, rows, k, n, [&](auto R, const bf16* xr, int64_t o, float* sums) {
    dot_rows_fp8_dp<decltype(R)::value>(xr, k, w + o * k, sums);
    for (int r = 0; r < R; ++r) sums[r] *= scale[o];
  });
}
#endif

template <typename T>
void linear_fp8_float(const T* x, const uint8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                     int64_t k, int64_t n) {
  gemv_float_rows(x, bias, out, rows, k, n, [&](auto R, const float* xr, int64_t o, float* sums) {
    dot_rows_bytes<decltype(R)::value>(xr, k, reinterpret_cast<const fp8e4m3*>(w + o * k), sums);
    for (int r = 0; r < R; ++r) sums[r] *= scale[o];
  });
}

