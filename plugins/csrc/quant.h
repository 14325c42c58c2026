
// Quantized linear kernels. Included per ISA inside kiln::<isa> after vec.h.
//
//   linear_w8   out = x @ (int8 W * scale[n])^T        weights int8 [n, k], x float/bf16 (W8A16)
//   linear_w4   out = x @ (int4 W * scale[n, g])^T     weights two per byte along k (low nibble
//               = even k), stored offset by 8 (0..15 = -8..7), one scale per group of k (W4A16)
//   dequantize_int4                                    the same weights back to float
//   linear_w8a8 x quantized per row to int8 at run time (absmax / 127), int8 x int8 -> int32
//               dot products (VNNI vpdpbusd on CPUs with it: u8 x s8, so x is offset by 128 and
//               128 * rowsum(W) taken off), then * x_scale[m] * w_scale[n] (SmoothQuant W8A8); with
//               input_scale > 0 the activations use that one static scale instead (Model Optimizer's
//               W8A8_SQ_PER_CHANNEL)
//   linear_fp8  out = x @ (e4m3 W * scale[n])^T       weights FP8 E4M3 [n, k] (one byte each)
//   dequantize_fp8 E4M3 weights -> float32 / bf16 (exact; bf16 holds every E4M3 value)
//   quantize_fp8 x * inv_scale rounded to the nearest E4M3 value (ties to even, saturating at
//               +-448), in x's dtype: static per-tensor FP8 activations (exact in bf16)
//
// The W8A16 / W4A16 kernels are GEMVs for a few rows (decode steps): each weight byte is read
// once and widened once for up to four input rows. fp32 accumulation, one rounding at the end.

// f(std::integral_constant<int, R>{}) for R = mr (1..4): kernels take the row count as a
// template argument so their accumulators stay in registers
template <typename F>
inline void with_rows(int64_t mr, F&& f) {
  switch (mr) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}

// The GEMV driver: each weight row o against the input rows xs (as the kernel reads them) four at
// a time; dot(R, xs + m0 * k, o, sums) fills sums[0, R) and out = sums + bias.
template <typename X, typename T, typename Dot>
void gemv_rows(const X* xs, const T* bias, T* out, int64_t rows, int64_t k, int64_t n, Dot dot) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float sums[4];
    for (int64_t o = begin; o < end; ++o) {
      const float b = bias ? to_f32(bias[o]) : 0.f;
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t mr = std::min<int64_t>(4, rows - m0);
        with_rows(mr, [&](auto R) { dot(R, xs + m0 * k, o, sums); });
        for (int64_t r = 0; r < mr; ++r) store_as(out + (m0 + r) * n + o, sums[r] + b);
      }
    }
  });
}

// The float-input GEMV (AVX2 / scalar paths): the input rows widened to fp32 once first.
template <typename T, typename Dot>
void gemv_float_rows(const T* x, const T* bias, T* out, int64_t rows, int64_t k, int64_t n, Dot dot) {
  std::vector<float> xf(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) xf[i] = to_f32(x[i]);
  gemv_rows(xf.data(), bias, out, rows, k, n, dot);
}

#if defined(KILN_ISA_AVX512)
inline vfloat vcvt_i8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
#endif

// R input rows against one weight row of one-byte elements W (int8_t, fp8e4m3: vec.h's vload and
// to_f32 widen them exactly); R is fixed at compile time so the accumulators stay in registers
template <int R, typename W>
inline void dot_rows_bytes(const float* xf, int64_t k, const W* wrow, float* sums) {
  int64_t i = 0;
  for (int r = 0; r < R; ++r) sums[r] = 0.f;
#if !defined(KILN_ISA_SCALAR)
  vfloat acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  for (; i + kLanes <= k; i += kLanes) {
    const vfloat wv = vload(wrow + i);
    for (int r = 0; r < R; ++r) acc[r] = vfma(vload(xf + r * k + i), wv, acc[r]);
  }
  for (int r = 0; r < R; ++r) sums[r] = vsum(acc[r]);
#endif
  for (; i < k; ++i)
    for (int r = 0; r < R; ++r) sums[r] += xf[r * k + i] * to_f32(wrow[i]);
}

