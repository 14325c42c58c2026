// SmoothQuant W8A8: int8 weights [out, in] with one scale per output channel, the activations
// quantized per row to int8 at run time (absmax / 127), int8 x int8 -> int32 dot products
// (VNNI vpdpbusd on CPUs with it, 512- or 256-bit (AVX-VNNI): u8 x s8, so x is offset by 128 and
// 128 * rowsum(W) taken off;
// vpmaddwd on int16-widened bytes otherwise), then * x_scale[m] * w_scale[n]. With
// input_scale > 0 the activations use that one static scale instead (Model Optimizer's
// W8A8_SQ_PER_CHANNEL). Included per ISA inside kiln::<isa> after gemv.h.
//
// Quantize one row to u8 = round(x / s) + 128 with s = absmax / 127 (0 for an all-zero row), a
// vector at a time where the ISA has them (the same float products, rounded to nearest even and
// clamped to integers: the same bytes; a NaN input counts for nothing in absmax and goes to the
// lowest value, as std::max leaves it)
template <typename T>
float quantize_row_u8(const T* x, uint8_t* q, int64_t k, float static_scale) {
  float amax = 0.f;
  int64_t i = 0;
  if (static_scale <= 0.f) {
#if defined(KILN_ISA_AVX512)
    __m512 m = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) m = _mm512_max_ps(_mm512_abs_ps(vload(x + i)), m);  // NaN: keeps m
    amax = _mm512_reduce_max_ps(m);
#elif !defined(KILN_ISA_SCALAR)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) m = _mm256_max_ps(_mm256_and_ps(vload(x + i), magnitude), m);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (float v : lanes) amax = std::max(amax, v);
#endif
    for (; i < k; ++i) amax = std::max(amax, std::fabs(to_f32(x[i])));
  }
  const float s = static_scale > 0.f ? static_scale : amax / 127.f;
  const float inv = static_scale > 0.f ? 1.f / static_scale : amax > 0.f ? 127.f / amax : 0.f;
  const float lowest = static_scale > 0.f ? -128.f : -127.f;  // static: the full int8 range, as Model Optimizer
  i = 0;
#if defined(KILN_ISA_AVX512)
  const __m512 vinv = _mm512_set1_ps(inv), vlow = _mm512_set1_ps(lowest), vhigh = _mm512_set1_ps(127.f);
  for (; i + 16 <= k; i += 16) {  // clamped to integers, then rounded: as rounded, then clamped
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(vload(x + i), vinv), vlow), vhigh);
    const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_xor_si128(bytes, _mm_set1_epi8(-128)));  // + 128
  }
#elif !defined(KILN_ISA_SCALAR)
  const __m256 vinv = _mm256_set1_ps(inv), vlow = _mm256_set1_ps(lowest), vhigh = _mm256_set1_ps(127.f);
  for (; i + 8 <= k; i += 8) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(vload(x + i), vinv), vlow), vhigh);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i),
                     _mm_xor_si128(pack8_i8(_mm256_cvtps_epi32(v)), _mm_set1_epi8(-128)));
  }
#endif
  for (; i < k; ++i) {
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

// The 8 dot products of 2 activation rows (u8) with 4 consecutive weight rows (s8, row length k)
// at once, out[r * 4 + j] = dot_u8s8(a_r, b_j): each vector loaded (and widened) serves 4 or 2 of
// them, where pair by pair each serves one. Exact int32 sums, so the same values in any order.
inline void dot_u8s8_2x4(const uint8_t* a0, const uint8_t* a1, const int8_t* b, int64_t k, int32_t* out) {
  const uint8_t* a[2] = {a0, a1};
  int64_t i = 0;
#if defined(KILN_ISA_VNNI)
  __m512i acc[2][4];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_si512();
  for (; i < k; i += 64) {  // the last block masked, as dot_u8s8's
    const __mmask64 m = (k - i) >= 64 ? ~0ULL : ((1ULL << (k - i)) - 1);
    const __m512i x0 = _mm512_maskz_loadu_epi8(m, a0 + i), x1 = _mm512_maskz_loadu_epi8(m, a1 + i);
    for (int j = 0; j < 4; ++j) {
      const __m512i w = _mm512_maskz_loadu_epi8(m, b + j * k + i);
      acc[0][j] = _mm512_dpbusd_epi32(acc[0][j], x0, w);
      acc[1][j] = _mm512_dpbusd_epi32(acc[1][j], x1, w);
    }
  }
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 4; ++j) out[r * 4 + j] = _mm512_reduce_add_epi32(acc[r][j]);
#elif defined(KILN_ISA_AVX512)
  __m512i acc[2][4];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_si512();
  for (; i + 32 <= k; i += 32) {
    const __m512i x0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a0 + i)));
    const __m512i x1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a1 + i)));
    for (int j = 0; j < 4; ++j) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j * k + i)));
      acc[0][j] = _mm512_add_epi32(acc[0][j], _mm512_madd_epi16(x0, w));
      acc[1][j] = _mm512_add_epi32(acc[1][j], _mm512_madd_epi16(x1, w));
    }
  }
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 4; ++j) out[r * 4 + j] = _mm512_reduce_add_epi32(acc[r][j]);
#elif defined(KILN_ISA_AVXVNNI) || defined(KILN_ISA_AVX2)
  __m256i acc[2][4];
  for (auto& row : acc)
    for (auto& v : row) v = _mm256_setzero_si256();
