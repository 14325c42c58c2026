// Argument checks and the drivers every op wrapper shares: dtypes, a linear's operands, and
// running a kernel table entry for float32 or bfloat16 activations.

// call(kernel, out) with the float32 or bfloat16 kernel and out's data as that type
template <typename F32, typename BF16, typename Call>
static void for_dtype(at::Tensor& out, F32 f32, BF16 bf, Call call) {
  if (out.scalar_type() == at::kFloat)
    call(f32, out.data_ptr<float>());
  else
    call(bf, reinterpret_cast<bf16*>(out.data_ptr()));
}

static void check_float_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "kiln: ", name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "kiln: ", name, " must be on the CPU");
}


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

static int64_t check_int4(const char* op, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  const int64_t k = qweight.size(1) * 2;
  TORCH_CHECK(group > 0 && scales.dim() == 2 && scales.size(1) == (k + group - 1) / group, "kiln::", op,
              ": scales must be [out, ceil(in / group_size)] = [", qweight.size(0), ", ", (k + group - 1) / std::max<int64_t>(group, 1),
              "], got ", scales.sizes());
  return k;
}

// An int4 weight's tensors (either layout: the shapes are the same) -> in_features
static int64_t check_int4_weight(const char* op, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == qweight.size(0),
              "kiln::", op, ": qweight must be contiguous uint8 [out, in / 2], scales float32 [out, groups]");
  return check_int4(op, qweight, scales, group);
}

// An int4 weight (checked) back to [out, in] of dtype by the f32 / bf16 kernel
template <typename F32, typename BF16>
static at::Tensor dequantize_groups(const char* op, const at::Tensor& qweight, const at::Tensor& scales, int64_t group,
                                    at::ScalarType dtype, F32 f32, BF16 bf) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "kiln::", op, ": dtype must be float32 or bfloat16");
  const int64_t k = qweight.size(1) * 2, n = qweight.size(0);
  auto out = at::empty({n, k}, qweight.options().dtype(dtype));
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  for_dtype(out, f32, bf, [&](auto kernel, auto* o) { kernel(w, scales.data_ptr<float>(), group, o, k, n); });
  return out;
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

// The tiled int4 layout (formats.h, TiledLayout): the same bytes and scales as the stored [out, in / 2]
// and [out, groups] tensors, reordered for linear_w4_tiled; shapes are kept.
static void check_tiled(const char* op, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  const int64_t k = check_int4_weight(op, qweight, scales, group), n = qweight.size(0);
  TORCH_CHECK(n % kTileRows == 0 && k % 8 == 0 && group % 8 == 0 && group <= kTiledMaxGroup, "kiln::", op,
              ": the tiled int4 layout needs out % ", kTileRows, " == 0, in % 8 == 0 and group_size a multiple of 8 "
              "up to ", kTiledMaxGroup, ", got out ", n, ", in ", k, ", group_size ", group);
}

// The tiled int8 layout: [out, in] bytes (value + 128 as uint8) in the int4 tiling's order with
// blocks of 4 inputs; the scales stay [out].
static void check_tiled8(const char* op, const at::Tensor& qweight, at::ScalarType wtype) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == wtype && qweight.is_contiguous(), "kiln::", op,
              ": qweight must be a contiguous 2-d ", wtype, " tensor, got ", qweight.scalar_type(), " ",
              qweight.sizes());
  TORCH_CHECK(qweight.size(0) % kTileRows == 0 && qweight.size(1) % 4 == 0, "kiln::", op,
              ": the tiled int8 layout needs out % ", kTileRows, " == 0 and in % 4 == 0, got ",
              qweight.sizes());
}