template <typename T>
void linear_w8_impl(const T* x, const int8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                    int64_t k, int64_t n) {
  gemv_float_rows(x, bias, out, rows, k, n, [&](auto R, const float* xr, int64_t o, float* sums) {
    dot_rows_bytes<decltype(R)::value>(xr, k, w + o * k, sums);
    for (int r = 0; r < R; ++r) sums[r] *= scale[o];
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

// R input rows against one int4 weight row, group by group
template <int R>
inline void dot_rows_w4(const float* xf, int64_t k, const uint8_t* wrow, const float* srow, int64_t group,
                        float* sums) {
  const int64_t groups = (k + group - 1) / group;
  for (int r = 0; r < R; ++r) sums[r] = 0.f;
#if defined(KILN_ISA_AVX512)
  vfloat total[R];
  for (int r = 0; r < R; ++r) total[r] = vzero();
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
    const float s = srow[g];
    int64_t i = g0;
#if defined(KILN_ISA_AVX512)
    vfloat acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero();
    for (; i + 32 <= g1 && (i & 1) == 0; i += 32) {
      vfloat lo, hi;
      unpack_int4x32(wrow + i / 2, lo, hi);
      for (int r = 0; r < R; ++r) {
        acc[r] = vfma(vload(xf + r * k + i), lo, acc[r]);
        acc[r] = vfma(vload(xf + r * k + i + 16), hi, acc[r]);
      }
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
#if defined(KILN_ISA_AVX512)
  for (int r = 0; r < R; ++r) sums[r] += vsum(total[r]);
#endif
}

template <typename T>
void linear_w4_impl(const T* x, const uint8_t* w, const float* scale, int64_t group, const T* bias, T* out,
                    int64_t rows, int64_t k, int64_t n) {
  const int64_t row_bytes = (k + 1) / 2, groups = (k + group - 1) / group;
  gemv_float_rows(x, bias, out, rows, k, n, [&](auto R, const float* xr, int64_t o, float* sums) {
    dot_rows_w4<decltype(R)::value>(xr, k, w + o * row_bytes, scale + o * groups, group, sums);
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
void linear_w8a8_impl(const T* x, const int8_t* w, const float* scale, const int32_t* wsum, float static_scale,
                      const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  std::vector<uint8_t> xq(rows * k);
  std::vector<float> xs(rows);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) xs[m] = quantize_row_u8(x + m * k, xq.data() + m * k, k, static_scale);
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

#if defined(KILN_ISA_AVX512)
// --- AVX-512: int16 activations -------------------------------------------------------
// The W8A16 / W4A16 GEMVs widen weights only to int16 and multiply with int16 pairs
// (vpdpwssd with VNNI, vpmaddwd otherwise): one instruction per 32 weights and row instead
// of float conversions and FMAs. The input rows are quantized to int16 per row (absmax /
// 32767: a relative error of 1.5e-5 of the row's largest value, far below bf16's 4e-3).
inline __m512i dp16(__m512i acc, __m512i a, __m512i b) {
#if defined(KILN_ISA_VNNI)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// rows x k -> int16 rows padded to kp (a multiple of 32) with zeros; per-row scales. The
// order within a row matches the order int4 weights unpack in: `order` 0 keeps it, 32 stores
// each block of 32 as its 16 even then 16 odd elements, 64 stores each block of 64 as the evens
// of its first 32, the evens of its second 32, then the odds of each.
inline int64_t permuted(int64_t i, int order) {
  if (order == 32) {
    const int64_t j = i % 32;
    return i - j + (j % 2) * 16 + j / 2;
  }
  if (order == 64) {
    const int64_t j = i % 64, jj = j % 32;
    return i - j + (jj % 2) * 32 + (j / 32) * 16 + jj / 2;
  }
  return i;
}

// A row's quantization step absmax / qmax, and its inverse into inv (0 for an all-zero row)
template <typename T>
inline float row_step(const T* xr, int64_t k, float qmax, float& inv) {
  int64_t i = 0;
  __m512 vmax = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(vload(xr + i)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; i < k; ++i) amax = std::max(amax, std::fabs(to_f32(xr[i])));
  inv = amax > 0.f ? qmax / amax : 0.f;
  return amax / qmax;
}

template <typename T>
void quantize_rows_i16(const T* x, int64_t rows, int64_t k, int64_t kp, int order, int16_t* q, float* scale) {
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = x + m * k;
    float inv;
    scale[m] = row_step(xr, k, 32767.f, inv);
    int16_t* qr = q + m * kp;
    for (int64_t i = 0; i < kp; ++i) {
      const int16_t v = i < k ? static_cast<int16_t>(std::nearbyint(to_f32(xr[i]) * inv)) : 0;
      qr[permuted(i, order)] = v;
    }
  }
}

constexpr int64_t kFlush = 1024;  // int32 partial sums go to float this often (no overflow)

// sums[o * R + r] for O outputs x R rows; reduces O*R vectors
template <int N>
inline void reduce_all(const __m512* v, float* out) {
  for (int j = 0; j < N; ++j) out[j] = _mm512_reduce_add_ps(v[j]);
}

// O weight rows (int8) x R input rows (int16): each weight chunk is loaded once for R rows,
// each input chunk once for O weight rows
template <int R, int O>
inline void tile_w8(const int16_t* xq, int64_t kp, const int8_t* w, int64_t k, float* sums) {
  static_assert(O == 1, "one weight row at a time");
  // four independent accumulator chains per row: vpdpwssd's latency, not its throughput,
  // bounds a single chain
  constexpr int C = 4;
  __m512 facc[R];
  for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
  const int64_t full = k / 32 * 32;
  for (int64_t b0 = 0; b0 < kp; b0 += kFlush) {
    const int64_t b1 = std::min(kp, b0 + kFlush);
    __m512i acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
    int64_t i = b0;
    for (; i + 32 * C <= b1 && i + 32 * C <= full; i += 32 * C) {
      for (int c = 0; c < C; ++c) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 32 * c)));
        for (int r = 0; r < R; ++r) acc[r][c] = dp16(acc[r][c], _mm512_loadu_si512(xq + r * kp + i + 32 * c), wv);
      }
    }
    for (; i < b1; i += 32) {
      const __m256i raw = i < full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i))
                                   : _mm256_maskz_loadu_epi8((1u << (k - i)) - 1, w + i);
      const __m512i wv = _mm512_cvtepi8_epi16(raw);
      for (int r = 0; r < R; ++r) acc[r][0] = dp16(acc[r][0], _mm512_loadu_si512(xq + r * kp + i), wv);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i total = _mm512_add_epi32(_mm512_add_epi32(acc[r][0], acc[r][1]),
                                             _mm512_add_epi32(acc[r][2], acc[r][3]));
      facc[r] = _mm512_add_ps(facc[r], _mm512_cvtepi32_ps(total));
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(facc[r]);
}

// one weight row after the other (see rows_w4); sums[(o - o0) * R + r]
template <int R>
inline void rows_w8(const int16_t* xq, int64_t kp, const int8_t* w, int64_t k, int64_t o0, int64_t o1,
                    float* sums) {
  for (int64_t o = o0; o < o1; ++o) tile_w8<R, 1>(xq, kp, w + o * k, k, sums + (o - o0) * R);
}

// The int16-activation GEMV driver: weight rows in tiles of 16 against the input rows four at a
// time; tile(R, m0, o0, o1, sums) fills sums[(o - o0) * R + r] for rows m0 + r, and
// out = sums * xs[m] * out_scale(o) + bias.
template <typename T, typename Tile, typename OutScale>
void tiles_i16(const T* bias, T* out, const float* xs, int64_t rows, int64_t n, Tile tile, OutScale out_scale) {
  at::parallel_for(0, (n + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    float sums[16 * 4];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * 16, o1 = std::min(n, o0 + 16);
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t mr = std::min<int64_t>(4, rows - m0);
        with_rows(mr, [&](auto R) { tile(R, m0, o0, o1, sums); });
        for (int64_t o = o0; o < o1; ++o) {
          const float b = bias ? to_f32(bias[o]) : 0.f, so = out_scale(o);
          for (int64_t r = 0; r < mr; ++r)
            store_as(out + (m0 + r) * n + o, sums[(o - o0) * mr + r] * xs[m0 + r] * so + b);
        }
      }
    }
  });
}

template <typename T>
void linear_w8_i16(const T* x, const int8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                   int64_t k, int64_t n) {
  const int64_t kp = (k + 31) / 32 * 32;
  std::vector<int16_t> xq(rows * kp);
  std::vector<float> xs(rows);
  quantize_rows_i16(x, rows, k, kp, 0, xq.data(), xs.data());
  tiles_i16(bias, out, xs.data(), rows, n, [&](auto R, int64_t m0, int64_t o0, int64_t o1, float* sums) {
    rows_w8<decltype(R)::value>(xq.data() + m0 * kp, kp, w, k, o0, o1, sums);
  }, [&](int64_t o) { return scale[o]; });
}

// Each input row quantized to 15 bits (absmax / 16383) and split into two int8 planes,
// q = 256 * h + l (l in [-128, 127], h in [-64, 64]), for vpdpbusd (u8 x s8) kernels.
template <typename T>
void split_rows_i8(const T* x, int64_t rows, int64_t k, int64_t kp, int64_t group, int8_t* hi, int8_t* lo,
                   float* scale, int32_t* hsum, int32_t* lsum) {
  const int64_t groups = (kp + group - 1) / group;  // hsum / lsum [rows, groups]: the planes' sums per group
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = x + m * k;
    float inv;
    scale[m] = row_step(xr, k, 16383.f, inv);
    for (int64_t g = 0; g < groups; ++g) hsum[m * groups + g] = lsum[m * groups + g] = 0;
    int64_t i = 0;
    if (group % 16 == 0) {  // 16 at a time (nearest-even conversion, as nearbyint); a chunk is in one group
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; i + 16 <= k; i += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(vload(xr + i), vinv));
        const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, _mm512_set1_epi32(128)),
                                                            _mm512_set1_epi32(255)), _mm512_set1_epi32(128));
        const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(q, l), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + m * kp + i), _mm512_cvtepi32_epi8(h));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + m * kp + i), _mm512_cvtepi32_epi8(l));
        hsum[m * groups + i / group] += _mm512_reduce_add_epi32(h);
        lsum[m * groups + i / group] += _mm512_reduce_add_epi32(l);
      }
    }
    for (; i < kp; ++i) {
      const int q = i < k ? static_cast<int>(std::nearbyint(to_f32(xr[i]) * inv)) : 0;
      const int l = ((q + 128) & 255) - 128;
      const int h = (q - l) / 256;
      hi[m * kp + i] = static_cast<int8_t>(h);
      lo[m * kp + i] = static_cast<int8_t>(l);
      hsum[m * groups + i / group] += h;
      lsum[m * groups + i / group] += l;
    }
  }
}

