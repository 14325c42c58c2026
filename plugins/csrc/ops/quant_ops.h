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

static void check_w8a8_input_scale(const char* op, double input_scale) {
  TORCH_CHECK(std::isfinite(input_scale) && input_scale >= 0, "kiln::", op, ": input_scale must be 0 (per-row "
              "dynamic) or a positive static scale, got ", input_scale);
}

at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& weight_sum, const c10::optional<at::Tensor>& bias, double input_scale) {
  const int64_t k = qweight.size(1), n = qweight.size(0);
  check_linear_args("linear_w8a8", x, qweight, at::kChar, scales, k, bias);
  check_w8a8_input_scale("linear_w8a8", input_scale);
  TORCH_CHECK(weight_sum.scalar_type() == at::kInt && weight_sum.is_contiguous() && weight_sum.numel() == n,
              "kiln::linear_w8a8: weight_sum must be contiguous int32 [", n, "]");
  return run_linear(x, k, n, bias, active().linear_w8a8_f32, active().linear_w8a8_bf16,
                    static_cast<const int8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                    weight_sum.data_ptr<int32_t>(), static_cast<float>(input_scale));
}

// W8A8 on the tiled int8 layout (pack_int8_tiled: the weights + 128), the same outputs as
// linear_w8a8 on the [out, in] weights; no weight_sum (the + 128 comes off the inputs' sums)
at::Tensor linear_w8a8_tiled(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& bias, double input_scale) {
  check_tiled8("linear_w8a8_tiled", qweight, at::kByte);
  const int64_t k = qweight.size(1), n = qweight.size(0);
  check_linear_args("linear_w8a8_tiled", x, qweight, at::kByte, scales, k, bias);
  check_w8a8_input_scale("linear_w8a8_tiled", input_scale);
  TORCH_CHECK(k <= kW8A8TiledMaxIn, "kiln::linear_w8a8_tiled: at most ", kW8A8TiledMaxIn,
              " inputs (the int32 sums of 255 * 128 a product), got ", k);
  return run_linear(x, k, n, bias, active().linear_w8a8_tiled_f32, active().linear_w8a8_tiled_bf16,
                    static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                    static_cast<float>(input_scale));
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


// GPTQ's column loop over one block of columns (kernels/gptq.h, the build's weight rounding):
// pending [out, B] float32 (updated in place), hinv [B, B]; grid "int4" writes each group's scale
// into scales [out, groups] at the group's first column (clip [out, groups], optional, shrinks
// it), "int8" and "fp8" read fixed per-row scales [out]. -> (q [out, B] on the grid, errors [out, B])
std::tuple<at::Tensor, at::Tensor> gptq_block(at::Tensor& pending, const at::Tensor& hinv, at::Tensor& scales,
                                              const c10::optional<at::Tensor>& clip, int64_t column,
                                              int64_t group_size, c10::string_view grid) {
  auto f32 = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu();
  };
  TORCH_CHECK(pending.dim() == 2 && f32(pending), "kiln::gptq_block: pending must be contiguous float32 [out, B], got ",
              pending.scalar_type(), " ", pending.sizes());
  const int64_t out = pending.size(0), B = pending.size(1);
  TORCH_CHECK(f32(hinv) && hinv.dim() == 2 && hinv.size(0) == B && hinv.size(1) == B,
              "kiln::gptq_block: hinv must be contiguous float32 [", B, ", ", B, "], got ", hinv.sizes());
  TORCH_CHECK(f32(scales), "kiln::gptq_block: scales must be contiguous float32");
  TORCH_CHECK(column >= 0, "kiln::gptq_block: column must be >= 0, got ", column);
  int kind;
  int64_t groups = 0;
  if (grid == "int4") {
    kind = scalar::kGptqInt4;
    TORCH_CHECK(group_size > 0 && column % group_size == 0, "kiln::gptq_block: int4 needs group_size > 0 and a block "
                "that starts a group (column ", column, ", group_size ", group_size, ")");
    groups = scales.dim() == 2 ? scales.size(1) : 0;
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out && groups * group_size >= column + B,
                "kiln::gptq_block: int4 scales must be [", out, ", groups] covering column ", column + B - 1,
                ", got ", scales.sizes());
    if (clip.has_value())
      TORCH_CHECK(f32(*clip) && clip->sizes() == scales.sizes(), "kiln::gptq_block: clip must be contiguous float32 ",
                  scales.sizes(), ", got ", clip->sizes());
  } else {
    TORCH_CHECK(grid == "int8" || grid == "fp8", "kiln::gptq_block: grid must be int4, int8 or fp8, got ", grid);
    kind = grid == "int8" ? scalar::kGptqInt8 : scalar::kGptqFp8;
    TORCH_CHECK(scales.dim() == 1 && scales.size(0) == out, "kiln::gptq_block: ", grid, " scales must be [", out,
                "], got ", scales.sizes());
    TORCH_CHECK(!clip.has_value(), "kiln::gptq_block: clip applies to int4 groups only");
  }
  at::Tensor q = at::empty_like(pending), errors = at::empty_like(pending);
  active().gptq_block(pending.data_ptr<float>(), hinv.data_ptr<float>(), q.data_ptr<float>(),
                      errors.data_ptr<float>(), scales.data_ptr<float>(),
                      clip.has_value() ? clip->data_ptr<float>() : nullptr, out, B, column, group_size, groups, kind);
  return {q, errors};
}

// w [n, k] float32 (times column_scales [k] where given) rounded to its int4 groups' grid and
// back (kernels/fake_quant.h; each group's scale its absmax x ratio / 7), divided by the column
// scales again: the AWQ searches' candidate weights in one pass
at::Tensor fake_quant_int4(const at::Tensor& w_in, const c10::optional<at::Tensor>& column_scales, int64_t group_size,
                           double ratio) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat && w_in.device().is_cpu(),
              "kiln::fake_quant_int4: w must be float32 [n, k] on the CPU, got ", w_in.scalar_type(), " ", w_in.sizes());
  TORCH_CHECK(group_size > 0, "kiln::fake_quant_int4: group_size must be > 0, got ", group_size);
  TORCH_CHECK(ratio > 0 && ratio <= 1, "kiln::fake_quant_int4: ratio must be in (0, 1], got ", ratio);
  const at::Tensor w = w_in.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor s;
  if (column_scales.has_value()) {
    s = column_scales->contiguous();
    TORCH_CHECK(s.dim() == 1 && s.size(0) == k && s.scalar_type() == at::kFloat,
                "kiln::fake_quant_int4: column_scales must be float32 [", k, "], got ", s.sizes());
  }
  at::Tensor out = at::empty_like(w);
  active().fake_quant_int4(w.data_ptr<float>(), s.defined() ? s.data_ptr<float>() : nullptr, out.data_ptr<float>(), n,
                           k, group_size, static_cast<float>(ratio));
  return out;
}
