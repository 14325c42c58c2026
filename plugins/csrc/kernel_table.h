// The kernel table: every kernel the ops call, one entry each, keyed by name. Each entry sets
// the table's field to the ISA namespace's entry point of that name (kernels/select.h): a
// missing entry point fails to compile, and so does one whose signature differs from the scalar
// one (the fields' types come from kiln::scalar). Nothing is positional, so no two kernels of
// the same type can be swapped by order.
//
// K(ns, field, entry) for each: field of struct Kernels <- ns::entry
#define KILN_KERNEL_LIST(K, ns)                                        \
  K(ns, rms_norm_f32, rms_norm<float>)                                 \
  K(ns, rms_norm_bf16, rms_norm<bf16>)                                 \
  K(ns, add_rms_norm_f32, add_rms_norm<float>)                         \
  K(ns, add_rms_norm_bf16, add_rms_norm<bf16>)                         \
  K(ns, silu_mul_f32, silu_mul<float>)                                 \
  K(ns, silu_mul_bf16, silu_mul<bf16>)                                 \
  K(ns, gelu_tanh_mul_f32, gelu_tanh_mul<float>)                       \
  K(ns, gelu_tanh_mul_bf16, gelu_tanh_mul<bf16>)                       \
  K(ns, linear_f32, linear<float>)                                     \
  K(ns, linear_bf16, linear<bf16>)                                     \
  K(ns, linear_bf16_tiled, linear_bf16_tiled)                          \
  K(ns, paged_attention_f32, paged_attention<float, float>)            \
  K(ns, paged_attention_f32_i8, paged_attention<float, int8_t>)        \
  K(ns, paged_attention_f32_fp8, paged_attention<float, fp8e4m3>)      \
  K(ns, paged_attention_bf16, paged_attention<bf16, bf16>)             \
  K(ns, paged_attention_bf16_i8, paged_attention<bf16, int8_t>)        \
  K(ns, paged_attention_bf16_fp8, paged_attention<bf16, fp8e4m3>)      \
  K(ns, linear_w8_f32, linear_w8<float>)                               \
  K(ns, linear_w8_bf16, linear_w8<bf16>)                               \
  K(ns, linear_w8_tiled_f32, linear_w8_tiled<float>)                   \
  K(ns, linear_w8_tiled_bf16, linear_w8_tiled<bf16>)                   \
  K(ns, dequantize_int8_tiled_f32, dequantize_int8_tiled<float>)       \
  K(ns, dequantize_int8_tiled_bf16, dequantize_int8_tiled<bf16>)       \
  K(ns, linear_w4_f32, linear_w4<float>)                               \
  K(ns, linear_w4_bf16, linear_w4<bf16>)                               \
  K(ns, dequantize_int4_f32, dequantize_int4<float>)                   \
  K(ns, dequantize_int4_bf16, dequantize_int4<bf16>)                   \
  K(ns, linear_w4_tiled_f32, linear_w4_tiled<float>)                   \
  K(ns, linear_w4_tiled_bf16, linear_w4_tiled<bf16>)                   \
  K(ns, dequantize_int4_tiled_f32, dequantize_int4_tiled<float>)       \
  K(ns, dequantize_int4_tiled_bf16, dequantize_int4_tiled<bf16>)       \
  K(ns, linear_w8a8_f32, linear_w8a8<float>)                           \
  K(ns, linear_w8a8_bf16, linear_w8a8<bf16>)                           \
  K(ns, linear_w8a8_tiled_f32, linear_w8a8_tiled<float>)               \
  K(ns, linear_w8a8_tiled_bf16, linear_w8a8_tiled<bf16>)               \
  K(ns, linear_w4a8_f32, linear_w4a8<float>)                           \
  K(ns, linear_w4a8_bf16, linear_w4a8<bf16>)                           \
  K(ns, linear_w4a8_tiled_f32, linear_w4a8_tiled<float>)               \
  K(ns, linear_w4a8_tiled_bf16, linear_w4a8_tiled<bf16>)               \
  K(ns, linear_fp8_f32, linear_fp8<float>)                             \
  K(ns, linear_fp8_bf16, linear_fp8<bf16>)                             \
  K(ns, quantize_fp8_f32, quantize_fp8<float>)                         \
  K(ns, quantize_fp8_bf16, quantize_fp8<bf16>)                         \
  K(ns, dequantize_fp8_f32, dequantize_fp8<float>)                     \
  K(ns, dequantize_fp8_bf16, dequantize_fp8<bf16>)                     \
  K(ns, gptq_block, gptq_block_rows)                                   \
  K(ns, fake_quant_int4, fake_quant_int4_rows)

#define KILN_KERNEL_FIELD(ns, field, ...) std::decay_t<decltype(ns::__VA_ARGS__)> field = nullptr;
#define KILN_KERNEL_SET(ns, field, ...) k.field = ns::__VA_ARGS__;

struct Kernels {
  const char* isa = nullptr;
  bool tiled_int4 = false, tiled_int8 = false, tiled_bf16 = false, tiled_w8a8 = false;  // the layouts made at load
  KILN_KERNEL_LIST(KILN_KERNEL_FIELD, scalar)
};

// The table of one ISA namespace, every field set by name
#define KILN_KERNELS_OF(ns)                     \
  [] {                                          \
    Kernels k;                                  \
    k.isa = #ns;                                \
    k.tiled_int4 = ns::kTiledInt4;              \
    k.tiled_int8 = ns::kTiledInt8;              \
    k.tiled_bf16 = ns::kTiledBf16;              \
    k.tiled_w8a8 = ns::kTiledW8A8;              \
    KILN_KERNEL_LIST(KILN_KERNEL_SET, ns)       \
    return k;                                   \
  }()
