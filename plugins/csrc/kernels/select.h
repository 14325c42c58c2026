// Which implementation each kernel runs on this instruction set: the one place that chooses.
// Included last, per ISA inside kiln::<isa> (library.cpp); kernel_table.h takes every entry point
// below by name for each ISA namespace. An entry is either one implementation (the ISA paths
// side by side inside it) or a choice here, by ISA and, where a kernel needs it, by shape.

// --- norms and activations (norms.h), dense linears (dense.h), attention (attention.h) ------
template <typename T> constexpr auto rms_norm = rms_norm_rows<T>;
template <typename T> constexpr auto add_rms_norm = add_rms_norm_rows<T>;
template <typename T> constexpr auto silu_mul = gated_rows<Silu, T>;
template <typename T> constexpr auto gelu_tanh_mul = gated_rows<GeluTanh, T>;
template <typename T, typename P> constexpr auto paged_attention = paged_attention_impl<T, P>;

template <typename T>
void linear(const T* x, const T* w, const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
#if defined(KILN_ISA_AVX512BF16)
  if constexpr (std::is_same_v<T, bf16>) return linear_bf16_dp(x, w, bias, out, rows, k, n);
#endif
#if defined(KILN_ISA_AVX2)
  if (rows >= kFloatLanesFrom) {  // the same bits; the rows past whole chunks by lane_rows (lanes.h)
    const int64_t lanes = lane_rows(rows);  // (from kFloatLanesFrom: whole chunks and the tail's split)
    linear_float_lanes<T>(x, w, bias, out, lanes, k, n);
    if (lanes < rows) linear_float<T>(x + lanes * k, w, bias, out + lanes * n, rows - lanes, k, n);
    return;
  }
#endif
  linear_float<T>(x, w, bias, out, rows, k, n);
}

// --- int8 weights, rows (int8.h) -------------------------------------------------------------
template <typename T>
void linear_w8(const T* x, const int8_t* w, const float* s, const T* bias, T* out, int64_t rows, int64_t k,
               int64_t n) {
#if defined(KILN_ISA_VNNI)
  if (k >= kVnniBytesMinK) return linear_w8_vnni<T>(x, w, s, bias, out, rows, k, n);
#endif
#if !defined(KILN_ISA_SCALAR)
  linear_w8_i16<T>(x, w, s, bias, out, rows, k, n);
#else
  linear_w8_float<T>(x, w, s, bias, out, rows, k, n);
#endif
}

// --- int4 weights, rows (int4.h), and W4A8 on them (w4a8.h) -----------------------------------
// An int4 row-layout kernel that needs in_features and group_size to be multiples of M where
// they are, the general one elsewhere
template <int64_t M, auto Fast, auto General, typename T>
void int4_by_shape(const T* x, const uint8_t* w, const float* s, int64_t group, const T* bias, T* out, int64_t rows,
                   int64_t k, int64_t n) {
  if (k % M == 0 && group % M == 0) return Fast(x, w, s, group, bias, out, rows, k, n);
  General(x, w, s, group, bias, out, rows, k, n);
}

template <typename T> constexpr auto dequantize_int4 = dequantize_int4_rows<T>;
#if defined(KILN_ISA_AVX512)
template <typename T> constexpr auto linear_w4 = int4_by_shape<32, linear_w4_i16<T>, linear_w4_float<T>, T>;
#else
template <typename T> constexpr auto linear_w4 = linear_w4_float<T>;
#endif
#if defined(KILN_ISA_VNNI)
template <typename T> constexpr auto linear_w4a8 = int4_by_shape<64, linear_w4a8_vnni<T>, linear_w4a8_ref<T>, T>;
#else
template <typename T> constexpr auto linear_w4a8 = linear_w4a8_ref<T>;
#endif

