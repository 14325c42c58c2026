// FP8 E4M3 (round_fp8 and the loads are in vec.h). Included per ISA inside kiln::<isa> after gemv.h.
//
//   linear_fp8_float         out = x @ (e4m3 W * scale[n])^T: the weights [n, k] widened one by
//                            one (exact; the scalar path)
//   linear_fp8_shift         AVX2 / AVX-512: the same, 32 / 64 weights a step widened by shifts
//                            (no byte shuffle), the inputs reordered to match
//   dequantize_fp8_elements  E4M3 weights -> float32 / bf16 (exact; bf16 holds every E4M3 value)
//   quantize_fp8_elements    x * inv_scale rounded to the nearest E4M3 value (ties to even,
//                            saturating at +-448), in x's dtype: static per-tensor FP8
//                            activations (exact in bf16)

template <typename T>
void quantize_fp8_elements(const T* x, T* out, int64_t count, float inv_scale) {
  parallel_for(0, count, 4096, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(KILN_ISA_AVX512)
    for (; i + 16 <= end; i += 16) {  // to E4M3 bytes and back: both exact as round_fp8
      const __m512 r = fp8_to_f32(fp8_bytes(_mm512_mul_ps(vload(x + i), _mm512_set1_ps(inv_scale))));
      vstore_exact(out + i, r);
    }
#elif defined(KILN_ISA_AVX2)
    for (; i + 8 <= end; i += 8) {  // as above, 8 at a time
      const __m128i bytes = fp8_bytes8(_mm256_mul_ps(vload(x + i), _mm256_set1_ps(inv_scale)));
      const __m256 r = vload(reinterpret_cast<const fp8e4m3*>(&bytes));
      vstore_exact(out + i, r);
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
  parallel_for(0, count, 1 << 14, [&](int64_t begin, int64_t end) {
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
      vstore_exact(out + i, v);
    }
#endif
    for (; i < end; ++i) store_as(out + i, to_f32(fp8e4m3{w[i]}));
  });
}

#if !defined(KILN_ISA_SCALAR)
// E4M3 weights widened with no byte shuffle (vpmovsxbw and vcvtph2ps share one port, which held
// the 8- or 16-at-a-time loads at 2.5x under the read bandwidth): each 16-bit lane of a load
// holds two weights, shifted to the lane's top byte (the even one) or masked there (the odd),
// then taken down one bit with the sign kept and bit 14 cleared: the fp16 of the weight / 2^8
// (exact: fp16's exponent bias is 8 more than E4M3's, its subnormals cover E4M3's). A step of
// kFp8Step weights gives four vectors (the evens of each half, then the odds of each), which
// meet the inputs stored in that order (permuted(i, kFp8Step)); C chains per row; the sums
// * 2^8 at the end (exact while no product falls below fp32's normal range).
#if defined(KILN_ISA_AVX512)
constexpr int kFp8Step = 64;
inline void fp8_step(const uint8_t* p, __m512* wv) {
  const __m512i v = _mm512_loadu_si512(p), keep = _mm512_set1_epi16(-16385);  // 0xBFFF
  const __m512i evens = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 1), keep);
  const __m512i odds = _mm512_and_si512(_mm512_srai_epi16(_mm512_and_si512(v, _mm512_set1_epi16(-256)), 1), keep);
  wv[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(evens)), wv[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(evens, 1));
  wv[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(odds)), wv[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(odds, 1));
}
#else
constexpr int kFp8Step = 32;
inline void fp8_step(const uint8_t* p, __m256* wv) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), keep = _mm256_set1_epi16(-16385);
  const __m256i evens = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 1), keep);
  const __m256i odds = _mm256_and_si256(_mm256_srai_epi16(_mm256_and_si256(v, _mm256_set1_epi16(-256)), 1), keep);
  wv[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(evens)), wv[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(evens, 1));
  wv[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(odds)), wv[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(odds, 1));
}
#endif

// Each row in four chains whatever R (so a row gets the same bits among others as alone), at most
// two rows a pass (4 * R accumulators and the step's four weight vectors in registers)
template <int R>
inline void dot_rows_fp8(const float* xp, int64_t k, const uint8_t* wrow, float* sums) {
  if constexpr (R > 2) {
    dot_rows_fp8<2>(xp, k, wrow, sums);
    dot_rows_fp8<R - 2>(xp + 2 * k, k, wrow, sums + 2);
    return;
  }
  constexpr int C = 4;
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  int64_t i = 0;
  for (; i + kFp8Step <= k; i += kFp8Step) {
    vfloat wv[4];
    fp8_step(wrow + i, wv);
    for (int q = 0; q < 4; ++q)
      for (int r = 0; r < R; ++r) acc[r][q % C] = vfma(vload(xp + r * k + i + kLanes * q), wv[q], acc[r][q % C]);
  }
  for (int r = 0; r < R; ++r) {
    vfloat total = acc[r][0];
    for (int c = 1; c < C; ++c) total = vadd(total, acc[r][c]);
    sums[r] = vsum(total) * 256.f;
    for (int64_t j = i; j < k; ++j) sums[r] += xp[r * k + j] * to_f32(fp8e4m3{wrow[j]});  // the tail, in order
  }
}

template <typename T>
void linear_fp8_shift(const T* x, const uint8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                      int64_t k, int64_t n) {
  std::vector<float> xp(rows * k);  // each full step of inputs in the kernel's order
  const int64_t full = k / kFp8Step * kFp8Step;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < k; ++i) xp[m * k + (i < full ? permuted(i, kFp8Step) : i)] = to_f32(x[m * k + i]);
  gemv_rows({w, k}, xp.data(), bias, out, rows, k, n, [&](auto R, const float* xr, int64_t o, float* sums) {
    dot_rows_fp8<decltype(R)::value>(xr, k, w + o * k, sums);
    for (int r = 0; r < R; ++r) sums[r] *= scale[o];
  });
}
#endif

template <typename T>
void linear_fp8_float(const T* x, const uint8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                     int64_t k, int64_t n) {
  gemv_float_rows({w, k}, x, bias, out, rows, k, n, [&](auto R, const float* xr, int64_t o, float* sums) {
    dot_rows_bytes<decltype(R)::value>(xr, k, reinterpret_cast<const fp8e4m3*>(w + o * k), sums);
    for (int r = 0; r < R; ++r) sums[r] *= scale[o];
  });
}

