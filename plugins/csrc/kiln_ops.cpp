// kiln's plugin library: every kernel family compiled for each instruction set in one
// translation unit, a dispatch table chosen once when the library loads, and the torch ops
// (namespace `kiln`) that the model calls. Fake (meta) implementations live in
// kiln/plugins/ops.py so the ops trace and export.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace kiln {

struct PagedShape {
  int64_t tokens, seqs, heads, kv_heads, head_dim, block_size, max_blocks;
  int64_t key_hadamard = 0;  // 0, or the block size of the Walsh-Hadamard transform of q and k after RoPE
};

namespace scalar {
#define KILN_ISA_SCALAR
#include "vec.h"
#include "rmsnorm.h"
#include "attention.h"
#include "linear.h"
#include "quant.h"
#undef KILN_ISA_SCALAR
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define KILN_ISA_AVX2
#include "vec.h"
#include "rmsnorm.h"
#include "attention.h"
#include "linear.h"
#include "quant.h"
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
#include "linear.h"
#include "quant.h"
#undef KILN_ISA_AVX512
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c")
namespace avx512bf16 {  // AVX512-BF16 and AVX512-VNNI (Cooper Lake, Sapphire Rapids, Zen 4 and later)
#define KILN_ISA_AVX512
#define KILN_ISA_AVX512BF16
#define KILN_ISA_VNNI
#include "vec.h"
#include "rmsnorm.h"
#include "attention.h"
#include "linear.h"
#include "quant.h"
#undef KILN_ISA_VNNI
#undef KILN_ISA_AVX512BF16
#undef KILN_ISA_AVX512
}  // namespace avx512bf16
#pragma GCC pop_options

using bf16 = c10::BFloat16;

struct Kernels {
  std::string isa;
  void (*rms_norm_f32)(const float*, const float*, float*, int64_t, int64_t, float);
  void (*rms_norm_bf16)(const bf16*, const bf16*, bf16*, int64_t, int64_t, float);
  void (*add_rms_norm_f32)(float*, const float*, const float*, float*, int64_t, int64_t, float);
  void (*add_rms_norm_bf16)(bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, float);
  void (*silu_mul_f32)(const float*, float*, int64_t, int64_t);
  void (*silu_mul_bf16)(const bf16*, bf16*, int64_t, int64_t);
  void (*linear_f32)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t);
  void (*linear_bf16)(const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t);
  using AttentionF32 = void (*)(const float*, const float*, const float*, void*, void*, float*, const int32_t*,
                                const int32_t*, const int32_t*, const int32_t*, const PagedShape&, float,
                                const float*);
  using AttentionBF16 = void (*)(const bf16*, const bf16*, const bf16*, void*, void*, bf16*, const int32_t*,
                                 const int32_t*, const int32_t*, const int32_t*, const PagedShape&, float,
                                 const float*);
  AttentionF32 paged_attention_f32, paged_attention_f32_i8, paged_attention_f32_fp8;
  AttentionBF16 paged_attention_bf16, paged_attention_bf16_i8, paged_attention_bf16_fp8;
  void (*linear_w8_f32)(const float*, const int8_t*, const float*, const float*, float*, int64_t, int64_t, int64_t);
  void (*linear_w8_bf16)(const bf16*, const int8_t*, const float*, const bf16*, bf16*, int64_t, int64_t, int64_t);
  void (*linear_w4_f32)(const float*, const uint8_t*, const float*, int64_t, const float*, float*, int64_t, int64_t,
                        int64_t);
  void (*linear_w4_bf16)(const bf16*, const uint8_t*, const float*, int64_t, const bf16*, bf16*, int64_t, int64_t,
                         int64_t);
  void (*dequantize_int4_f32)(const uint8_t*, const float*, int64_t, float*, int64_t, int64_t);
  void (*dequantize_int4_bf16)(const uint8_t*, const float*, int64_t, bf16*, int64_t, int64_t);
  void (*linear_w4_tiled_f32)(const float*, const uint8_t*, const float*, int64_t, const float*, float*, int64_t,
                              int64_t, int64_t);
  void (*linear_w4_tiled_bf16)(const bf16*, const uint8_t*, const float*, int64_t, const bf16*, bf16*, int64_t,
                               int64_t, int64_t);
  void (*linear_w8_tiled_f32)(const float*, const uint8_t*, const float*, const float*, float*, int64_t, int64_t,
                              int64_t);
  void (*linear_w8_tiled_bf16)(const bf16*, const uint8_t*, const float*, const bf16*, bf16*, int64_t, int64_t,
                               int64_t);
  void (*dequantize_int8_tiled_f32)(const uint8_t*, const float*, float*, int64_t, int64_t);
  void (*dequantize_int8_tiled_bf16)(const uint8_t*, const float*, bf16*, int64_t, int64_t);
  void (*linear_w4a8_tiled_f32)(const float*, const uint8_t*, const float*, int64_t, const float*, float*, int64_t,
                                int64_t, int64_t);
  void (*linear_w4a8_tiled_bf16)(const bf16*, const uint8_t*, const float*, int64_t, const bf16*, bf16*, int64_t,
                                 int64_t, int64_t);
  void (*dequantize_int4_tiled_f32)(const uint8_t*, const float*, int64_t, float*, int64_t, int64_t);
  void (*dequantize_int4_tiled_bf16)(const uint8_t*, const float*, int64_t, bf16*, int64_t, int64_t);
  void (*linear_w8a8_f32)(const float*, const int8_t*, const float*, const int32_t*, float, const float*, float*, int64_t,
                          int64_t, int64_t);
  void (*linear_w8a8_bf16)(const bf16*, const int8_t*, const float*, const int32_t*, float, const bf16*, bf16*, int64_t,
                           int64_t, int64_t);
  void (*linear_w4a8_f32)(const float*, const uint8_t*, const float*, int64_t, const float*, float*, int64_t,
                          int64_t, int64_t);
  void (*linear_w4a8_bf16)(const bf16*, const uint8_t*, const float*, int64_t, const bf16*, bf16*, int64_t,
                           int64_t, int64_t);
  void (*linear_fp8_f32)(const float*, const uint8_t*, const float*, const float*, float*, int64_t, int64_t, int64_t);
  void (*linear_fp8_bf16)(const bf16*, const uint8_t*, const float*, const bf16*, bf16*, int64_t, int64_t, int64_t);
  void (*quantize_fp8_f32)(const float*, float*, int64_t, float);
  void (*quantize_fp8_bf16)(const bf16*, bf16*, int64_t, float);
  void (*dequantize_fp8_f32)(const uint8_t*, float*, int64_t);
  void (*dequantize_fp8_bf16)(const uint8_t*, bf16*, int64_t);
};