#if defined(KILN_ISA_VNNI)
// W8A16 with VNNI bytes: each input row split into two int8 planes (split_rows_i8); the int8 weights, offset
// to u8 by + 128 (one XOR), meet each plane with vpdpbusd: 64 multiply-adds per instruction and
// no widening, half the instructions of the int16 path, so the GEMV keeps up with memory. The
// offset is taken off exactly in the integer domain (128 * sum of the plane). Rows shorter than
// kVnniBytesMinK keep the int16 path: their per-row reductions (two planes) cost more than the
// instructions saved (measured one thread: k 576 / 1536 int16 1.2x faster; k 2048 - 8192 this
// path 1.15-1.5x faster, at memory bandwidth for 8192 x 8192; benchmarks/ablations/gemv_shapes.py).
constexpr int64_t kVnniBytesMinK = 2048;

// R input rows (two planes each) against one int8 weight row; sums[r] = the exact integer dot
// product of the row with the 15-bit input row r, as float
template <int R>
inline void dot_rows_w8_vnni(const int8_t* hi, const int8_t* lo, int64_t kp, const int32_t* hsum,
                             const int32_t* lsum, const int8_t* w, int64_t k, float* sums) {
  constexpr int C = R == 1 ? 2 : 1;  // independent chains per plane: vpdpbusd's latency
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i ah[R][C], al[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) ah[r][c] = al[r][c] = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 * C <= k; i += 64 * C) {
    for (int c = 0; c < C; ++c) {
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(w + i + 64 * c), flip);
      for (int r = 0; r < R; ++r) {
        ah[r][c] = _mm512_dpbusd_epi32(ah[r][c], wv, _mm512_loadu_si512(hi + r * kp + i + 64 * c));
        al[r][c] = _mm512_dpbusd_epi32(al[r][c], wv, _mm512_loadu_si512(lo + r * kp + i + 64 * c));
      }
    }
  }
  for (; i < k; i += 64) {  // the tail: weights past k read as 0 (x planes are zero there)
    const __mmask64 mask = k - i >= 64 ? ~0ull : (1ull << (k - i)) - 1;
    const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + i), flip);
    for (int r = 0; r < R; ++r) {
      ah[r][0] = _mm512_dpbusd_epi32(ah[r][0], wv, _mm512_loadu_si512(hi + r * kp + i));
      al[r][0] = _mm512_dpbusd_epi32(al[r][0], wv, _mm512_loadu_si512(lo + r * kp + i));
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512i h = ah[r][0], l = al[r][0];
    for (int c = 1; c < C; ++c) {
      h = _mm512_add_epi32(h, ah[r][c]);
      l = _mm512_add_epi32(l, al[r][c]);
    }
    const int32_t th = _mm512_reduce_add_epi32(h) - 128 * hsum[r];
    const int32_t tl = _mm512_reduce_add_epi32(l) - 128 * lsum[r];
    sums[r] = static_cast<float>(th) * 256.f + static_cast<float>(tl);
  }
}

