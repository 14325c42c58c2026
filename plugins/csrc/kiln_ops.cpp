// kiln's plugin library: every kernel family compiled for each instruction set in one
// translation unit, a dispatch table chosen once when the library loads, and the torch ops
// (namespace `kiln`) that the model calls. Fake (meta) implementations live in
// kiln/plugins/ops.py so the ops trace and export.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

namespace scalar {
#define KILN_ISA_SCALAR
#include "vec.h"
#include "rmsnorm.h"
#include "attention.h"
#undef KILN_ISA_SCALAR
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define KILN_ISA_AVX2
#include "vec.h"
#include "rmsnorm.h"
#include "attention.h"
#undef KILN_ISA_AVX2
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
#define KILN_ISA_AVX512
#include "vec.h"
#include "rmsnorm.h"
#include "attention.h"
#undef KILN_ISA_AVX512
}  // namespace avx512
#pragma GCC pop_options

using bf16 = c10::BFloat16;

struct Kernels {
  std::string isa;
  void (*rms_norm_f32)(const float*, const float*, float*, int64_t, int64_t, float);
  void (*rms_norm_bf16)(const bf16*, const bf16*, bf16*, int64_t, int64_t, float);
  void (*attention_f32)(const float*, const float*, const float*, float*, float*, float*,
                        int64_t, int64_t, int64_t, int64_t, int64_t, float);
  void (*attention_bf16)(const bf16*, const bf16*, const bf16*, bf16*, bf16*, bf16*, int64_t,
                         int64_t, int64_t, int64_t, int64_t, float);
};

#define KILN_KERNELS(ns) \
  Kernels { #ns, ns::rms_norm_f32, ns::rms_norm_bf16, ns::attention_f32, ns::attention_bf16 }

static bool host_supports(const std::string& isa) {
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == "scalar";
}

static Kernels kernels_for(const std::string& requested) {
  std::string isa = requested;
  if (isa == "auto") isa = host_supports("avx512") ? "avx512" : host_supports("avx2") ? "avx2" : "scalar";
  TORCH_CHECK(isa == "avx512" || isa == "avx2" || isa == "scalar",
              "kiln: unknown ISA '", requested, "'; expected auto, avx512, avx2 or scalar");
  TORCH_CHECK(host_supports(isa), "kiln: this CPU does not support ISA '", isa, "'");
  if (isa == "avx512") return KILN_KERNELS(avx512);
  if (isa == "avx2") return KILN_KERNELS(avx2);
  return KILN_KERNELS(scalar);
}

static Kernels& active() {
  // Chosen once at load: KILN_ISA overrides (e.g. to run the scalar reference path).
  static Kernels k = kernels_for(std::getenv("KILN_ISA") ? std::getenv("KILN_ISA") : "auto");
  return k;
}

std::string select_isa(std::string isa) {
  active() = kernels_for(isa);
  return active().isa;
}

static void check_float_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "kiln: ", name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "kiln: ", name, " must be on the CPU");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "kiln::rms_norm: weight dtype ",
              weight.scalar_type(), " differs from x dtype ", x.scalar_type());
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "kiln::rms_norm: weight shape ",
              weight.sizes(), " does not match last dim ", n);
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t rows = n == 0 ? 0 : xc.numel() / n;
  if (x.scalar_type() == at::kFloat)
    active().rms_norm_f32(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows,
                          n, static_cast<float>(eps));
  else
    active().rms_norm_bf16(reinterpret_cast<const bf16*>(xc.data_ptr()),
                           reinterpret_cast<const bf16*>(wc.data_ptr()),
                           reinterpret_cast<bf16*>(out.data_ptr()), rows, n, static_cast<float>(eps));
  return out;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     at::Tensor& k_cache, at::Tensor& v_cache, int64_t start_pos, double scale) {
  check_float_or_bf16(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "kiln::attention: q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3,
              "kiln::attention: caches must be [max_seq, kv_heads, head_dim]");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k, "k"}, {v, "v"},
                                 {k_cache, "k_cache"}, {v_cache, "v_cache"}})
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), "kiln::attention: ", name, " dtype ",
                t.scalar_type(), " differs from q dtype ", q.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "kiln::attention: caches must be contiguous");
  const int64_t tokens = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k.size(1);
  TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens, "kiln::attention: token counts differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "kiln::attention: heads ", heads,
              " not a multiple of kv_heads ", kv_heads);
  TORCH_CHECK(k.size(2) == head_dim && v.sizes() == k.sizes(), "kiln::attention: k/v shape");
  TORCH_CHECK(k_cache.size(1) == kv_heads && k_cache.size(2) == head_dim &&
                  v_cache.sizes() == k_cache.sizes(),
              "kiln::attention: cache shape ", k_cache.sizes(), " does not fit k ", k.sizes());
  TORCH_CHECK(start_pos >= 0 && start_pos + tokens <= k_cache.size(0), "kiln::attention: positions [",
              start_pos, ", ", start_pos + tokens, ") exceed the cache length ", k_cache.size(0));
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = at::empty_like(qc);
  if (tokens == 0) return out;
  if (q.scalar_type() == at::kFloat)
    active().attention_f32(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                           k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                           out.data_ptr<float>(), tokens, heads, kv_heads, head_dim, start_pos,
                           static_cast<float>(scale));
  else
    active().attention_bf16(
        reinterpret_cast<const bf16*>(qc.data_ptr()), reinterpret_cast<const bf16*>(kc.data_ptr()),
        reinterpret_cast<const bf16*>(vc.data_ptr()), reinterpret_cast<bf16*>(k_cache.data_ptr()),
        reinterpret_cast<bf16*>(v_cache.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()),
        tokens, heads, kv_heads, head_dim, start_pos, static_cast<float>(scale));
  return out;
}

}  // namespace kiln

TORCH_LIBRARY(kiln, m) {
  m.def("select_isa(str isa) -> str", &kiln::select_isa);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "int start_pos, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("rms_norm", &kiln::rms_norm);
  m.impl("attention", &kiln::attention);
}