#define KILN_KERNELS(ns)                                                              \
  Kernels {                                                                           \
    #ns, ns::rms_norm_f32, ns::rms_norm_bf16, ns::add_rms_norm_f32, ns::add_rms_norm_bf16,      \
        ns::silu_mul_f32, ns::silu_mul_bf16, ns::linear_f32, ns::linear_bf16,                   \
        ns::paged_attention_f32, ns::paged_attention_f32_i8, ns::paged_attention_f32_fp8,             \
        ns::paged_attention_bf16, ns::paged_attention_bf16_i8, ns::paged_attention_bf16_fp8,          \
        ns::linear_w8_f32, ns::linear_w8_bf16,                                                        \
        ns::linear_w4_f32, ns::linear_w4_bf16, ns::dequantize_int4_f32, ns::dequantize_int4_bf16,    \
        ns::linear_w4_tiled_f32, ns::linear_w4_tiled_bf16, ns::linear_w8_tiled_f32, ns::linear_w8_tiled_bf16,\
        ns::dequantize_int8_tiled_f32, ns::dequantize_int8_tiled_bf16, ns::linear_w4a8_tiled_f32,                                       \
        ns::linear_w4a8_tiled_bf16, ns::dequantize_int4_tiled_f32,                                      \
        ns::dequantize_int4_tiled_bf16,                                                               \
        ns::linear_w8a8_f32, ns::linear_w8a8_bf16, ns::linear_w4a8_f32, ns::linear_w4a8_bf16,      \
        ns::linear_fp8_f32, ns::linear_fp8_bf16, ns::quantize_fp8_f32, ns::quantize_fp8_bf16,        \
        ns::dequantize_fp8_f32, ns::dequantize_fp8_bf16                                              \
  }

static bool host_supports(const std::string& isa) {
  if (isa == "avx512bf16")
    return host_supports("avx512") && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == "scalar";
}

static Kernels kernels_for(const std::string& requested) {
  std::string isa = requested;
  if (isa == "auto")
    isa = host_supports("avx512bf16") ? "avx512bf16"
          : host_supports("avx512")   ? "avx512"
          : host_supports("avx2")     ? "avx2"
                                      : "scalar";
  TORCH_CHECK(isa == "avx512bf16" || isa == "avx512" || isa == "avx2" || isa == "scalar",
              "kiln: unknown ISA '", requested, "'; expected auto, avx512bf16, avx512, avx2 or scalar");
  TORCH_CHECK(host_supports(isa), "kiln: this CPU does not support ISA '", isa, "'");
  if (isa == "avx512bf16") return KILN_KERNELS(avx512bf16);
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

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  check_float_or_bf16(residual, "residual");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  x.scalar_type() == residual.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "kiln::add_rms_norm: residual must be contiguous and match x (", residual.sizes(), " vs ",
              x.sizes(), ") and weight in dtype");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "kiln::add_rms_norm: weight shape ",
              weight.sizes(), " does not match last dim ", n);
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(residual);
  const int64_t rows = n == 0 ? 0 : xc.numel() / n;
  if (x.scalar_type() == at::kFloat)
    active().add_rms_norm_f32(residual.data_ptr<float>(), xc.data_ptr<float>(), wc.data_ptr<float>(),
                              out.data_ptr<float>(), rows, n, static_cast<float>(eps));
  else
    active().add_rms_norm_bf16(reinterpret_cast<bf16*>(residual.data_ptr()),
                               reinterpret_cast<const bf16*>(xc.data_ptr()),
                               reinterpret_cast<const bf16*>(wc.data_ptr()),
                               reinterpret_cast<bf16*>(out.data_ptr()), rows, n, static_cast<float>(eps));
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float_or_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "kiln::silu_mul: last dim ",
              gate_up.size(-1), " of gate_up must be even (gate, then up)");
  auto gu = gate_up.contiguous();
  const int64_t n = gu.size(-1) / 2;
  auto sizes = gu.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, gu.options());
  const int64_t rows = n == 0 ? 0 : gu.numel() / (2 * n);
  if (gu.scalar_type() == at::kFloat)
    active().silu_mul_f32(gu.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  else
    active().silu_mul_bf16(reinterpret_cast<const bf16*>(gu.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()),
                           rows, n);
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "kiln::linear: weight must be a contiguous [out, in] tensor of x's dtype");
  const int64_t k = weight.size(1), n = weight.size(0);
  TORCH_CHECK(x.size(-1) == k, "kiln::linear: x's last dim ", x.size(-1), " differs from in_features ", k);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == x.scalar_type() &&
                    bias->is_contiguous(),
                "kiln::linear: bias must be a contiguous [", n, "] tensor of x's dtype");
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, xc.options());
  const int64_t rows = k == 0 ? 0 : xc.numel() / k;
  if (x.scalar_type() == at::kFloat)
    active().linear_f32(xc.data_ptr<float>(), weight.data_ptr<float>(),
                        bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), rows, k, n);
  else
    active().linear_bf16(reinterpret_cast<const bf16*>(xc.data_ptr()), reinterpret_cast<const bf16*>(weight.data_ptr()),
                         bias.has_value() ? reinterpret_cast<const bf16*>(bias->data_ptr()) : nullptr,
                         reinterpret_cast<bf16*>(out.data_ptr()), rows, k, n);
  return out;
}

