// Norms and activations.
//
// RMSNorm over the last dimension: out = weight * (x / sqrt(mean(x^2) + eps)), and the fused
// residual form used between sublayers: residual += x; out = rmsnorm(residual).
// Rounding follows Hugging Face's LlamaRMSNorm so bf16 engines match it bit for bit where
// possible: statistics in fp32, the normalized value rounded to the input dtype, then the
// product with the weight rounded again; the residual sum is rounded as a bf16 add would be.
// The element-wise passes run kLanes at a time with the same roundings as their scalar tails.
// Included per ISA inside kiln::<isa> after vec.h.

template <typename T>
inline void rms_norm_row(const T* xr, const T* weight, T* outr, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(dot(xr, xr, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
#if !defined(KILN_ISA_SCALAR)
  const vfloat vinv = vset1(inv);
  for (; i + kLanes <= n; i += kLanes)  // as below, kLanes at a time (the roundings too)
    vstore_as(outr + i, vmul(vload(weight + i), vround_as<T>(vmul(vload(xr + i), vinv))));
#endif
  for (; i < n; ++i) store_as(outr + i, to_f32(weight[i]) * round_as<T>(to_f32(xr[i]) * inv));
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * n, weight, out + r * n, n, eps);
  });
}

template <typename T>
void add_rms_norm_rows(T* residual, const T* x, const T* weight, T* out, int64_t rows, int64_t n,
                       float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * n;
      const T* xr = x + r * n;
      int64_t i = 0;
#if !defined(KILN_ISA_SCALAR)
      for (; i + kLanes <= n; i += kLanes) vstore_as(res + i, vadd(vload(res + i), vload(xr + i)));
#endif
      for (; i < n; ++i) store_as(res + i, to_f32(res[i]) + to_f32(xr[i]));
      rms_norm_row(res, weight, out + r * n, n, eps);
    }
  });
}

// Gated activations on the fused gate/up projection [rows, 2n]: out = act(gate) * up, each rounded
// to T as PyTorch's separate activation and mul would. Act: silu (SwiGLU: Llama, Qwen, Phi-3) or
// tanh-approximated GELU (GeGLU: Gemma), each with a vector body (kLanes at a time) and a scalar
// one for the rest of a row, computed as PyTorch computes it.
struct Silu {
  static float one(float g) { return g / (1.0f + std::exp(-g)); }
#if !defined(KILN_ISA_SCALAR)
  static vfloat lanes(vfloat g) { return vdiv(g, vadd(vset1(1.f), vexp(vsub(vzero(), g)))); }
#endif
};

struct GeluTanh {  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as F.gelu(approximate="tanh")
  static constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  static float one(float x) { return 0.5f * x * (1.0f + std::tanh(kBeta * (x + kKappa * (x * x * x)))); }
#if !defined(KILN_ISA_SCALAR)
  static vfloat lanes(vfloat x) {  // tanh(u) = 1 - 2 / (e^(2u) + 1): -1 and 1 at the ends, no NaN
    const vfloat inner = vmul(vset1(kBeta), vadd(x, vmul(vset1(kKappa), vmul(vmul(x, x), x))));
    const vfloat tanh = vsub(vset1(1.f), vdiv(vset1(2.f), vadd(vexp(vadd(inner, inner)), vset1(1.f))));
    return vmul(vmul(vset1(0.5f), x), vadd(vset1(1.f), tanh));
  }
#endif
};

template <typename Act, typename T>
void gated_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  constexpr int64_t kChunk = 256;  // elements of a row per task: a decode step's one row still splits
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, first = task % chunks * kChunk, last = std::min(n, first + kChunk);
      const T* gate = gate_up + r * 2 * n;
      const T* up = gate + n;
      T* o = out + r * n;
      int64_t i = first;
#if !defined(KILN_ISA_SCALAR)
      for (; i + kLanes <= last; i += kLanes)  // as below, kLanes at a time (the rounding too)
        vstore_as(o + i, vmul(vround_as<T>(Act::lanes(vload(gate + i))), vload(up + i)));
#endif
      for (; i < last; ++i) store_as(o + i, round_as<T>(Act::one(to_f32(gate[i]))) * to_f32(up[i]));
    }
  });
}
