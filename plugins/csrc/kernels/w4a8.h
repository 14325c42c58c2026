// W4A8: int4 weights (formats.h; rows or tiled) x int8 activations quantized per row *and group*
// at run time (absmax / 127 of each group of the row: an outlier only coarsens its own group).
// Included per ISA inside kiln::<isa> after int4_tiled.h.
//
//   linear_w4a8_ref          the row layout, integer loops per group (the reference)
//   linear_w4a8_vnni         the row layout with AVX512-VNNI, in and group_size multiples of 64:
//                            the nibbles used as unsigned bytes directly (vpdpbusd: 64
//                            multiply-adds per instruction), 8 * sum(x) of the group taken off;
//                            x stored per 64-block as its 32 even then 32 odd elements, the
//                            order the low and high nibbles of 32 bytes come in
//   linear_w4a8_tiled_ref    the tiled layout, integer loops per group
//   linear_w4a8_tiled_dp     the tiled layout: one int8 plane against the nibbles (tiles_w4t;
//                            AVX2 and AVX-512); from kW4A8LanesFrom rows on plain AVX2,
//                            tiled_w4a8_lanes: the rows in the lanes, one vpmaddubsw multiplies
//                            8 rows by 4 inputs (lanes.h); with AMX from kAmxRowsFrom rows,
//                            tiled_w4_amx (int4_tiled.h)

// x [rows, k] -> q int8 [rows, k] (permute64: in the vnni kernel's order), scale and sum of q
// per row and group [rows, groups]
template <typename T>
void quantize_groups_i8(const T* x, int64_t rows, int64_t k, int64_t group, bool permute64, int8_t* q,
                        float* scale, int32_t* qsum) {
  const int64_t groups = (k + group - 1) / group;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
      float inv;  // 127 / the group's absmax (0 for a group of zeros), the scale its inverse
#if defined(KILN_ISA_SCALAR)
      float amax = 0.f;
      for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(to_f32(x[m * k + i])));
      inv = amax > 0.f ? 127.f / amax : 0.f;
      scale[m * groups + g] = amax / 127.f;
#else
      scale[m * groups + g] = row_step(x + m * k + g0, g1 - g0, 127.f, inv);
#endif
      int32_t total = 0;
      int64_t i = g0;
      if (!permute64) {  // vectors of inputs: cvtps rounds to nearest even, as nearbyint
#if defined(KILN_ISA_AVX512)
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
        for (; i + 16 <= g1; i += 16) {
          const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(vload(x + m * k + i), vinv));
          const __m512i c = _mm512_min_epi32(top, _mm512_max_epi32(bottom, r));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * k + i), _mm512_cvtepi32_epi8(c));
          total += _mm512_reduce_add_epi32(c);
        }
#elif !defined(KILN_ISA_SCALAR)
        const __m256 vinv = _mm256_set1_ps(inv);
        const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
        for (; i + 8 <= g1; i += 8) {
          const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(vload(x + m * k + i), vinv));
          const __m256i c = _mm256_min_epi32(top, _mm256_max_epi32(bottom, r));
          store8_i8(q + m * k + i, c);
          total += sum8_i32(c);
        }
#endif
      }
      for (; i < g1; ++i) {
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

// The input quantized per row and group: q [rows, k], scale and sum of q [rows, groups]
struct GroupedInput {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  template <typename T>
  GroupedInput(const T* x, int64_t rows, int64_t k, int64_t group, bool permute64)
      : q(rows * k), scale(rows * ((k + group - 1) / group)), sum(scale.size()) {
    quantize_groups_i8(x, rows, k, group, permute64, q.data(), scale.data(), sum.data());
  }
};

template <typename T>
void linear_w4a8_ref(const T* x, const uint8_t* w, const float* scale, int64_t group, const T* bias, T* out,
                      int64_t rows, int64_t k, int64_t n) {
  const int64_t row_bytes = k / 2, groups = (k + group - 1) / group;
  GroupedInput in(x, rows, k, group, false);
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* wrow = w + o * row_bytes;
      const float* srow = scale + o * groups;
      const float b = bias ? to_f32(bias[o]) : 0.f;
      for (int64_t m = 0; m < rows; ++m) {
        const int8_t* xr = in.q.data() + m * k;
        float total = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
          int32_t acc = 0;
          for (int64_t i = g0; i < g1; ++i) acc += int4_at(wrow, i) * static_cast<int32_t>(xr[i]);
          total += static_cast<float>(acc) * srow[g] * in.scale[m * groups + g];
        }
        store_as(out + m * n + o, total + b);
      }
    }
  });
}

