// The drivers and input quantizers every quantized GEMV shares (int8, int4, W8A8, W4A8, FP8;
// rows and tiled layouts). Included per ISA inside kiln::<isa> after vec.h.
//
//   with_rows / gemv_rows / gemv_float_rows  one weight row at a time against up to four input
//                                             rows (the row-layout kernels)
//   dot_rows_bytes                            R float rows . one row of one-byte weights
//   AVX2 and AVX-512:
//   f32x16                                    16 float sums (one __m512, or two __m256 on AVX2)
//   quantize_rows_i16, split_rows_i8          input rows to int16, or to two int8 planes (15 bits)
//   tiles_i16                                 the int16-activation GEMV driver (tiles of 16 rows)
//   tiled_gemv                                the tiled layouts' driver (formats.h, TiledLayout)
//   AVX-512 only:
//   dp16, dpbusd, broadcast4                  the integer dot-product steps (VNNI or emulated)
//   bf16x16, store_rows2 / 4                  16 floats out to 2 or 4 rows (the dequantizers)

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

// The GEMV driver: each weight row o against the input rows (as the kernel reads them) four at
// a time; dot(R, xs + m0 * k, o, sums) fills sums[0, R) and out = sums + bias. Many rows go a
// block at a time against a block of weight rows (row_blocks, as dense_rows).
template <typename X, typename T, typename Dot>
void gemv_rows(WeightRows w, const X* xs, const T* bias, T* out, int64_t rows, int64_t k, int64_t n, Dot dot) {
  const RowBlocks blocks = row_blocks(k * static_cast<int64_t>(sizeof(X)), w.row_bytes);
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float sums[4];
    for (int64_t o0 = begin; o0 < end; o0 += blocks.weights) {
      const int64_t o1 = std::min(end, o0 + blocks.weights);
      for (int64_t b0 = 0; b0 < rows; b0 += blocks.inputs) {
        const int64_t b1 = std::min(rows, b0 + blocks.inputs);
        for (int64_t o = o0; o < o1; ++o) {
          if (b0 == 0) w.ahead(o);
          const float b = bias ? to_f32(bias[o]) : 0.f;
          for (int64_t m0 = b0; m0 < b1; m0 += 4) {
            const int64_t mr = std::min<int64_t>(4, b1 - m0);
            with_rows(mr, [&](auto R) { dot(R, xs + m0 * k, o, sums); });
            for (int64_t r = 0; r < mr; ++r) store_as(out + (m0 + r) * n + o, sums[r] + b);
          }
        }
      }
    }
  });
}

// The float-input GEMV (AVX2 / scalar paths): the input rows widened to fp32 once first.
template <typename T, typename Dot>
void gemv_float_rows(WeightRows w, const T* x, const T* bias, T* out, int64_t rows, int64_t k, int64_t n, Dot dot) {
  const LineBuffer<float> xf(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) xf.data[i] = to_f32(x[i]);
  gemv_rows(w, xf.data, bias, out, rows, k, n, dot);
}

// R input rows against one weight row of one-byte elements W (int8_t, fp8e4m3: to_f32 widens
// them exactly), one by one: the scalar reference paths' dot product (every vector level runs
// its own int8 and FP8 kernels, select.h)
template <int R, typename W>
inline void dot_rows_bytes(const float* xf, int64_t k, const W* wrow, float* sums) {
  for (int r = 0; r < R; ++r) sums[r] = 0.f;
  for (int64_t i = 0; i < k; ++i)
    for (int r = 0; r < R; ++r) sums[r] += xf[r * k + i] * to_f32(wrow[i]);
}

#if defined(KILN_ISA_AVX512)
// int16 pairs multiplied and summed into int32 lanes (vpdpwssd with VNNI, vpmaddwd otherwise)
inline __m512i dp16(__m512i acc, __m512i a, __m512i b) {
#if defined(KILN_ISA_VNNI)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

#endif

#if !defined(KILN_ISA_SCALAR)
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
#if defined(KILN_ISA_AVX512)
  __m512 vmax = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(vload(xr + i)));
  float amax = _mm512_reduce_max_ps(vmax);