#if defined(KILN_ISA_AVXVNNI)
  for (; i + 32 <= k; i += 32) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a0 + i));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a1 + i));
    for (int j = 0; j < 4; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j * k + i));
      acc[0][j] = _mm256_dpbusd_avx_epi32(acc[0][j], x0, w);
      acc[1][j] = _mm256_dpbusd_avx_epi32(acc[1][j], x1, w);
    }
  }
#else
  for (; i + 16 <= k; i += 16) {
    const __m256i x0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a0 + i)));
    const __m256i x1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a1 + i)));
    for (int j = 0; j < 4; ++j) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + j * k + i)));
      acc[0][j] = _mm256_add_epi32(acc[0][j], _mm256_madd_epi16(x0, w));
      acc[1][j] = _mm256_add_epi32(acc[1][j], _mm256_madd_epi16(x1, w));
    }
  }
#endif
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 4; ++j) out[r * 4 + j] = sum8_i32(acc[r][j]);
#else
  for (int r = 0; r < 8; ++r) out[r] = 0;
#endif
  for (; i < k; ++i)
    for (int r = 0; r < 2; ++r)
      for (int j = 0; j < 4; ++j) out[r * 4 + j] += static_cast<int32_t>(a[r][i]) * static_cast<int32_t>(b[j * k + i]);
}

#if defined(KILN_ISA_VNNI) || defined(KILN_ISA_AVXVNNI)
// More rows than a decode step's go to oneDNN's int8 GEMM (at::_int_mm, s8 x s8 -> s32), which on
// a CPU with VNNI sums as exactly as the loops here, 4-5x faster at prefill sizes (128 rows of
// SmolLM2's shapes). Without VNNI oneDNN's int8 GEMM widens through vpmaddubsw, which saturates
// (a product sum of 127 * -128 pairs comes out wrong), and ONEDNN_MAX_CPU_ISA can force that on any
// CPU: so the GEMM is used only once a probe of such sums came out exact.
constexpr int64_t kW8A8GemmRows = 8;

inline bool int8_gemm_is_exact() {
  static const bool exact = [] {
    const int64_t m = 32, k = 256, n = 64;
    at::Tensor a = at::empty({m, k}, at::kChar), b = at::empty({n, k}, at::kChar);
    int8_t* pa = a.data_ptr<int8_t>();
    int8_t* pb = b.data_ptr<int8_t>();
    for (int64_t i = 0; i < m * k; ++i)
      pa[i] = static_cast<int8_t>(i % 3 == 0 ? 127 : i % 3 == 1 ? -128 : (i * 37) % 255 - 127);
    for (int64_t i = 0; i < n * k; ++i) pb[i] = static_cast<int8_t>(i % 2 == 0 ? -128 : (i * 53) % 255 - 127);
    const at::Tensor got = at::_int_mm(a, b.t()).contiguous();
    const int32_t* pg = got.data_ptr<int32_t>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) {
        int64_t want = 0;
        for (int64_t i = 0; i < k; ++i) want += static_cast<int64_t>(pa[r * k + i]) * pb[c * k + i];
        if (pg[r * n + c] != want) return false;
      }
    return true;
  }();
  return exact;
}
#endif

// Output (m, o) of a W8A8 linear from its exact sum x_q . w (the same bits however the sum was made)
template <typename T>
inline void store_w8a8(T* out, int64_t n, const float* xs, const float* scale, const T* bias, int64_t m, int64_t o,
                       int32_t acc) {
  store_as(out + m * n + o, static_cast<float>(acc) * xs[m] * scale[o] + (bias ? to_f32(bias[o]) : 0.f));
}