static void check_int32_vector(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == dims && t.is_contiguous() && t.device().is_cpu(),
              "kiln::paged_attention: ", name, " must be a contiguous int32 CPU tensor with ", dims,
              " dims, got ", t.scalar_type(), " ", t.sizes());
}

// paged_attention's checks, all made before any write (a bad table must not scribble over the
// pool) -> the batch's shape, and each token's sequence in token_seq
static PagedShape check_paged(const at::Tensor& qkv, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& block_tables, const at::Tensor& query_start,
                              const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                              int64_t heads, const c10::optional<at::Tensor>& kv_scales, int64_t key_hadamard,
                              std::vector<int32_t>& token_seq) {
  check_float_or_bf16(qkv, "qkv");
  const auto pool_type = k_pool.scalar_type();
  const bool quantized = pool_type == at::kChar || pool_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes(),
              "kiln::paged_attention: pools must be contiguous [blocks, block_size, kv_heads, head_dim]");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cos, "cos"}, {sin, "sin"}})
    TORCH_CHECK(t.scalar_type() == qkv.scalar_type(), "kiln::paged_attention: ", name, " dtype ",
                t.scalar_type(), " differs from qkv dtype ", qkv.scalar_type());
  TORCH_CHECK(v_pool.scalar_type() == pool_type && (quantized || pool_type == qkv.scalar_type()),
              "kiln::paged_attention: the pools must both be int8, float8_e4m3fn or qkv's dtype ",
              qkv.scalar_type(), ", got ", pool_type, " and ", v_pool.scalar_type());
  check_int32_vector(block_tables, "block_tables", 2);
  check_int32_vector(query_start, "query_start", 1);
  check_int32_vector(context_lens, "context_lens", 1);
  const int64_t kv_heads = k_pool.size(2), head_dim = k_pool.size(3);
  PagedShape shape{qkv.size(0), context_lens.size(0), heads, kv_heads, head_dim, k_pool.size(1),
                   block_tables.size(1), key_hadamard};
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * head_dim,
              "kiln::paged_attention: qkv ", qkv.sizes(), " is not [tokens, (", heads, " + 2 x ",
              kv_heads, ") x ", head_dim, "]");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
              "kiln::paged_attention: heads ", heads, " must be a multiple of kv_heads ", kv_heads,
              " and head_dim ", head_dim, " even");
  TORCH_CHECK(key_hadamard == 0 || (key_hadamard >= 2 && (key_hadamard & (key_hadamard - 1)) == 0 &&
                                    head_dim % key_hadamard == 0),
              "kiln::paged_attention: key_hadamard must be 0 or a power of two dividing head_dim ", head_dim,
              ", got ", key_hadamard);
  TORCH_CHECK(quantized == kv_scales.has_value(), "kiln::paged_attention: kv_scales go with an int8 or ",
              "float8_e4m3fn pool, and only with one");
  if (quantized)
    TORCH_CHECK(kv_scales->scalar_type() == at::kFloat && kv_scales->is_contiguous() && kv_scales->dim() == 2 &&
                    kv_scales->size(0) == 2 && kv_scales->size(1) == kv_heads * head_dim,
                "kiln::paged_attention: kv_scales must be contiguous float32 [2, ", kv_heads * head_dim, "], got ",
                kv_scales->sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim && sin.sizes() == cos.sizes() &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "kiln::paged_attention: cos/sin must be contiguous [positions, ", head_dim, "]");
  TORCH_CHECK(query_start.size(0) == shape.seqs + 1 && block_tables.size(0) == shape.seqs,
              "kiln::paged_attention: ", shape.seqs, " sequences need query_start of ", shape.seqs + 1,
              " and block_tables of ", shape.seqs, " rows");
  // Validate the metadata before any write: a bad table must not scribble over the pool.
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_pool.size(0);
  TORCH_CHECK(qs[0] == 0 && qs[shape.seqs] == shape.tokens,
              "kiln::paged_attention: query_start must run from 0 to the token count");
  token_seq.assign(shape.tokens, 0);
  for (int64_t s = 0; s < shape.seqs; ++s) {
    TORCH_CHECK(qs[s + 1] >= qs[s] && cl[s] >= 0, "kiln::paged_attention: bad query_start/context_lens");
    const int64_t end = static_cast<int64_t>(cl[s]) + (qs[s + 1] - qs[s]);
    const int64_t used = (end + shape.block_size - 1) / shape.block_size;
    TORCH_CHECK(used <= shape.max_blocks, "kiln::paged_attention: sequence ", s, " reaches position ",
                end, ", beyond its block table of ", shape.max_blocks, " blocks");
    TORCH_CHECK(end <= cos.size(0), "kiln::paged_attention: sequence ", s, " reaches position ", end,
                ", beyond the rotary tables of ", cos.size(0), " positions");
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = bt[s * shape.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "kiln::paged_attention: block id ", block,
                  " outside the pool of ", num_blocks);
    }
    std::fill(token_seq.begin() + qs[s], token_seq.begin() + qs[s + 1], static_cast<int32_t>(s));
  }
  return shape;
}