#else
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(vload(xr + i), magnitude));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#endif
  for (; i < k; ++i) amax = std::max(amax, std::fabs(to_f32(xr[i])));
  inv = amax > 0.f ? qmax / amax : 0.f;
  return amax / qmax;
}

// The int16-activation GEMVs' inputs: each row quantized to int16, absmax / qmax (32767: a
// relative error of 1.5e-5 of the row's largest value, far below bf16's 4e-3; 16383, 15 bits,
// where a kernel needs its int32 sums of 1,024 products with int8 weights exact)
template <typename T>
void quantize_rows_i16(const T* x, int64_t rows, int64_t k, int64_t kp, int order, float qmax, int16_t* q,
                       float* scale) {
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = x + m * k;
    float inv;
    scale[m] = row_step(xr, k, qmax, inv);
    int16_t* qr = q + m * kp;
    for (int64_t i = 0; i < kp; ++i) {
      const int16_t v = i < k ? static_cast<int16_t>(std::nearbyint(to_f32(xr[i]) * inv)) : 0;
      qr[permuted(i, order)] = v;
    }
  }
}

// The int16-activation GEMV driver: weight rows in tiles of 16 against the input rows four at a
// time; tile(R, m0, o0, o1, sums) fills sums[(o - o0) * R + r] for rows m0 + r (prefetching
// each weight row's WeightRows::ahead as it goes: all 16 at once stalled), and
// out = sums * xs[m] * out_scale(o) + bias.
template <typename T, typename Tile, typename OutScale>
void tiles_i16(const T* bias, T* out, const float* xs, int64_t rows, int64_t n, Tile tile, OutScale out_scale) {
  parallel_for(0, (n + 15) / 16, 1, [&](int64_t begin, int64_t end) {
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
#if defined(KILN_ISA_AVX512)
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
#else
    if (group % 8 == 0) {  // 8 at a time, as above
      const __m256 vinv = _mm256_set1_ps(inv);
      for (; i + 8 <= k; i += 8) {
        const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(vload(xr + i), vinv));
        const __m256i l = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(q, _mm256_set1_epi32(128)),
                                                            _mm256_set1_epi32(255)), _mm256_set1_epi32(128));
        const __m256i h = _mm256_srai_epi32(_mm256_sub_epi32(q, l), 8);
        store8_i8(hi + m * kp + i, h);
        store8_i8(lo + m * kp + i, l);
        hsum[m * groups + i / group] += sum8_i32(h);
        lsum[m * groups + i / group] += sum8_i32(l);
      }
    }
#endif
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

#endif

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

// Four int4 weight rows side by side, group by group (four independent chains: one row alone is
// bound by its dot product's latency): block(i, acc) adds the 64 inputs from i into the rows' four
// int32 accumulators; each group's sums, less offset(g) (the nibbles' + 8 times the inputs' sum),
// go to fp32 times scale(r, g). sums[r] = row r's total.
template <typename Block, typename Offset, typename Scale>
inline void four_rows_by_group(int64_t k, int64_t group, int64_t groups, Block block, Offset offset, Scale scale,
                               float* sums) {
  __m512 facc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (int64_t i = g0; i < g1; i += 64) block(i, acc);
    const __m512i off = _mm512_maskz_set1_epi32(1, offset(g));
    for (int r = 0; r < 4; ++r)
      facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], off)), _mm512_set1_ps(scale(r, g)),
                                facc[r]);
  }
  for (int r = 0; r < 4; ++r) sums[r] = _mm512_reduce_add_ps(facc[r]);
}

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
#endif