// Two or more quantized rows (xq: u8, offset by 128): oneDNN's GEMM where it is exact and the rows
// are more than a decode step's; on plain AVX2 from 10 rows the rows in the vector lanes
// (lanes_w8, up to kW8A8LaneTail rows past the last whole chunk left to the loop after it); else
// weight rows in tiles of 4 against two input rows at a time (dot_u8s8_2x4).
// Kept out of linear_w8a8_rows, whose one-row loop (decode) stays as it was.
#if defined(KILN_ISA_AVX2)
// The lanes from 10 rows: this row loop is slower than W8A16's, and 10 of its rows cost more than a
// lane chunk of 16 (a call's first; a further chunk costs less, as the weights are widened once a
// call, so up to 8 rows past whole chunks go to the loop: lanes.h, lane_rows)
constexpr int64_t kW8A8LanesFrom = 10, kW8A8LaneTail = 8;
#endif
template <typename T>
[[gnu::noinline]] void w8a8_many_rows(const uint8_t* xq, const float* xs, const int8_t* w, const float* scale,
                                      const int32_t* wsum, const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
#if defined(KILN_ISA_VNNI) || defined(KILN_ISA_AVXVNNI)
  if (rows > kW8A8GemmRows && int8_gemm_is_exact()) {
    at::Tensor xs8 = at::empty({rows, k}, at::kChar);
    int8_t* q8 = xs8.data_ptr<int8_t>();
    for (int64_t i = 0; i < rows * k; ++i) q8[i] = static_cast<int8_t>(static_cast<int>(xq[i]) - 128);
    const at::Tensor wt = at::from_blob(const_cast<int8_t*>(w), {n, k}, at::kChar).t();
    const at::Tensor sums = at::_int_mm(xs8, wt).contiguous();  // [rows, n]
    const int32_t* acc = sums.data_ptr<int32_t>();
    parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        for (int64_t o = 0; o < n; ++o) store_w8a8(out, n, xs, scale, bias, m, o, acc[m * n + o]);
    });
    return;
  }
#endif
#if defined(KILN_ISA_AVX2) && !defined(KILN_ISA_AVXVNNI)
  const int64_t lanes = lane_rows(rows, kW8A8LanesFrom, kW8A8LaneTail);
  if (lanes > 0) {  // the rows in the vector lanes (int8.h): the same exact sums
    const int64_t kp = (k + 15) / 16 * 16;
    std::vector<int16_t> x16(lanes * kp, 0);
    for (int64_t m = 0; m < lanes; ++m)
      for (int64_t i = 0; i < k; ++i) x16[m * kp + i] = static_cast<int16_t>(static_cast<int>(xq[m * k + i]) - 128);
    // store_w8a8's arithmetic, 8 outputs of a row a store: an exact int32 sum rounds to the same
    // float from its double as from the int32
    lanes_w8(x16.data(), kp, w, lanes, k, n, [&](const double* exact, int64_t o0, int64_t on) {
      lanes_w8_store(exact, xs, scale, bias, out, lanes, n, o0, on);
    });
    if (lanes == rows) return;
    // the last rows past whole chunks: below, as a call of their own
    xq += lanes * k, xs += lanes, out += lanes * n, rows -= lanes;
  }
#endif
  const WeightRows stream{w, k};
  parallel_for(0, (n + 3) / 4, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * 4, o1 = std::min(n, o0 + 4);
      for (int64_t o = o0; o < o1; ++o) stream.ahead(o);
      int64_t m = 0;
      if (o1 - o0 == 4)
        for (; m + 2 <= rows; m += 2) {
          int32_t dots[8];
          dot_u8s8_2x4(xq + m * k, xq + (m + 1) * k, w + o0 * k, k, dots);
          for (int r = 0; r < 2; ++r)
            for (int j = 0; j < 4; ++j)
              store_w8a8(out, n, xs, scale, bias, m + r, o0 + j, dots[r * 4 + j] - 128 * wsum[o0 + j]);
        }
      for (; m < rows; ++m)
        for (int64_t o = o0; o < o1; ++o)
          store_w8a8(out, n, xs, scale, bias, m, o, dot_u8s8(xq + m * k, w + o * k, k) - 128 * wsum[o]);
    }
  });
}

template <typename T>
void linear_w8a8_rows(const T* x, const int8_t* w, const float* scale, const int32_t* wsum, float static_scale,
                      const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  std::vector<uint8_t> xq(rows * k);
  std::vector<float> xs(rows);
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) xs[m] = quantize_row_u8(x + m * k, xq.data() + m * k, k, static_scale);
  });
  if (rows > 1) {
    w8a8_many_rows(xq.data(), xs.data(), w, scale, wsum, bias, out, rows, k, n);
    return;
  }
  // one row: weight rows in tiles of 4 (L1-resident)
  const WeightRows stream{w, k};
  parallel_for(0, (n + 3) / 4, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * 4, o1 = std::min(n, o0 + 4);
      for (int64_t o = o0; o < o1; ++o) stream.ahead(o);
      for (int64_t o = o0; o < o1; ++o) {  // (store_w8a8's arithmetic, written out: through the call the
        // AVX2 build of this loop ran 0.78-0.91x as fast, measured twice with benchmarks/ablations/w8a8_rows.py)
        const int32_t acc = dot_u8s8(xq.data(), w + o * k, k) - 128 * wsum[o];
        store_as(out + o, static_cast<float>(acc) * xs[0] * scale[o] + (bias ? to_f32(bias[o]) : 0.f));
      }
    }
  });
}