// paged_attention on checked arguments, the pools given as pointers of type pool_type
static at::Tensor run_paged(const at::Tensor& qkv, void* k_pool, void* v_pool, at::ScalarType pool_type,
                            const at::Tensor& block_tables, const at::Tensor& query_start,
                            const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                            const PagedShape& shape, const std::vector<int32_t>& token_seq, double scale,
                            const c10::optional<at::Tensor>& kv_scales) {
  const bool quantized = pool_type == at::kChar || pool_type == at::kFloat8_e4m3fn;
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t heads = shape.heads, head_dim = shape.head_dim;
  auto qkvc = qkv.contiguous();
  auto out = at::empty({shape.tokens, heads * head_dim}, qkvc.options());
  if (shape.tokens == 0) return out;
  const float* ks = quantized ? kv_scales->data_ptr<float>() : nullptr;
  const Kernels& k = active();
  if (qkv.scalar_type() == at::kFloat) {
    auto f = pool_type == at::kChar ? k.paged_attention_f32_i8 : quantized ? k.paged_attention_f32_fp8
                                                                          : k.paged_attention_f32;
    f(qkvc.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), k_pool, v_pool,
      out.data_ptr<float>(), bt, qs, cl, token_seq.data(), shape, static_cast<float>(scale), ks);
  } else {
    auto f = pool_type == at::kChar ? k.paged_attention_bf16_i8 : quantized ? k.paged_attention_bf16_fp8
                                                                           : k.paged_attention_bf16;
    f(reinterpret_cast<const bf16*>(qkvc.data_ptr()), reinterpret_cast<const bf16*>(cos.data_ptr()),
      reinterpret_cast<const bf16*>(sin.data_ptr()), k_pool, v_pool,
      reinterpret_cast<bf16*>(out.data_ptr()), bt, qs, cl, token_seq.data(), shape, static_cast<float>(scale), ks);
  }
  return out;
}

at::Tensor paged_attention(const at::Tensor& qkv, at::Tensor& k_pool, at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                           int64_t heads, double scale, const c10::optional<at::Tensor>& kv_scales,
                           int64_t key_hadamard) {
  std::vector<int32_t> token_seq;
  const PagedShape shape = check_paged(qkv, k_pool, v_pool, block_tables, query_start, context_lens, cos, sin, heads,
                                       kv_scales, key_hadamard, token_seq);
  return run_paged(qkv, k_pool.data_ptr(), v_pool.data_ptr(), k_pool.scalar_type(), block_tables, query_start,
                   context_lens, cos, sin, shape, token_seq, scale, kv_scales);
}

// --- quantized linears -----------------------------------------------------------------
static void check_linear_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, at::ScalarType wtype,
                              const at::Tensor& scales, int64_t k, const c10::optional<at::Tensor>& bias) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == wtype && qweight.is_contiguous(), "kiln::", op,
              ": qweight must be a contiguous 2-d ", wtype, " tensor, got ", qweight.scalar_type(), " ",
              qweight.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == qweight.size(0),
              "kiln::", op, ": scales must be contiguous float32 with ", qweight.size(0), " rows");
  TORCH_CHECK(x.size(-1) == k, "kiln::", op, ": x's last dim ", x.size(-1), " differs from in_features ", k);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == qweight.size(0) && bias->scalar_type() == x.scalar_type() &&
                    bias->is_contiguous(),
                "kiln::", op, ": bias must be a contiguous [", qweight.size(0), "] tensor of x's dtype");
}

template <typename F32, typename BF16, typename... Args>
static at::Tensor run_linear(const at::Tensor& x, int64_t k, int64_t n, const c10::optional<at::Tensor>& bias,
                             F32 f32, BF16 bf, Args... args) {
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, xc.options());
  const int64_t rows = k == 0 ? 0 : xc.numel() / k;
  if (rows == 0) return out;
  if (x.scalar_type() == at::kFloat)
    f32(xc.data_ptr<float>(), args..., bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(),
        rows, k, n);
  else
    bf(reinterpret_cast<const bf16*>(xc.data_ptr()), args...,
       bias.has_value() ? reinterpret_cast<const bf16*>(bias->data_ptr()) : nullptr,
       reinterpret_cast<bf16*>(out.data_ptr()), rows, k, n);
  return out;
}

// one-byte weights W [out, in] with one scale per output channel (int8_t; FP8 as uint8_t bits)
template <typename W, typename F32, typename BF16>
static at::Tensor per_channel_linear(const char* op, const at::Tensor& x, const at::Tensor& qweight,
                                     at::ScalarType wtype, const at::Tensor& scales,
                                     const c10::optional<at::Tensor>& bias, F32 f32, BF16 bf) {
  const int64_t k = qweight.size(1), n = qweight.size(0);
  check_linear_args(op, x, qweight, wtype, scales, k, bias);
  TORCH_CHECK(scales.dim() == 1, "kiln::", op, ": scales must be [out]");
  return run_linear(x, k, n, bias, f32, bf, static_cast<const W*>(qweight.data_ptr()), scales.data_ptr<float>());
}

at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  return per_channel_linear<int8_t>("linear_w8", x, qweight, at::kChar, scales, bias, active().linear_w8_f32,
                            active().linear_w8_bf16);
}

