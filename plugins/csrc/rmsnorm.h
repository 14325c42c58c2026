// RMSNorm over the last dimension: out = weight * (x / sqrt(mean(x^2) + eps)).
// Rounding follows Hugging Face's LlamaRMSNorm so bf16 engines match it bit for bit where
// possible: statistics in fp32, the normalized value rounded to the input dtype, then the
// product with the weight rounded again.
// Included per ISA inside kiln::<isa> after vec.h.

template <typename T>
void rms_norm_impl(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* outr = out + r * n;
      float inv = 1.0f / std::sqrt(dot(xr, xr, n) / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) {
        T normed;
        store_as(&normed, to_f32(xr[i]) * inv);
        store_as(outr + i, to_f32(weight[i]) * to_f32(normed));
      }
    }
  });
}

void rms_norm_f32(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  rms_norm_impl<float>(x, w, out, rows, n, eps);
}
void rms_norm_bf16(const bf16* x, const bf16* w, bf16* out, int64_t rows, int64_t n, float eps) {
  rms_norm_impl<bf16>(x, w, out, rows, n, eps);
}
