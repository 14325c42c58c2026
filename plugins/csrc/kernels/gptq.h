// GPTQ's column loop over one block of columns (the build's weight rounding: quantize/algorithms.py
// gptq; plugins/reference.py gptq_block is the same loop in PyTorch ops). Included per ISA inside
// kiln::<isa>; plain loops that the ISA's target options vectorize.
//
//   gptq_block_rows   pending [out, B] (the block's columns as they stand, updated in place),
//                     hinv [B, B] (the block's part of the upper Cholesky factor of H^-1):
//                     column by column, every row: q = the column on its grid,
//                     e = (column - q) / hinv[i, i], the later columns of the block -= e * hinv[i, :].
//                     Rows are independent, so they run in parallel; each float operation is the
//                     reference's, in its order (-ffp-contract=off: no fused multiply-add), so the
//                     results are the same bits.
//
// Grids: kGptqInt4: int4 groups of `group` columns, each group's scale its values' absmax (times
// clip[o, g]) / 7 as they stand when its first column is reached, written to scales [out, groups];
// kGptqInt8: the int8 grid with fixed per-row scales [out]; kGptqFp8: E4M3 with fixed per-row
// scales [out], saturating at +-448.

constexpr int kGptqInt4 = 0, kGptqInt8 = 1, kGptqFp8 = 2;  // (ints: the entry point's type is the same in every ISA namespace)

inline void gptq_block_rows(float* pending, const float* hinv, float* q, float* err, float* scales,
                            const float* clip, int64_t out, int64_t B, int64_t column, int64_t group, int64_t groups,
                            int grid) {
  parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      float* p = pending + o * B;
      float* qo = q + o * B;
      float* eo = err + o * B;
      for (int64_t i = 0; i < B; ++i) {
        const int64_t col = column + i;
        float s;
        if (grid == kGptqInt4) {
          float* so = scales + o * groups + col / group;
          if (col % group == 0) {  // the group's scale from its columns as they stand now
            float amax = 0.f;
            for (int64_t j = i; j < std::min(B, i + group); ++j) amax = std::max(amax, std::fabs(p[j]));
            if (clip) amax = amax * clip[o * groups + col / group];
            *so = std::max(amax / 7.f, 1e-10f);
          }
          s = *so;
        } else {
          s = scales[o];
        }
        float v;
        if (grid == kGptqFp8)
          v = round_fp8(std::clamp(p[i] / s, -448.f, 448.f)) * s;
        else if (grid == kGptqInt4)
          v = std::clamp(std::nearbyint(p[i] / s), -8.f, 7.f) * s;
        else
          v = std::clamp(std::nearbyint(p[i] / s), -127.f, 127.f) * s;
        qo[i] = v;
        const float e = (p[i] - v) / hinv[i * B + i];
        eo[i] = e;
        const float* h = hinv + i * B;
        for (int64_t j = i; j < B; ++j) p[j] = p[j] - e * h[j];
      }
    }
  });
}