static int64_t check_int4(const char* op, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  const int64_t k = qweight.size(1) * 2;
  TORCH_CHECK(group > 0 && scales.dim() == 2 && scales.size(1) == (k + group - 1) / group, "kiln::", op,
              ": scales must be [out, ceil(in / group_size)] = [", qweight.size(0), ", ", (k + group - 1) / std::max<int64_t>(group, 1),
              "], got ", scales.sizes());
  return k;
}

// int4 weights packed two per byte along `in` [out, in / 2], one scale per group of inputs
template <typename F32, typename BF16>
static at::Tensor group_linear(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               int64_t group_size, const c10::optional<at::Tensor>& bias, F32 f32, BF16 bf) {
  TORCH_CHECK(qweight.dim() == 2, "kiln::", op, ": qweight must be [out, in / 2]");
  const int64_t k = check_int4(op, qweight, scales, group_size), n = qweight.size(0);
  check_linear_args(op, x, qweight, at::kByte, scales, k, bias);
  return run_linear(x, k, n, bias, f32, bf, static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                    group_size);
}

at::Tensor linear_w4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size,
                     const c10::optional<at::Tensor>& bias) {
  return group_linear("linear_w4", x, qweight, scales, group_size, bias, active().linear_w4_f32,
                      active().linear_w4_bf16);
}

at::Tensor linear_w4a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size,
                       const c10::optional<at::Tensor>& bias) {
  return group_linear("linear_w4a8", x, qweight, scales, group_size, bias, active().linear_w4a8_f32,
                      active().linear_w4a8_bf16);
}

at::Tensor dequantize_int4(const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size,
                           at::ScalarType dtype) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == qweight.size(0),
              "kiln::dequantize_int4: qweight must be contiguous uint8 [out, in / 2], scales float32 [out, groups]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "kiln::dequantize_int4: dtype must be float32 or bfloat16");
  const int64_t k = check_int4("dequantize_int4", qweight, scales, group_size), n = qweight.size(0);
  auto out = at::empty({n, k}, qweight.options().dtype(dtype));
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  if (dtype == at::kFloat)
    active().dequantize_int4_f32(w, scales.data_ptr<float>(), group_size, out.data_ptr<float>(), k, n);
  else
    active().dequantize_int4_bf16(w, scales.data_ptr<float>(), group_size, reinterpret_cast<bf16*>(out.data_ptr()), k, n);
  return out;
}

// --- weights in 2 MB pages ------------------------------------------------------------------
// Decode streams every weight once per step; with 4 KB pages the walk through a few hundred MB
// misses the TLB often (SmolLM2 int8_wo, one thread, its row-layout weights in ordinary
// anonymous memory / the safetensors file's pages / 2 MB pages: 6.5 / 6.7 / 6.1 ms a step;
// benchmarks/ablations/decode_variants.py --memory).
// The memory is asked for transparent huge pages (madvise; where the kernel has them off it
// stays ordinary pages and nothing else changes).
constexpr size_t kHugePage = size_t(2) << 20;

static at::Tensor empty_hugepages(at::IntArrayRef sizes, at::TensorOptions options) {
  int64_t count = 1;
  for (auto d : sizes) count *= d;
  const size_t bytes = static_cast<size_t>(count) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  const size_t size = std::max(kHugePage, (bytes + kHugePage - 1) / kHugePage * kHugePage);
  void* p = std::aligned_alloc(kHugePage, size);
  TORCH_CHECK(p != nullptr, "kiln: out of memory allocating ", size, " bytes for weights");
  madvise(p, size, MADV_HUGEPAGE);  // a hint; its failure leaves ordinary pages
  return at::from_blob(p, sizes, [](void* q) { std::free(q); }, options.device(at::kCPU));
}

at::Tensor to_hugepages(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "kiln::to_hugepages: t must be on the CPU");
  auto src = t.contiguous();
  auto out = empty_hugepages(src.sizes(), src.options());
  if (src.numel() > 0) std::memcpy(out.data_ptr(), src.data_ptr(), src.numel() * src.element_size());
  return out;
}

// The tiled int4 layout (quant.h, TiledLayout): the same bytes and scales as the stored [out, in / 2]
// and [out, groups] tensors, reordered for linear_w4_tiled; shapes are kept.
static void check_tiled(const char* op, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == qweight.size(0),
              "kiln::", op, ": qweight must be contiguous uint8 [out, in / 2], scales float32 [out, groups]");
  const int64_t k = check_int4(op, qweight, scales, group), n = qweight.size(0);
  TORCH_CHECK(n % scalar::kTileRows == 0 && k % 8 == 0 && group % 8 == 0 && group <= scalar::kTiledMaxGroup, "kiln::", op,
              ": the tiled int4 layout needs out % ", scalar::kTileRows, " == 0, in % 8 == 0 and group_size a multiple of 8 "
              "up to ", scalar::kTiledMaxGroup, ", got out ", n, ", in ", k, ", group_size ", group);
}

std::tuple<at::Tensor, at::Tensor> pack_int4_tiled(const at::Tensor& qweight, const at::Tensor& scales,
                                                   int64_t group_size) {
  check_tiled("pack_int4_tiled", qweight, scales, group_size);
  auto packed = empty_hugepages(qweight.sizes(), qweight.options());
  auto packed_scales = at::empty_like(scales);
  scalar::pack_int4_tiled(static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(), group_size,
                          static_cast<uint8_t*>(packed.data_ptr()), packed_scales.data_ptr<float>(),
                          qweight.size(1) * 2, qweight.size(0));
  return {packed, packed_scales};
}

