// Skinny linear layer for decode steps: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), for a
// handful of rows m. At batch 1 a decode step is a GEMV that only has to stream the weights
// once at memory bandwidth: each weight row is read once and widened once, and used for up to
// four input rows at a time (inputs widened to fp32 up front, leftover rows one by one). fp32 accumulation, one rounding
// to T at the end.
// Included per ISA inside kiln::<isa> after vec.h.

template <typename T>
void linear_impl(const T* x, const T* w, const T* bias, T* out, int64_t rows, int64_t in_features,
                 int64_t out_features) {
  std::vector<float> xf(rows * in_features);
  for (int64_t i = 0; i < rows * in_features; ++i) xf[i] = to_f32(x[i]);
  const int64_t grouped = rows / 4 * 4;
  at::parallel_for(0, out_features, 32, [&](int64_t begin, int64_t end) {
    float sums[4];
    for (int64_t n = begin; n < end; ++n) {
      const T* wrow = w + n * in_features;
      const float b = bias ? to_f32(bias[n]) : 0.f;
      for (int64_t m = 0; m < grouped; m += 4) {
        const float* x0 = xf.data() + m * in_features;
        dot4(x0, x0 + in_features, x0 + 2 * in_features, x0 + 3 * in_features, wrow, in_features, sums);
        for (int64_t r = 0; r < 4; ++r) store_as(out + (m + r) * out_features + n, sums[r] + b);
      }
      for (int64_t m = grouped; m < rows; ++m)
        store_as(out + m * out_features + n, dot(xf.data() + m * in_features, wrow, in_features) + b);
    }
  });
}

void linear_f32(const float* x, const float* w, const float* bias, float* out, int64_t rows, int64_t k,
                int64_t n) {
  linear_impl<float>(x, w, bias, out, rows, k, n);
}
void linear_bf16(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t rows, int64_t k,
                 int64_t n) {
  linear_impl<bf16>(x, w, bias, out, rows, k, n);
}