template <typename T>
void linear_w8_vnni(const T* x, const int8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                    int64_t k, int64_t n) {
  if (k < kVnniBytesMinK) return linear_w8_i16(x, w, scale, bias, out, rows, k, n);
  const int64_t kp = (k + 63) / 64 * 64;
  std::vector<int8_t> hi(rows * kp), lo(rows * kp);
  std::vector<float> xs(rows);
  std::vector<int32_t> hsum(rows), lsum(rows);
  split_rows_i8(x, rows, k, kp, kp, hi.data(), lo.data(), xs.data(), hsum.data(), lsum.data());
  tiles_i16(bias, out, xs.data(), rows, n, [&](auto R, int64_t m0, int64_t o0, int64_t o1, float* sums) {
    constexpr int r = decltype(R)::value;
    for (int64_t o = o0; o < o1; ++o)
      dot_rows_w8_vnni<r>(hi.data() + m0 * kp, lo.data() + m0 * kp, kp, hsum.data() + m0, lsum.data() + m0,
                          w + o * k, k, sums + (o - o0) * r);
  }, [&](int64_t o) { return scale[o]; });
}
#endif

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
  const int64_t k = row_bytes * 2;
  __m512 facc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (int64_t i = g0; i < g1; i += 64) {
      const __m512i x_lo = _mm512_loadu_si512(xq + i), x_hi = _mm512_loadu_si512(xq + i + 32);
      for (int r = 0; r < 4; ++r) {
        const __m512i bytes =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + i / 2)));
        acc[r] = dp16(acc[r], x_lo, _mm512_and_si512(bytes, nib));
        acc[r] = dp16(acc[r], x_hi, _mm512_srli_epi16(bytes, 4));
      }
    }
    const __m512i offset = _mm512_maskz_set1_epi32(1, xsum8[g]);
    for (int r = 0; r < 4; ++r)
      facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], offset)),
                                _mm512_set1_ps(scale[r * groups + g]), facc[r]);
  }
  for (int r = 0; r < 4; ++r) sums[r] = _mm512_reduce_add_ps(facc[r]);
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
  quantize_rows_i16(x, rows, k, kp, wide ? 64 : 32, xq.data(), xs.data());
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

// --- int4, tiled for decode -------------------------------------------------------------
// linear_w4_tiled streams the int4 weights in a layout made for it when an engine loads
// (pack_int4_tiled, from the stored [out, in / 2] rows): output rows in tiles of 16, tiles in
// groups of up to kTileGroup (the last group may hold fewer), each group's bytes contiguous.
// For every block b of 8 inputs a group holds one 64-byte vector per tile: 16 rows x 4 bytes,
// byte j of row r = q[r][8b + j] | q[r][8b + 4 + j] << 4 (q the stored nibbles, value + 8).
// One vpdpbusd multiplies the 16 rows by four inputs broadcast to every lane, so nothing is
// reduced across lanes, a group's int32 sums go to float once per 16 rows, and the weights are
// read as one sequential stream. The scales follow the same order: per group of inputs, 16
// floats per tile. (One thread, weights in cache: 2.3-2.6x the row-layout kernel on SmolLM2's
// and 7B shapes, benchmarks/ablations/gemv_shapes.py; docs/benchmarks.md has the in-model steps.)
constexpr int64_t kTileRows = 16, kTileGroup = 4;
constexpr int64_t kTiledMaxGroup = 8192;  // 15 * 16383 * group stays within int32

struct TiledLayout {  // where row o's bytes and scales sit: kb blocks of inputs, one 64-byte vector each per tile
  int64_t kb, groups, tiles;
  int64_t width(int64_t t0) const { return std::min(kTileGroup, tiles - t0); }  // tiles in the group from t0
  int64_t byte(int64_t o, int64_t b, int64_t j) const {  // row o, block b, byte j
    const int64_t t = o / kTileRows, t0 = t / kTileGroup * kTileGroup;
    return ((t0 * kb + b * width(t0) + t - t0) * kTileRows + o % kTileRows) * 4 + j;
  }
  int64_t scale(int64_t o, int64_t g) const {  // row o, group g
    const int64_t t = o / kTileRows, t0 = t / kTileGroup * kTileGroup;
    return (t0 * groups + g * width(t0) + t - t0) * kTileRows + o % kTileRows;
  }
};

inline TiledLayout tiled_int4_layout(int64_t k, int64_t n, int64_t group) {  // blocks of 8 inputs
  return {k / 8, (k + group - 1) / group, n / kTileRows};
}

inline int stored_nibble(const uint8_t* row, int64_t i) { return (i & 1) ? row[i >> 1] >> 4 : row[i >> 1] & 0x0F; }

inline int tiled_nibble(const uint8_t* w, const TiledLayout& L, int64_t o, int64_t i) {
  const uint8_t byte = w[L.byte(o, i / 8, i % 4)];
  return (i % 8) < 4 ? byte & 0x0F : byte >> 4;
}

inline void pack_int4_tiled(const uint8_t* w, const float* s, int64_t group, uint8_t* pw, float* ps, int64_t k,
                            int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* row = w + o * (k / 2);
      for (int64_t b = 0; b < L.kb; ++b)
        for (int64_t j = 0; j < 4; ++j)
          pw[L.byte(o, b, j)] = static_cast<uint8_t>(stored_nibble(row, 8 * b + j) | stored_nibble(row, 8 * b + 4 + j) << 4);
      for (int64_t g = 0; g < L.groups; ++g) ps[L.scale(o, g)] = s[o * L.groups + g];
    }
  });
}