at::Tensor linear_w4_tiled(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           int64_t group_size, const c10::optional<at::Tensor>& bias) {
  check_tiled("linear_w4_tiled", qweight, scales, group_size);
  return group_linear("linear_w4_tiled", x, qweight, scales, group_size, bias, active().linear_w4_tiled_f32,
                      active().linear_w4_tiled_bf16);
}

// The tiled int8 layout: [out, in] bytes (value + 128 as uint8) in the int4 tiling's order with
// blocks of 4 inputs; the scales stay [out].
static void check_tiled8(const char* op, const at::Tensor& qweight, at::ScalarType wtype) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == wtype && qweight.is_contiguous(), "kiln::", op,
              ": qweight must be a contiguous 2-d ", wtype, " tensor, got ", qweight.scalar_type(), " ",
              qweight.sizes());
  TORCH_CHECK(qweight.size(0) % scalar::kTileRows == 0 && qweight.size(1) % 4 == 0, "kiln::", op,
              ": the tiled int8 layout needs out % ", scalar::kTileRows, " == 0 and in % 4 == 0, got ",
              qweight.sizes());
}

at::Tensor pack_int8_tiled(const at::Tensor& qweight) {
  check_tiled8("pack_int8_tiled", qweight, at::kChar);
  auto packed = empty_hugepages(qweight.sizes(), qweight.options().dtype(at::kByte));
  scalar::pack_int8_tiled(static_cast<const int8_t*>(qweight.data_ptr()), static_cast<uint8_t*>(packed.data_ptr()),
                          qweight.size(1), qweight.size(0));
  return packed;
}

at::Tensor linear_w8_tiled(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& bias) {
  check_tiled8("linear_w8_tiled", qweight, at::kByte);
  return per_channel_linear<uint8_t>("linear_w8_tiled", x, qweight, at::kByte, scales, bias,
                                     active().linear_w8_tiled_f32, active().linear_w8_tiled_bf16);
}

at::Tensor dequantize_int8_tiled(const at::Tensor& qweight, const at::Tensor& scales, at::ScalarType dtype) {
  check_tiled8("dequantize_int8_tiled", qweight, at::kByte);
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == qweight.size(0),
              "kiln::dequantize_int8_tiled: scales must be contiguous float32 [", qweight.size(0), "]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "kiln::dequantize_int8_tiled: dtype must be float32 or bfloat16");
  auto out = at::empty(qweight.sizes(), qweight.options().dtype(dtype));
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  if (dtype == at::kFloat)
    active().dequantize_int8_tiled_f32(w, scales.data_ptr<float>(), out.data_ptr<float>(), qweight.size(1),
                                       qweight.size(0));
  else
    active().dequantize_int8_tiled_bf16(w, scales.data_ptr<float>(), reinterpret_cast<bf16*>(out.data_ptr()),
                                        qweight.size(1), qweight.size(0));
  return out;
}

std::string active_isa() { return active().isa; }

at::Tensor linear_w4a8_tiled(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             int64_t group_size, const c10::optional<at::Tensor>& bias) {
  check_tiled("linear_w4a8_tiled", qweight, scales, group_size);
  return group_linear("linear_w4a8_tiled", x, qweight, scales, group_size, bias, active().linear_w4a8_tiled_f32,
                      active().linear_w4a8_tiled_bf16);
}

at::Tensor dequantize_int4_tiled(const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size,
                                 at::ScalarType dtype) {
  check_tiled("dequantize_int4_tiled", qweight, scales, group_size);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "kiln::dequantize_int4_tiled: dtype must be float32 or bfloat16");
  const int64_t k = qweight.size(1) * 2, n = qweight.size(0);
  auto out = at::empty({n, k}, qweight.options().dtype(dtype));
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  if (dtype == at::kFloat)
    active().dequantize_int4_tiled_f32(w, scales.data_ptr<float>(), group_size, out.data_ptr<float>(), k, n);
  else
    active().dequantize_int4_tiled_bf16(w, scales.data_ptr<float>(), group_size,
                                        reinterpret_cast<bf16*>(out.data_ptr()), k, n);
  return out;
}

at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& weight_sum, const c10::optional<at::Tensor>& bias, double input_scale) {
  const int64_t k = qweight.size(1), n = qweight.size(0);
  check_linear_args("linear_w8a8", x, qweight, at::kChar, scales, k, bias);
  TORCH_CHECK(std::isfinite(input_scale) && input_scale >= 0, "kiln::linear_w8a8: input_scale must be 0 (per-row "
              "dynamic) or a positive static scale, got ", input_scale);
  TORCH_CHECK(weight_sum.scalar_type() == at::kInt && weight_sum.is_contiguous() && weight_sum.numel() == n,
              "kiln::linear_w8a8: weight_sum must be contiguous int32 [", n, "]");
  return run_linear(x, k, n, bias, active().linear_w8a8_f32, active().linear_w8a8_bf16,
                    static_cast<const int8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                    weight_sum.data_ptr<int32_t>(), static_cast<float>(input_scale));
}

at::Tensor linear_fp8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias) {
  return per_channel_linear<uint8_t>("linear_fp8", x, qweight, at::kFloat8_e4m3fn, scales, bias, active().linear_fp8_f32,
                            active().linear_fp8_bf16);
}

