// The norm, activation and dense linear ops (kernels/norms.h, kernels/dense.h, kernels/dense_tiled.h).

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

// act(gate) * up over [.., 2n] (gate, then up) -> [.., n], by the kernels for float32 and bf16
template <typename F32, typename BF16>
static at::Tensor gated(const at::Tensor& gate_up, const char* op, F32 f32, BF16 bf16_kernel) {
  check_float_or_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "kiln::", op, ": last dim ",
              gate_up.size(-1), " of gate_up must be even (gate, then up)");
  auto gu = gate_up.contiguous();
  const int64_t n = gu.size(-1) / 2;
  auto sizes = gu.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, gu.options());
  const int64_t rows = n == 0 ? 0 : gu.numel() / (2 * n);
  if (gu.scalar_type() == at::kFloat)
    f32(gu.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  else
    bf16_kernel(reinterpret_cast<const bf16*>(gu.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()), rows, n);
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  return gated(gate_up, "silu_mul", active().silu_mul_f32, active().silu_mul_bf16);
}

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  return gated(gate_up, "gelu_tanh_mul", active().gelu_tanh_mul_f32, active().gelu_tanh_mul_bf16);
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

static void check_tiled_bf16(const char* op, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(), "kiln::", op,
              ": weight must be a contiguous 2-d bfloat16 tensor, got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(bf16_tiles_fit(weight.size(1), weight.size(0)), "kiln::", op,
              ": the tiled bf16 layout needs out % 16 == 0 and in % 32 == 0, got ", weight.sizes());
}

// x @ w^T (+ bias) for bf16 x on weights from pack_bf16_tiled (kernels/dense_tiled.h)
at::Tensor linear_bf16_tiled(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_tiled_bf16("linear_bf16_tiled", weight);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "kiln::linear_bf16_tiled: x must be bfloat16 on the CPU, got ", x.scalar_type());
  const int64_t k = weight.size(1), n = weight.size(0);
  TORCH_CHECK(x.size(-1) == k, "kiln::linear_bf16_tiled: x's last dim ", x.size(-1), " differs from in_features ", k);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(),
                "kiln::linear_bf16_tiled: bias must be a contiguous bfloat16 [", n, "] tensor");
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, xc.options());
  const int64_t rows = xc.numel() / k;
  if (rows > 0)
    active().linear_bf16_tiled(reinterpret_cast<const bf16*>(xc.data_ptr()),
                               reinterpret_cast<const bf16*>(weight.data_ptr()),
                               bias.has_value() ? reinterpret_cast<const bf16*>(bias->data_ptr()) : nullptr,
                               reinterpret_cast<bf16*>(out.data_ptr()), rows, k, n);
  return out;
}