#if defined(KILN_ISA_VNNI)
template <typename T>
void linear_w4a8_vnni(const T* x, const uint8_t* w, const float* scale, int64_t group, const T* bias, T* out,
                      int64_t rows, int64_t k, int64_t n) {
  const int64_t row_bytes = k / 2, groups = (k + group - 1) / group;
  GroupedInput in(x, rows, k, group, true);
  // four weight rows side by side: four independent chains (one row alone is latency-bound)
  auto four_rows = [&](int64_t o, int64_t m, float* totals) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const int8_t* xr = in.q.data() + m * k;
    four_rows_by_group(
        k, group, groups,
        [&](int64_t i, __m512i* acc) {
          const __m512i xv = _mm512_loadu_si512(xr + i);
          for (int r = 0; r < 4; ++r) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (o + r) * row_bytes + i / 2));
            const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nib)),
                                                 _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib), 1);
            acc[r] = _mm512_dpbusd_epi32(acc[r], u, xv);
          }
        },
        [&](int64_t g) { return 8 * in.sum[m * groups + g]; },
        [&](int r, int64_t g) { return scale[(o + r) * groups + g] * in.scale[m * groups + g]; }, totals);
  };
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    float totals[4];
    for (; o + 4 <= end; o += 4)
      for (int64_t m = 0; m < rows; ++m) {
        four_rows(o, m, totals);
        for (int r = 0; r < 4; ++r) store_as(out + m * n + o + r, totals[r] + (bias ? to_f32(bias[o + r]) : 0.f));
      }
    for (; o < end; ++o) {  // the chunk's last rows one at a time, two chains over the groups
      const uint8_t* wrow = w + o * row_bytes;
      const float* srow = scale + o * groups;
      const float b = bias ? to_f32(bias[o]) : 0.f;
      for (int64_t m = 0; m < rows; ++m) {
        const int8_t* xr = in.q.data() + m * k;
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
          return _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_maskz_set1_epi32(1, 8 * in.sum[m * groups + g])));
        };
        int64_t g = 0;
        for (; g + 2 <= groups; g += 2) {  // two independent chains
          facc[0] = _mm512_fmadd_ps(group_sum(g), _mm512_set1_ps(srow[g] * in.scale[m * groups + g]), facc[0]);
          facc[1] = _mm512_fmadd_ps(group_sum(g + 1), _mm512_set1_ps(srow[g + 1] * in.scale[m * groups + g + 1]), facc[1]);
        }
        if (g < groups) facc[0] = _mm512_fmadd_ps(group_sum(g), _mm512_set1_ps(srow[g] * in.scale[m * groups + g]), facc[0]);
        const __m512 facc_total = _mm512_add_ps(facc[0], facc[1]);
        store_as(out + m * n + o, _mm512_reduce_add_ps(facc_total) + b);
      }
    }
  });
}
#endif

// The tiled int4 layout: the input quantized per row and group (as above), the group's input
// scale times the weight scales per group
template <typename T>
void linear_w4a8_tiled_ref(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                           int64_t rows, int64_t k, int64_t n) {
  const int64_t groups = (k + group - 1) / group;
  GroupedInput in(x, rows, k, group, false);
  const TiledLayout L = tiled_int4_layout(k, n, group);
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t m = 0; m < rows; ++m) {
        float total = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t acc = 0;
          for (int64_t i = g * group; i < std::min(k, (g + 1) * group); ++i)
            acc += (tiled_nibble(w, L, o, i) - 8) * static_cast<int32_t>(in.q[m * k + i]);
          total += static_cast<float>(acc) * (s[L.scale(o, g)] * in.scale[m * groups + g]);
        }
        store_as(out + m * n + o, total + (bias ? to_f32(bias[o]) : 0.f));
      }
  });
}