// The reference path (scalar / AVX2): float inputs, one group at a time, as linear_w4_impl
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
// u8 x s8 products summed by fours into int32 lanes (the emulation is exact here: the weights
// are nibbles, so vpmaddubsw's int16 pairs cannot saturate)
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
#if defined(KILN_ISA_VNNI)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

inline __m512i broadcast4(const int8_t* p) {  // four int8 inputs into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

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

// The tiled GEMVs' driver: tile groups in parallel, input rows four at a time. One row (decode):
// the group's U tiles side by side, one stream (tiles(R = 1, V = U, u0 = 0)); more rows: tile by
// tile (V = 1). tiles(R, V, t0, U, u0, m0, acc) fills acc[v * R + r] for tiles t0 + u0 + v and
// input rows m0 + r (R and V as std::integral_constant); row(m, o0, acc, sums) turns one
// accumulator into the 16 outputs of row m from o0 (before the bias), which is added here.
template <typename T, typename Tiles, typename Row>
void tiled_gemv(const TiledLayout& L, const T* bias, T* out, int64_t rows, int64_t n, Tiles tiles, Row row) {
  at::parallel_for(0, (L.tiles + kTileGroup - 1) / kTileGroup, 1, [&](int64_t begin, int64_t end) {
    __m512 acc[kTileGroup * 4];
    float sums[kTileRows];
    for (int64_t tg = begin; tg < end; ++tg) {
      const int64_t t0 = tg * kTileGroup, U = L.width(t0);
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t mr = std::min<int64_t>(4, rows - m0);
        auto emit = [&](int64_t V, int64_t R, int64_t u0) {
          for (int64_t v = 0; v < V; ++v)
            for (int64_t r = 0; r < R; ++r) {
              const int64_t o0 = (t0 + u0 + v) * kTileRows;
              row(m0 + r, o0, acc[v * R + r], sums);
              for (int64_t j = 0; j < kTileRows; ++j)
                store_as(out + (m0 + r) * n + o0 + j, sums[j] + (bias ? to_f32(bias[o0 + j]) : 0.f));
            }
        };
        using One = std::integral_constant<int, 1>;
        if (mr == 1) {
          switch (U) {
            case 4: tiles(One{}, std::integral_constant<int, 4>{}, t0, U, 0, m0, acc); break;
            case 3: tiles(One{}, std::integral_constant<int, 3>{}, t0, U, 0, m0, acc); break;
            case 2: tiles(One{}, std::integral_constant<int, 2>{}, t0, U, 0, m0, acc); break;
            default: tiles(One{}, One{}, t0, U, 0, m0, acc);
          }
          emit(U, 1, 0);
        } else {
          for (int64_t u0 = 0; u0 < U; ++u0)
            with_rows(mr, [&](auto R) {
              tiles(R, One{}, t0, U, u0, m0, acc);
              emit(1, decltype(R)::value, u0);
            });
        }
      }
    }
  });
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
#endif

template <typename T>
void linear_w4_tiled_impl(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                          int64_t rows, int64_t k, int64_t n) {
#if defined(KILN_ISA_AVX512)
  linear_w4_tiled_avx512<T>(x, w, s, group, bias, out, rows, k, n);
#else
  linear_w4_tiled_ref<T>(x, w, s, group, bias, out, rows, k, n);
#endif
}

#if defined(KILN_ISA_AVX512)
// 16 floats -> 16 bf16, rounded to nearest even (as c10::BFloat16; the values are finite)
inline __m256i bf16x16(__m512 v) {
#if defined(KILN_ISA_AVX512BF16)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
#endif
}

// lanes [8j, 8j + 8) of v to row j (j = 0, 1) at base + j * stride
inline void store_rows2(float* base, int64_t stride, __m512 v) {
  _mm256_storeu_ps(base, _mm512_castps512_ps256(v));
  _mm256_storeu_ps(base + stride, _mm512_extractf32x8_ps(v, 1));
}
inline void store_rows2(bf16* base, int64_t stride, __m512 v) {
  const __m256i b = bf16x16(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(base), _mm256_castsi256_si128(b));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(base + stride), _mm256_extracti128_si256(b, 1));
}
// lanes [4j, 4j + 4) of v to row j (j = 0..3)
inline void store_rows4(float* base, int64_t stride, __m512 v) {
  _mm_storeu_ps(base, _mm512_castps512_ps128(v));
  _mm_storeu_ps(base + stride, _mm512_extractf32x4_ps(v, 1));
  _mm_storeu_ps(base + 2 * stride, _mm512_extractf32x4_ps(v, 2));
  _mm_storeu_ps(base + 3 * stride, _mm512_extractf32x4_ps(v, 3));
}
inline void store_rows4(bf16* base, int64_t stride, __m512 v) {
  const __m256i b = bf16x16(v);
  const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(base), lo);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(base + stride), _mm_unpackhi_epi64(lo, lo));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(base + 2 * stride), hi);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(base + 3 * stride), _mm_unpackhi_epi64(hi, hi));
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

// The tiled int4 weights back to rows of T (prefill multiplies them with PyTorch's GEMM)
template <typename T>
void dequantize_int4_tiled_impl(const uint8_t* w, const float* s, int64_t group, T* out, int64_t k, int64_t n) {
#if defined(KILN_ISA_AVX512)
  dequantize_int4_tiled_avx512<T>(w, s, group, out, k, n);
#else
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
#endif
}

