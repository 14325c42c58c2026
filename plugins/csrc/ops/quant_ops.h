// The quantized linear ops (kernels/int8.h, int4.h, int8_tiled.h, int4_tiled.h, w8a8.h,
// w4a8.h, fp8.h) and their dequantizers.

at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  return per_channel_linear<int8_t>("linear_w8", x, qweight, at::kChar, scales, bias, active().linear_w8_f32,
                            active().linear_w8_bf16);
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
  check_int4_weight("dequantize_int4", qweight, scales, group_size);
  return dequantize_groups("dequantize_int4", qweight, scales, group_size, dtype, active().dequantize_int4_f32,
                           active().dequantize_int4_bf16);
}

at::Tensor linear_w4_tiled(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           int64_t group_size, const c10::optional<at::Tensor>& bias) {
  check_tiled("linear_w4_tiled", qweight, scales, group_size);
  return group_linear("linear_w4_tiled", x, qweight, scales, group_size, bias, active().linear_w4_tiled_f32,
                      active().linear_w4_tiled_bf16);
}

// The tiled int8 layout: [out, in] bytes (value + 128 as uint8) in the int4 tiling's order with
// blocks of 4 inputs; the scales stay [out].
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
  for_dtype(out, active().dequantize_int8_tiled_f32, active().dequantize_int8_tiled_bf16,
            [&](auto kernel, auto* o) { kernel(w, scales.data_ptr<float>(), o, qweight.size(1), qweight.size(0)); });
  return out;
}

at::Tensor linear_w4a8_tiled(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             int64_t group_size, const c10::optional<at::Tensor>& bias) {
  check_tiled("linear_w4a8_tiled", qweight, scales, group_size);
  return group_linear("linear_w4a8_tiled", x, qweight, scales, group_size, bias, active().linear_w4a8_tiled_f32,
                      active().linear_w4a8_tiled_bf16);
}

at::Tensor dequantize_int4_tiled(const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size,
                                 at::ScalarType dtype) {
  check_tiled("dequantize_int4_tiled", qweight, scales, group_size);
  return dequantize_groups("dequantize_int4_tiled", qweight, scales, group_size, dtype,
                           active().dequantize_int4_tiled_f32, active().dequantize_int4_tiled_bf16);
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
  for_dtype(out, active().dequantize_fp8_f32, active().dequantize_fp8_bf16,
            [&](auto kernel, auto* o) { kernel(w, o, qweight.numel()); });
  return out;
}

at::Tensor quantize_fp8(const at::Tensor& x, double inv_scale) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(std::isfinite(inv_scale) && inv_scale > 0, "kiln::quantize_fp8: inv_scale must be positive, got ",
              inv_scale);
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const float inv = static_cast<float>(inv_scale);
  for_dtype(out, active().quantize_fp8_f32, active().quantize_fp8_bf16, [&](auto kernel, auto* o) {
    kernel(static_cast<const std::remove_pointer_t<decltype(o)>*>(xc.data_ptr()), o, xc.numel(), inv);
  });
  return out;
}