#if !defined(KILN_ISA_SCALAR)
// 16 float sums: the outputs of one tile (kTileRows) for one input row
#if defined(KILN_ISA_AVX512)
using f32x16 = __m512;
inline void store16(float* p, f32x16 v) { _mm512_storeu_ps(p, v); }
inline f32x16 scaled16(f32x16 v, float s) { return _mm512_mul_ps(v, _mm512_set1_ps(s)); }
#else
struct f32x16 {
  __m256 lo, hi;
};
inline void store16(float* p, f32x16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
inline f32x16 scaled16(f32x16 v, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  return {_mm256_mul_ps(v.lo, vs), _mm256_mul_ps(v.hi, vs)};
}
#endif

// The tiled kernels' prefetch: the V vectors (tiles u0.. of a group of width U) g_prefetch_ahead
// bytes past those block b reads (one row reads the group's vectors as one stream; several rows
// read one tile's, U * 64 bytes apart)
inline void tiles_ahead(const uint8_t* w, int64_t b, int64_t U, int64_t u0, int V) {
  if (g_prefetch_ahead == 0) return;
  const uint8_t* p = w + (b * U + u0) * 64 + g_prefetch_ahead;
  for (int v = 0; v < V; ++v) prefetch_line(p + 64 * v);
}

// The tiled GEMVs' driver: tiles in parallel (a thread's share may start or end inside a group,
// so two threads split a 576-output GEMV 18 / 18 tiles rather than 5 / 4 groups), input rows four
// at a time. One row (decode): the share's tiles of a group side by side, one stream
// (tiles(R = 1, V, t0, U, u0)); more rows: tile by tile (V = 1). tiles(R, V, t0, U, u0, m0, acc)
// fills acc[v * R + r] for tiles t0 + u0 + v of the group at t0 (U tiles wide) and input rows
// m0 + r (R and V as std::integral_constant); row(m, o0, acc, sums) turns one accumulator into the
// 16 outputs of row m from o0 (before the bias), which is added here. Each output's arithmetic is
// the same whichever thread runs it.
template <typename T, typename Tiles, typename Row>
void tiled_gemv(const TiledLayout& L, const T* bias, T* out, int64_t rows, int64_t n, Tiles tiles, Row row) {
  parallel_for(0, L.tiles, 1, [&](int64_t begin, int64_t end) {
    f32x16 acc[kTileGroup * 4];
    float sums[kTileRows];
    for (int64_t t = begin; t < end;) {
      const int64_t t0 = t / kTileGroup * kTileGroup, U = L.width(t0), u0 = t - t0;
      const int64_t count = std::min(t0 + U, end) - t;  // this share's tiles of the group
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t mr = std::min<int64_t>(4, rows - m0);
        auto emit = [&](int64_t V, int64_t R, int64_t first) {
          for (int64_t v = 0; v < V; ++v)
            for (int64_t r = 0; r < R; ++r) {
              const int64_t o0 = (t0 + first + v) * kTileRows;
              row(m0 + r, o0, acc[v * R + r], sums);
              store_row16(out + (m0 + r) * n + o0, sums, bias ? bias + o0 : nullptr);
            }
        };
        using One = std::integral_constant<int, 1>;
        if (mr == 1) {
          switch (count) {
            case 4: tiles(One{}, std::integral_constant<int, 4>{}, t0, U, u0, m0, acc); break;
            case 3: tiles(One{}, std::integral_constant<int, 3>{}, t0, U, u0, m0, acc); break;
            case 2: tiles(One{}, std::integral_constant<int, 2>{}, t0, U, u0, m0, acc); break;
            default: tiles(One{}, One{}, t0, U, u0, m0, acc);
          }
          emit(count, 1, u0);
        } else {
          for (int64_t u = u0; u < u0 + count; ++u)
            with_rows(mr, [&](auto R) {
              tiles(R, One{}, t0, U, u, m0, acc);
              emit(1, decltype(R)::value, u);
            });
        }
      }
      t += count;
    }
  });
}

#endif