// --- int8, tiled for decode -------------------------------------------------------------
// The int4 tiling for int8 weights (pack_int8_tiled at load): blocks of 4 inputs, one 64-byte
// vector per tile (16 rows x 4 bytes, stored + 128 so that vpdpbusd reads them as unsigned),
// tiles in groups of four, the per-row scales as stored. Each of the input's two 15-bit planes
// meets a vector with one vpdpbusd (64 multiply-adds); the + 128 comes off once per row as
// 128 * sum(q). int32 sums go to float every kTiled8Flush blocks (4,096 inputs).
constexpr int64_t kTiled8Flush = 1024;

inline TiledLayout tiled_int8_layout(int64_t k, int64_t n) {  // blocks of 4 inputs, one group (per-row scales)
  return {k / 4, 1, n / kTileRows};
}

inline void pack_int8_tiled(const int8_t* w, uint8_t* pw, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t b = 0; b < L.kb; ++b)
        for (int64_t j = 0; j < 4; ++j) pw[L.byte(o, b, j)] = static_cast<uint8_t>(w[o * k + 4 * b + j] + 128);
  });
}

inline int tiled_int8_at(const uint8_t* w, const TiledLayout& L, int64_t o, int64_t i) {
  return static_cast<int>(w[L.byte(o, i / 4, i % 4)]) - 128;
}

template <typename T>
void linear_w8_tiled_ref(const T* x, const uint8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                         int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
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

template <typename T>
void linear_w8_tiled_impl(const T* x, const uint8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                          int64_t k, int64_t n) {
#if defined(KILN_ISA_AVX512)
  linear_w8_tiled_avx512<T>(x, w, scale, bias, out, rows, k, n);
#else
  linear_w8_tiled_ref<T>(x, w, scale, bias, out, rows, k, n);
#endif
}

#if defined(KILN_ISA_AVX512)
// int8: a vector's 16 bytes q hold rows 4q .. 4q + 3, four inputs each
template <typename T>
void dequantize_int8_tiled_avx512(const uint8_t* w, const float* scale, T* out, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  at::parallel_for(0, (L.tiles + kTileGroup - 1) / kTileGroup, 1, [&](int64_t begin, int64_t end) {
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

// The tiled int8 weights back to rows of T (prefill)
template <typename T>
void dequantize_int8_tiled_impl(const uint8_t* w, const float* scale, T* out, int64_t k, int64_t n) {
#if defined(KILN_ISA_AVX512)
  dequantize_int8_tiled_avx512<T>(w, scale, out, k, n);
#else
  const TiledLayout L = tiled_int8_layout(k, n);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      T* orow = out + o * k;
      const float s = scale[o];
      for (int64_t i = 0; i < k; ++i) store_as(orow + i, static_cast<float>(tiled_int8_at(w, L, o, i)) * s);
    }
  });
#endif
}

// --- W4A8 -------------------------------------------------------------------------------
// int4 weights (as above) x int8 activations quantized per row *and group* at run time (absmax
// / 127 of each group of the row: an outlier only coarsens its own group). With VNNI the
// nibbles are used as unsigned bytes directly (vpdpbusd: 64 multiply-adds per instruction) and
// 8 * sum(x) of the group is taken off. x is stored per 64-block as its 32 even then 32 odd
// elements, the order the low and high nibbles of 32 bytes come in.
template <typename T>
void quantize_groups_i8(const T* x, int64_t rows, int64_t k, int64_t group, bool permute64, int8_t* q,
                        float* scale, int32_t* qsum) {
  const int64_t groups = (k + group - 1) / group;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
      float amax = 0.f;
      for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(to_f32(x[m * k + i])));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      scale[m * groups + g] = amax / 127.f;
      int32_t total = 0;
      for (int64_t i = g0; i < g1; ++i) {
        const int v = static_cast<int>(std::nearbyint(to_f32(x[m * k + i]) * inv));
        const int8_t c = static_cast<int8_t>(std::min(127, std::max(-127, v)));
        total += c;
        int64_t at = i;
        if (permute64) {
          const int64_t j = i % 64;
          at = i - j + (j % 2) * 32 + j / 2;
        }
        q[m * k + at] = c;
      }
      qsum[m * groups + g] = total;
    }
  }
}

template <typename T>
void linear_w4a8_impl(const T* x, const uint8_t* w, const float* scale, int64_t group, const T* bias, T* out,
                      int64_t rows, int64_t k, int64_t n) {
  const int64_t row_bytes = k / 2, groups = (k + group - 1) / group;
#if defined(KILN_ISA_VNNI)
  const bool fast = k % 64 == 0 && group % 64 == 0;
#else
  const bool fast = false;
#endif
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows * groups);
  std::vector<int32_t> xsum(rows * groups);
  quantize_groups_i8(x, rows, k, group, fast, xq.data(), xs.data(), xsum.data());
#if defined(KILN_ISA_VNNI)
  // four weight rows side by side: four independent chains (one row alone is latency-bound)
  auto four_rows = [&](int64_t o, int64_t m, float* totals) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const int8_t* xr = xq.data() + m * k;
    __m512 facc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
      __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                        _mm512_setzero_si512()};
      for (int64_t i = g0; i < g1; i += 64) {
        const __m512i xv = _mm512_loadu_si512(xr + i);
        for (int r = 0; r < 4; ++r) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (o + r) * row_bytes + i / 2));
          const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nib)),
                                               _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib), 1);
          acc[r] = _mm512_dpbusd_epi32(acc[r], u, xv);
        }
      }
      const __m512i offset = _mm512_maskz_set1_epi32(1, 8 * xsum[m * groups + g]);
      const float xsg = xs[m * groups + g];
      for (int r = 0; r < 4; ++r)
        facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], offset)),
                                  _mm512_set1_ps(scale[(o + r) * groups + g] * xsg), facc[r]);
    }
    for (int r = 0; r < 4; ++r) totals[r] = _mm512_reduce_add_ps(facc[r]);
  };