// --- the tiled layouts (int8_tiled.h, int4_tiled.h, w4a8.h) ---------------------------------
// Which weights the runtime lays out tiled on this ISA: int4 wherever the shape allows it; int8
// on AVX-512 (elsewhere the row layout's int8 kernels are the faster ones). The scalar
// reference runs the tiled layouts with plain loops.
constexpr bool kTiledInt4 = true;
#if defined(KILN_ISA_SCALAR)
template <typename T> constexpr auto linear_w4_tiled = linear_w4_tiled_ref<T>;
template <typename T> constexpr auto linear_w4a8_tiled = linear_w4a8_tiled_ref<T>;
#else
template <typename T> constexpr auto linear_w4_tiled = linear_w4_tiled_dp<T>;
template <typename T> constexpr auto linear_w4a8_tiled = linear_w4a8_tiled_dp<T>;
#endif
#if defined(KILN_ISA_AVX512)
constexpr bool kTiledInt8 = true;
template <typename T> constexpr auto linear_w8_tiled = linear_w8_tiled_avx512<T>;
template <typename T> constexpr auto dequantize_int8_tiled = dequantize_int8_tiled_avx512<T>;
template <typename T> constexpr auto dequantize_int4_tiled = dequantize_int4_tiled_avx512<T>;
#else
constexpr bool kTiledInt8 = false;
template <typename T> constexpr auto linear_w8_tiled = linear_w8_tiled_ref<T>;
template <typename T> constexpr auto dequantize_int8_tiled = dequantize_int8_tiled_ref<T>;
template <typename T> constexpr auto dequantize_int4_tiled = dequantize_int4_tiled_rows<T>;
#endif

// bf16 takes the tiled layout where AVX512-BF16 or AMX multiplies it, at every row count
// (dense_tiled.h: a row's bits then do not depend on the other rows; without AMX, on Zen 4,
// 0.9-1.6x dense.h's vdpbf16ps kernel at one row in cache, 1.3-2.6x from 4 rows;
// docs/benchmarks.md); elsewhere bf16 runs on the rows (dense.h) and the tiled layout has only
// its reference.
#if defined(KILN_ISA_AMX)
constexpr bool kTiledBf16 = true;
constexpr auto linear_bf16_tiled = linear_bf16_tiled_amx;
#elif defined(KILN_ISA_AVX512BF16)
constexpr bool kTiledBf16 = true;
constexpr auto linear_bf16_tiled = linear_bf16_tiled_dp;
#else
constexpr bool kTiledBf16 = false;
constexpr auto linear_bf16_tiled = linear_bf16_tiled_ref;
#endif

// --- W8A8 (w8a8.h, w8a8_tiled.h) ---------------------------------------------------------------
// W8A8 weights take the tiled int8 layout where AVX-512 VNNI multiplies them (its GEMV, and AMX
// tiles from 16 rows where the CPU has them): without AMX (Zen 4) 1.6-2.6x the row layout's
// kernel at one row, 2.9-3.5x at 4, 1.5-2.3x at 16 and 1.0-1.5x at 64-512 rows, where the row
// layout takes PyTorch's int8 GEMM; with AMX 2.1-3.7x that GEMM at 16 rows (docs/benchmarks.md).
// Elsewhere they stay [out, in] and the tiled layout has only its reference.
template <typename T> constexpr auto linear_w8a8 = linear_w8a8_rows<T>;
#if defined(KILN_ISA_VNNI)
constexpr bool kTiledW8A8 = true;
template <typename T> constexpr auto linear_w8a8_tiled = linear_w8a8_tiled_vnni<T>;
#else
constexpr bool kTiledW8A8 = false;
template <typename T> constexpr auto linear_w8a8_tiled = linear_w8a8_tiled_ref<T>;
#endif

// --- FP8 (fp8.h) ------------------------------------------------------------------------------
template <typename T> constexpr auto quantize_fp8 = quantize_fp8_elements<T>;
template <typename T> constexpr auto dequantize_fp8 = dequantize_fp8_elements<T>;

template <typename T>
void linear_fp8(const T* x, const uint8_t* w, const float* s, const T* bias, T* out, int64_t rows, int64_t k,
                int64_t n) {
#if !defined(KILN_ISA_SCALAR)
  linear_fp8_shift<T>(x, w, s, bias, out, rows, k, n);
#else
  linear_fp8_float<T>(x, w, s, bias, out, rows, k, n);
#endif
}