at::Tensor dequantize_fp8(const at::Tensor& qweight, at::ScalarType dtype) {
  TORCH_CHECK(qweight.scalar_type() == at::kFloat8_e4m3fn && qweight.is_contiguous() && qweight.device().is_cpu(),
              "kiln::dequantize_fp8: qweight must be a contiguous float8_e4m3fn CPU tensor, got ",
              qweight.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "kiln::dequantize_fp8: dtype must be float32 or bfloat16");
  auto out = at::empty(qweight.sizes(), qweight.options().dtype(dtype));
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  if (dtype == at::kFloat)
    active().dequantize_fp8_f32(w, out.data_ptr<float>(), qweight.numel());
  else
    active().dequantize_fp8_bf16(w, reinterpret_cast<bf16*>(out.data_ptr()), qweight.numel());
  return out;
}

at::Tensor quantize_fp8(const at::Tensor& x, double inv_scale) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(std::isfinite(inv_scale) && inv_scale > 0, "kiln::quantize_fp8: inv_scale must be positive, got ",
              inv_scale);
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const float inv = static_cast<float>(inv_scale);
  if (x.scalar_type() == at::kFloat)
    active().quantize_fp8_f32(xc.data_ptr<float>(), out.data_ptr<float>(), xc.numel(), inv);
  else
    active().quantize_fp8_bf16(reinterpret_cast<const bf16*>(xc.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()),
                               xc.numel(), inv);
  return out;
}

// --- every decoder layer of a decode step in one call -----------------------------------
// LlamaModel.forward's layer loop for a few rows (kiln/runtime/model.py), run here instead of
// op by op from Python: the same functions in the same order, so the numbers are bit for bit
// those of the Python loop, without the interpreter and the dispatcher between the ~240 kernel
// calls of a step. Each linear is kLinearSlots tensors (weight or qweight, scales, bias,
// pre_scale, weight_sum; None where unused), two ints (kind, group_size) and two floats (the
// W8A8 static input scale, FP8 activations' 1 / input_scale), as runtime/linear.py's plan()
// describes it; a layer adds its post-attention norm, the next norm and its KV scales.
enum LinearKind : int64_t { kDense, kInt8, kInt4, kInt4Tiled, kW4A8, kW4A8Tiled, kW8A8, kFp8, kInt8Tiled };
constexpr int64_t kLinearSlots = 5, kLayerSlots = 4 * kLinearSlots + 3;

using OptionalTensors = c10::List<c10::optional<at::Tensor>>;

static at::Tensor planned_linear(const at::Tensor& x, const OptionalTensors& t, int64_t base, int64_t kind,
                                 int64_t group, double input_scale, double inv_input_scale) {
  const c10::optional<at::Tensor> weight = t.get(base), scales = t.get(base + 1), bias = t.get(base + 2),
                                  pre_scale = t.get(base + 3), weight_sum = t.get(base + 4);
  TORCH_CHECK(weight.has_value() && (kind == kDense || scales.has_value()),
              "kiln::decode_layers: a linear's plan lacks its weight or scales");
  at::Tensor in = pre_scale.has_value() ? x * *pre_scale : x;  // as QuantLinear.__call__
  if (inv_input_scale > 0) in = quantize_fp8(in, inv_input_scale);
  switch (kind) {
    case kDense: return in.scalar_type() == at::kBFloat16 ? kiln::linear(in, *weight, bias) : at::linear(in, *weight, bias);
    case kInt8: return linear_w8(in, *weight, *scales, bias);
    case kInt8Tiled: return linear_w8_tiled(in, *weight, *scales, bias);
    case kInt4: return linear_w4(in, *weight, *scales, group, bias);
    case kInt4Tiled: return linear_w4_tiled(in, *weight, *scales, group, bias);
    case kW4A8: return linear_w4a8(in, *weight, *scales, group, bias);
    case kW4A8Tiled: return linear_w4a8_tiled(in, *weight, *scales, group, bias);
    case kW8A8:
      TORCH_CHECK(weight_sum.has_value(), "kiln::decode_layers: a W8A8 linear's plan lacks weight_sum");
      return linear_w8a8(in, *weight, *scales, *weight_sum, bias, input_scale);
    case kFp8: return linear_fp8(in, *weight, *scales, bias);
  }
  TORCH_CHECK(false, "kiln::decode_layers: unknown linear kind ", kind);
}

