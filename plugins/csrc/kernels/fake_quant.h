// Weights rounded to their int4 group grid and back, in one pass: the AWQ scale and clipping
// searches of the build (quantize/algorithms.py awq_scales / awq_clip) try ~30 candidates per
// linear, each one a pass over the weights. plugins/reference.py fake_quant_int4 is the same in
// PyTorch ops. Included per ISA inside kiln::<isa>; plain loops that the ISA's options vectorize.
//
//   fake_quant_int4_rows  w [n, k] (times column scales s [k] where given), per row and group of
//                         `group` columns: scale = max(absmax * ratio / 7, 1e-10), each value
//                         round(v / scale) clamped to [-8, 7] times scale (divided by s[j] again
//                         where given). Every float operation is the reference's, in its order, so
//                         the results are the same bits.

inline void fake_quant_int4_rows(const float* w, const float* s, float* out, int64_t n, int64_t k, int64_t group,
                                 float ratio) {
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> v(group);
    for (int64_t o = begin; o < end; ++o) {
      const float* wo = w + o * k;
      float* oo = out + o * k;
      for (int64_t g0 = 0; g0 < k; g0 += group) {
        const int64_t len = std::min(group, k - g0);
        float amax = 0.f;
        for (int64_t j = 0; j < len; ++j) {
          v[j] = s ? wo[g0 + j] * s[g0 + j] : wo[g0 + j];
          amax = std::max(amax, std::fabs(v[j]));
        }
        const float scale = std::max(amax * ratio / 7.f, 1e-10f);
        for (int64_t j = 0; j < len; ++j) {
          const float q = std::clamp(std::nearbyint(v[j] / scale), -8.f, 7.f) * scale;
          oo[g0 + j] = s ? q / s[g0 + j] : q;
        }
      }
    }
  });
}