#endif
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
#if defined(KILN_ISA_VNNI)
    if (fast) {
      float totals[4];
      for (; o + 4 <= end; o += 4)
        for (int64_t m = 0; m < rows; ++m) {
          four_rows(o, m, totals);
          for (int r = 0; r < 4; ++r) store_as(out + m * n + o + r, totals[r] + (bias ? to_f32(bias[o + r]) : 0.f));
        }
    }
#endif
    for (; o < end; ++o) {
      const uint8_t* wrow = w + o * row_bytes;
      const float* srow = scale + o * groups;
      const float b = bias ? to_f32(bias[o]) : 0.f;
      for (int64_t m = 0; m < rows; ++m) {
        const int8_t* xr = xq.data() + m * k;
        float total = 0.f;
#if defined(KILN_ISA_VNNI)
        if (fast) {
          const __m256i nib = _mm256_set1_epi8(0x0F);
          __m512 facc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
          auto group_sum = [&](int64_t g) {  // one group's centred int32 dot products, as floats
            const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
            __m512i acc = _mm512_setzero_si512();
            for (int64_t i = g0; i < g1; i += 64) {
              const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + i / 2));
              const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nib)),
                                                   _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib), 1);
              acc = _mm512_dpbusd_epi32(acc, u, _mm512_loadu_si512(xr + i));
            }
            return _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_maskz_set1_epi32(1, 8 * xsum[m * groups + g])));
          };
          int64_t g = 0;
          for (; g + 2 <= groups; g += 2) {  // two independent chains
            facc[0] = _mm512_fmadd_ps(group_sum(g), _mm512_set1_ps(srow[g] * xs[m * groups + g]), facc[0]);
            facc[1] = _mm512_fmadd_ps(group_sum(g + 1), _mm512_set1_ps(srow[g + 1] * xs[m * groups + g + 1]), facc[1]);
          }
          if (g < groups) facc[0] = _mm512_fmadd_ps(group_sum(g), _mm512_set1_ps(srow[g] * xs[m * groups + g]), facc[0]);
          const __m512 facc_total = _mm512_add_ps(facc[0], facc[1]);
          total = _mm512_reduce_add_ps(facc_total);
        } else
#endif
        {
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
            int32_t acc = 0;
            for (int64_t i = g0; i < g1; ++i) acc += int4_at(wrow, i) * static_cast<int32_t>(xr[i]);
            total += static_cast<float>(acc) * srow[g] * xs[m * groups + g];
          }
        }
        store_as(out + m * n + o, total + b);
      }
    }
  });
}

// W4A8 on the tiled int4 layout: the input quantized per row and group (as above), one int8
// plane against the nibbles (tiles_w4t<.., true>), the group's input scale times the weight
// scales per group.
template <typename T>
void linear_w4a8_tiled_impl(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                            int64_t rows, int64_t k, int64_t n) {
  const int64_t groups = (k + group - 1) / group;
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows * groups);
  std::vector<int32_t> xsum(rows * groups);
  quantize_groups_i8(x, rows, k, group, false, xq.data(), xs.data(), xsum.data());
#if defined(KILN_ISA_AVX512)
  for (auto& v : xsum) v *= 8;  // the nibbles' + 8
  tiled_w4_rows<true>(nullptr, xq.data(), xsum.data(), xs.data(), nullptr, w, s, group, bias, out, rows, k, n);
#else
  const TiledLayout L = tiled_int4_layout(k, n, group);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t m = 0; m < rows; ++m) {
        float total = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t acc = 0;
          for (int64_t i = g * group; i < std::min(k, (g + 1) * group); ++i)
            acc += (tiled_nibble(w, L, o, i) - 8) * static_cast<int32_t>(xq[m * k + i]);
          total += static_cast<float>(acc) * (s[L.scale(o, g)] * xs[m * groups + g]);
        }
        store_as(out + m * n + o, total + (bias ? to_f32(bias[o]) : 0.f));
      }
  });
#endif
}

void linear_w4a8_tiled_f32(const float* x, const uint8_t* w, const float* s, int64_t g, const float* b, float* o,
                           int64_t r, int64_t k, int64_t n) { linear_w4a8_tiled_impl<float>(x, w, s, g, b, o, r, k, n); }
void linear_w4a8_tiled_bf16(const bf16* x, const uint8_t* w, const float* s, int64_t g, const bf16* b, bf16* o,
                            int64_t r, int64_t k, int64_t n) { linear_w4a8_tiled_impl<bf16>(x, w, s, g, b, o, r, k, n); }
void linear_w4a8_f32(const float* x, const uint8_t* w, const float* s, int64_t g, const float* b, float* o, int64_t r,
                     int64_t k, int64_t n) { linear_w4a8_impl<float>(x, w, s, g, b, o, r, k, n); }
void linear_w4a8_bf16(const bf16* x, const uint8_t* w, const float* s, int64_t g, const bf16* b, bf16* o, int64_t r,
                      int64_t k, int64_t n) { linear_w4a8_impl<bf16>(x, w, s, g, b, o, r, k, n); }

#if defined(KILN_ISA_VNNI)
#define KILN_W8 linear_w8_vnni
#elif defined(KILN_ISA_AVX512)
#define KILN_W8 linear_w8_i16
#else
#define KILN_W8 linear_w8_impl
#endif
#if defined(KILN_ISA_AVX512)
#define KILN_W4_FAST(k, g) ((k) % 32 == 0 && (g) % 32 == 0)
#else
#define KILN_W4_FAST(k, g) false
#endif
void linear_w8_f32(const float* x, const int8_t* w, const float* s, const float* b, float* o, int64_t r, int64_t k,
                   int64_t n) { KILN_W8<float>(x, w, s, b, o, r, k, n); }
void linear_w8_bf16(const bf16* x, const int8_t* w, const float* s, const bf16* b, bf16* o, int64_t r, int64_t k,
                    int64_t n) { KILN_W8<bf16>(x, w, s, b, o, r, k, n); }