#if defined(KILN_ISA_AVX2)
// W4A8 at many rows on AVX2: the input rows in the vector lanes (lanes.h). A dword of X holds 4
// int8 inputs of a row and a weight dword a tile output's 4 nibbles as unsigned bytes, so one
// vpmaddubsw multiplies 8 rows by 4 inputs: 32 multiply-adds, where tiles_w4t_pairs spends three
// multiplying instructions on 64 and unpacks the nibbles again for every pair of rows. A tile's
// weights are unpacked once per call and serve every row. Each group's int32 sums are the
// integers tiles_w4t_pairs sums, centred and scaled by the same float operations in the same
// group order, so every output has the bits the row kernel gives it (the tests compare the rows
// together with each row alone). Plain AVX2 only, as tiled_w4_lanes.
//
// The lanes take a call's rows from kW4A8LanesFrom on, and up to kW4A8LaneTail rows past whole
// chunks go to the row kernel (lanes.h, lane_rows; docs/benchmarks.md)
constexpr int64_t kW4A8LanesFrom = 14, kW4A8LaneTail = 13;

// Tile u0 of the tile group at w (U tiles wide) as Wt [k / 4 steps][16 outputs] dwords of 4
// unsigned nibbles: a row's 4 bytes of a block hold inputs 0-3 in their low nibbles (step 2b)
// and 4-7 in their high ones (step 2b + 1), each in input order
inline void lanes_weights_u8(const uint8_t* w, int64_t kb, int64_t U, int64_t u0, int32_t* Wt) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < kb; ++b)
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * U + u0) * 64 + 32 * half));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(Wt + 2 * b * kTileRows + 8 * half), _mm256_and_si256(v, nib));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(Wt + (2 * b + 1) * kTileRows + 8 * half),
                          _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
    }
}

// facc [16 outputs][kLaneRows rows] = one tile's float sums for one chunk: each group's int32
// sums minus the chunk rows' 8 * sum of inputs (the sums start from neg_xsum8
// [groups][4][kLaneRows]: minus those, once for each of 4 outputs), times the weight scale (group
// g's 16 at s_tile + g U 16) times the rows' input scales (xs [groups][kLaneRows]), added in group
// order as tiles_w4t_pairs<.., true> adds them
inline void lanes_tile_a8(const int32_t* Xc, const int32_t* Wt, const float* s_tile, const int32_t* neg_xsum8,
                          const float* xs, const TiledLayout& L, int64_t U, int64_t group, float* facc) {
  const int64_t steps = 2 * L.kb;
  alignas(32) int32_t sums[4 * kLaneRows];
  for (int64_t i = 0; i < kTileRows * kLaneRows; i += 8) _mm256_store_ps(facc + i, _mm256_setzero_ps());
  for (int64_t g = 0; g < L.groups; ++g) {
    const int64_t j0 = g * group / 4, j1 = std::min(steps, (g + 1) * group / 4);
    const float* sg = s_tile + g * U * kTileRows;
    for (int o0 = 0; o0 < kTileRows; o0 += 4) {
      for (int64_t j = j0; j < j1; j += 8)
        lanes_four_outputs_u8<1, kTileRows>(Xc + j * kLaneRows, Wt + j * kTileRows + o0, std::min<int64_t>(8, j1 - j),
                                            j == j0 ? neg_xsum8 + g * 4 * kLaneRows : sums, sums);
      for (int o = 0; o < 4; ++o)
        for (int h = 0; h < kLaneRows; h += 8) {
          float* f = facc + (o0 + o) * kLaneRows + h;
          const __m256i centred = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums + o * kLaneRows + h));
          const __m256 scales = _mm256_mul_ps(vset1(sg[o0 + o]), _mm256_loadu_ps(xs + g * kLaneRows + h));
          _mm256_store_ps(f, vfma(_mm256_cvtepi32_ps(centred), scales, _mm256_load_ps(f)));
        }
    }
  }
}