at::Tensor decode_layers(at::Tensor& h, const at::Tensor& x0, const OptionalTensors& tensors, at::IntArrayRef ints,
                         at::ArrayRef<double> floats, at::Tensor& kv, const at::Tensor& block_tables,
                         const at::Tensor& query_start, const at::Tensor& context_lens, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t heads, double scale, double eps, int64_t key_hadamard) {
  const int64_t layers = kv.dim() == 6 ? kv.size(0) : -1;
  TORCH_CHECK(layers > 0 && kv.size(1) == 2 && kv.is_contiguous(),
              "kiln::decode_layers: kv must be the pool's contiguous [layers, 2, blocks, block_size, kv_heads, "
              "head_dim] storage, got ", kv.sizes());
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * kLayerSlots &&
                  static_cast<int64_t>(ints.size()) == layers * 8 && static_cast<int64_t>(floats.size()) == layers * 8,
              "kiln::decode_layers: the plan has ", tensors.size(), " tensors, ", ints.size(), " ints and ",
              floats.size(), " floats; ", layers, " layers need ", layers * kLayerSlots, ", ", layers * 8, " and ",
              layers * 8);
  at::Tensor x = x0;
  PagedShape shape{};
  std::vector<int32_t> token_seq;
  const bool quantized = kv.scalar_type() == at::kChar || kv.scalar_type() == at::kFloat8_e4m3fn;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t t0 = i * kLayerSlots;
    const int64_t* k = ints.data() + i * 8;
    const double* f = floats.data() + i * 8;
    auto run = [&](const at::Tensor& in, int64_t j) {  // linear j of the layer (qkv, out, gate_up, down)
      return planned_linear(in, tensors, t0 + j * kLinearSlots, k[2 * j], k[2 * j + 1], f[2 * j], f[2 * j + 1]);
    };
    const at::Tensor post_norm = *tensors.get(t0 + 4 * kLinearSlots), next_norm = *tensors.get(t0 + 4 * kLinearSlots + 1);
    const c10::optional<at::Tensor> kv_scales = tensors.get(t0 + 4 * kLinearSlots + 2);
    const at::Tensor qkv = run(x, 0);
    if (i == 0)  // the step's metadata and shapes, checked once: every layer's pool is alike
      shape = check_paged(qkv, kv.select(0, 0).select(0, 0), kv.select(0, 0).select(0, 1), block_tables, query_start,
                          context_lens, cos, sin, heads, kv_scales, key_hadamard, token_seq);
    TORCH_CHECK(kv_scales.has_value() == quantized &&
                    (!quantized || kv_scales->numel() == 2 * shape.kv_heads * shape.head_dim),
                "kiln::decode_layers: layer ", i, "'s kv_scales do not match its pool");
    char* k_pool = static_cast<char*>(kv.data_ptr()) + i * kv.stride(0) * kv.element_size();
    const at::Tensor attn = run_paged(qkv, k_pool, k_pool + kv.stride(1) * kv.element_size(), kv.scalar_type(),
                                      block_tables, query_start, context_lens, cos, sin, shape, token_seq, scale,
                                      kv_scales);
    x = add_rms_norm(h, run(attn, 1), post_norm, eps);
    x = add_rms_norm(h, run(silu_mul(run(x, 2)), 3), next_norm, eps);
  }
  return x;
}

}  // namespace kiln

TORCH_LIBRARY(kiln, m) {
  m.def("select_isa(str isa) -> str", &kiln::select_isa);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "paged_attention(Tensor qkv, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor block_tables, "
      "Tensor query_start, Tensor context_lens, Tensor cos, Tensor sin, int heads, float scale, "
      "Tensor? kv_scales=None, int key_hadamard=0) -> Tensor");
  m.def("linear_w8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("linear_w4(Tensor x, Tensor qweight, Tensor scales, int group_size, Tensor? bias) -> Tensor");
  m.def("dequantize_int4(Tensor qweight, Tensor scales, int group_size, ScalarType dtype) -> Tensor");
  m.def("pack_int4_tiled(Tensor qweight, Tensor scales, int group_size) -> (Tensor, Tensor)");
  m.def("linear_w4_tiled(Tensor x, Tensor qweight, Tensor scales, int group_size, Tensor? bias) -> Tensor");
  m.def("active_isa() -> str", &kiln::active_isa);
  m.def("to_hugepages(Tensor t) -> Tensor");
  m.def("pack_int8_tiled(Tensor qweight) -> Tensor");
  m.def("linear_w8_tiled(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("dequantize_int8_tiled(Tensor qweight, Tensor scales, ScalarType dtype) -> Tensor");
  m.def("linear_w4a8_tiled(Tensor x, Tensor qweight, Tensor scales, int group_size, Tensor? bias) -> Tensor");
  m.def("decode_layers(Tensor(a!) h, Tensor x, Tensor?[] tensors, int[] ints, float[] floats, Tensor(b!) kv, "
        "Tensor block_tables, Tensor query_start, Tensor context_lens, Tensor cos, Tensor sin, int heads, "
        "float scale, float eps, int key_hadamard=0) -> Tensor");
  m.def("dequantize_int4_tiled(Tensor qweight, Tensor scales, int group_size, ScalarType dtype) -> Tensor");
  m.def("linear_w8a8(Tensor x, Tensor qweight, Tensor scales, Tensor weight_sum, Tensor? bias, float input_scale=0.) "
        "-> Tensor");
  m.def("linear_w4a8(Tensor x, Tensor qweight, Tensor scales, int group_size, Tensor? bias) -> Tensor");
  m.def("linear_fp8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("quantize_fp8(Tensor x, float inv_scale) -> Tensor");
  m.def("dequantize_fp8(Tensor qweight, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("rms_norm", &kiln::rms_norm);
  m.impl("add_rms_norm", &kiln::add_rms_norm);
  m.impl("silu_mul", &kiln::silu_mul);
  m.impl("linear", &kiln::linear);
  m.impl("paged_attention", &kiln::paged_attention);
  m.impl("linear_w8", &kiln::linear_w8);
  m.impl("linear_w4", &kiln::linear_w4);
  m.impl("dequantize_int4", &kiln::dequantize_int4);
  m.impl("pack_int4_tiled", &kiln::pack_int4_tiled);
  m.impl("linear_w4_tiled", &kiln::linear_w4_tiled);
  m.impl("pack_int8_tiled", &kiln::pack_int8_tiled);
  m.impl("to_hugepages", &kiln::to_hugepages);
  m.impl("linear_w8_tiled", &kiln::linear_w8_tiled);
  m.impl("dequantize_int8_tiled", &kiln::dequantize_int8_tiled);
  m.impl("linear_w4a8_tiled", &kiln::linear_w4a8_tiled);
  m.impl("decode_layers", &kiln::decode_layers);
  m.impl("dequantize_int4_tiled", &kiln::dequantize_int4_tiled);
  m.impl("linear_w8a8", &kiln::linear_w8a8);
  m.impl("linear_w4a8", &kiln::linear_w4a8);
  m.impl("linear_fp8", &kiln::linear_fp8);
  m.impl("quantize_fp8", &kiln::quantize_fp8);
  m.impl("dequantize_fp8", &kiln::dequantize_fp8);
}