template <typename T>
void linear_w4_any(const T* x, const uint8_t* w, const float* s, int64_t g, const T* b, T* o, int64_t r, int64_t k,
                   int64_t n) {
#if defined(KILN_ISA_AVX512)
  if (KILN_W4_FAST(k, g)) return linear_w4_i16<T>(x, w, s, g, b, o, r, k, n);
#endif
  linear_w4_impl<T>(x, w, s, g, b, o, r, k, n);
}
void linear_w4_f32(const float* x, const uint8_t* w, const float* s, int64_t g, const float* b, float* o, int64_t r,
                   int64_t k, int64_t n) { linear_w4_any<float>(x, w, s, g, b, o, r, k, n); }
void linear_w4_bf16(const bf16* x, const uint8_t* w, const float* s, int64_t g, const bf16* b, bf16* o, int64_t r,
                    int64_t k, int64_t n) { linear_w4_any<bf16>(x, w, s, g, b, o, r, k, n); }
#undef KILN_W8
#undef KILN_W4_FAST
void linear_w4_tiled_f32(const float* x, const uint8_t* w, const float* s, int64_t g, const float* b, float* o,
                         int64_t r, int64_t k, int64_t n) { linear_w4_tiled_impl<float>(x, w, s, g, b, o, r, k, n); }
void linear_w4_tiled_bf16(const bf16* x, const uint8_t* w, const float* s, int64_t g, const bf16* b, bf16* o,
                          int64_t r, int64_t k, int64_t n) { linear_w4_tiled_impl<bf16>(x, w, s, g, b, o, r, k, n); }
void dequantize_int8_tiled_f32(const uint8_t* w, const float* s, float* o, int64_t k, int64_t n) {
  dequantize_int8_tiled_impl<float>(w, s, o, k, n);
}
void dequantize_int8_tiled_bf16(const uint8_t* w, const float* s, bf16* o, int64_t k, int64_t n) {
  dequantize_int8_tiled_impl<bf16>(w, s, o, k, n);
}
void linear_w8_tiled_f32(const float* x, const uint8_t* w, const float* s, const float* b, float* o, int64_t r,
                         int64_t k, int64_t n) { linear_w8_tiled_impl<float>(x, w, s, b, o, r, k, n); }
void linear_w8_tiled_bf16(const bf16* x, const uint8_t* w, const float* s, const bf16* b, bf16* o, int64_t r,
                          int64_t k, int64_t n) { linear_w8_tiled_impl<bf16>(x, w, s, b, o, r, k, n); }
void dequantize_int4_tiled_f32(const uint8_t* w, const float* s, int64_t g, float* o, int64_t k, int64_t n) {
  dequantize_int4_tiled_impl<float>(w, s, g, o, k, n);
}
void dequantize_int4_tiled_bf16(const uint8_t* w, const float* s, int64_t g, bf16* o, int64_t k, int64_t n) {
  dequantize_int4_tiled_impl<bf16>(w, s, g, o, k, n);
}
void dequantize_int4_f32(const uint8_t* w, const float* s, int64_t g, float* o, int64_t k, int64_t n) {
  dequantize_int4_impl<float>(w, s, g, o, k, n);
}
void dequantize_int4_bf16(const uint8_t* w, const float* s, int64_t g, bf16* o, int64_t k, int64_t n) {
  dequantize_int4_impl<bf16>(w, s, g, o, k, n);
}
void linear_w8a8_f32(const float* x, const int8_t* w, const float* s, const int32_t* ws, float xs, const float* b,
                     float* o, int64_t r, int64_t k, int64_t n) { linear_w8a8_impl<float>(x, w, s, ws, xs, b, o, r, k, n); }
void linear_w8a8_bf16(const bf16* x, const int8_t* w, const float* s, const int32_t* ws, float xs, const bf16* b,
                      bf16* o, int64_t r, int64_t k, int64_t n) { linear_w8a8_impl<bf16>(x, w, s, ws, xs, b, o, r, k, n); }

// --- FP8 (E4M3; round_fp8 and the loads are in vec.h) -----------------------------------
template <typename T>
void quantize_fp8_impl(const T* x, T* out, int64_t count, float inv_scale) {
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
void dequantize_fp8_impl(const uint8_t* w, T* out, int64_t count) {
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
void linear_fp8_impl(const T* x, const uint8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                     int64_t k, int64_t n) {
  gemv_float_rows(x, bias, out, rows, k, n, [&](auto R, const float* xr, int64_t o, float* sums) {
    dot_rows_bytes<decltype(R)::value>(xr, k, reinterpret_cast<const fp8e4m3*>(w + o * k), sums);
    for (int r = 0; r < R; ++r) sums[r] *= scale[o];
  });
}

void linear_fp8_f32(const float* x, const uint8_t* w, const float* s, const float* b, float* o, int64_t r, int64_t k,
                    int64_t n) { linear_fp8_impl<float>(x, w, s, b, o, r, k, n); }
void linear_fp8_bf16(const bf16* x, const uint8_t* w, const float* s, const bf16* b, bf16* o, int64_t r, int64_t k,
                     int64_t n) {
#if defined(KILN_ISA_AVX512BF16)
  linear_fp8_dp(x, w, s, b, o, r, k, n);
#else
  linear_fp8_impl<bf16>(x, w, s, b, o, r, k, n);
#endif
}
void dequantize_fp8_f32(const uint8_t* w, float* o, int64_t count) { dequantize_fp8_impl<float>(w, o, count); }
void dequantize_fp8_bf16(const uint8_t* w, bf16* o, int64_t count) { dequantize_fp8_impl<bf16>(w, o, count); }
void quantize_fp8_f32(const float* x, float* o, int64_t count, float inv) { quantize_fp8_impl<float>(x, o, count, inv); }
void quantize_fp8_bf16(const bf16* x, bf16* o, int64_t count, float inv) { quantize_fp8_impl<bf16>(x, o, count, inv); }