// out [rows, n] from the input quantized per row and group (GroupedInput, sums not yet times 8)
template <typename T>
void tiled_w4a8_lanes(const GroupedInput& in, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                      int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  const int64_t steps = k / 4, chunks = (rows + kLaneRows - 1) / kLaneRows;
  const LineBuffer<int32_t> X(chunks * steps * kLaneRows);
  lanes_inputs_dwords(in.q.data(), rows, steps, X.data);
  // per chunk, group and lane: the row's scale, and minus 8 times its sum of inputs (the nibbles'
  // + 8) four times over, where each group's sums of 4 outputs start (zero past `rows`)
  std::vector<float> xs(chunks * L.groups * kLaneRows, 0.f);
  LineBuffer<int32_t> neg_xsum8(4 * xs.size());
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < L.groups; ++g) {
      const int64_t cg = (m / kLaneRows) * L.groups + g, lane = m % kLaneRows;
      for (int o = 0; o < 4; ++o) neg_xsum8.data[(cg * 4 + o) * kLaneRows + lane] = -8 * in.sum[m * L.groups + g];
      xs[cg * kLaneRows + lane] = in.scale[m * L.groups + g];
    }
  parallel_for(0, L.tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> Wt(steps * kTileRows);
    alignas(32) float facc[kTileRows * kLaneRows];  // [output][row]
    for (int64_t t = begin; t < end; ++t) {
      const int64_t t0 = t / kTileGroup * kTileGroup, U = L.width(t0), u = t - t0;
      lanes_weights_u8(w + t0 * L.kb * 64, L.kb, U, u, Wt.data());
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = c * L.groups * kLaneRows;
        lanes_tile_a8(X.data + c * steps * kLaneRows, Wt.data(), s + (t0 * L.groups + u) * kTileRows,
                      neg_xsum8.data + 4 * at, xs.data() + at, L, U, group, facc);
        lanes_store_tile(facc, static_cast<const float*>(nullptr), bias, out + c * kLaneRows * n,
                         rows - c * kLaneRows, n, t * kTileRows);
      }
    }
  });
}
#endif

#if !defined(KILN_ISA_SCALAR)
// one int8 plane against the nibbles (tiles_w4t<.., true>); on plain AVX2 at many rows, the rows
// in the lanes (tiled_w4a8_lanes) and the rest by the row kernel; with AMX from kAmxRowsFrom
// rows, tiled_w4_amx (int4_tiled.h)
template <typename T>
void linear_w4a8_tiled_dp(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                              int64_t rows, int64_t k, int64_t n) {
  GroupedInput in(x, rows, k, group, false);
  int64_t m0 = 0;  // the rows from m0 on go to the row kernel
#if defined(KILN_ISA_AVX2) && !defined(KILN_ISA_AVXVNNI)
  m0 = lane_rows(rows, kW4A8LanesFrom, kW4A8LaneTail);
  if (m0 > 0) tiled_w4a8_lanes(in, w, s, group, bias, out, m0, k, n);
  if (m0 == rows) return;
#endif
#if defined(KILN_ISA_AMX)
  if (rows >= kAmxRowsFrom && amx_tiles_fit(k, group))
    return tiled_w4_amx<true>(nullptr, in.q.data(), in.scale.data(), nullptr, w, s, group, bias, out, rows, k, n);
#endif
  const int64_t groups = (k + group - 1) / group;
  for (auto& v : in.sum) v *= 8;  // the nibbles' + 8
  tiled_w4_rows<true>(nullptr, in.q.data() + m0 * k, in.sum.data() + m0 * groups, in.scale.data() + m0 * groups,
                      nullptr, w, s, group, bias, out + m0 * n, rows - m0, k, n);
}
#endif
