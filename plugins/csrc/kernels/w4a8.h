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
//                            AVX2 and AVX-512)

// x [rows, k] -> q int8 [rows, k] (permute64: in the vnni kernel's order), scale and sum of q
// per row and group [rows, groups]
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

#if !defined(KILN_ISA_SCALAR)
// one int8 plane against the nibbles (tiles_w4t<.., true>)
template <typename T>
void linear_w4a8_tiled_dp(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out,
                              int64_t rows, int64_t k, int64_t n) {
  GroupedInput in(x, rows, k, group, false);
  for (auto& v : in.sum) v *= 8;  // the nibbles' + 8
  tiled_w4_rows<true>(nullptr, in.q.data(), in.sum.data(), in.scale.data(), nullptr, w, s, group, bias, out, rows, k, n);
}
#endif
