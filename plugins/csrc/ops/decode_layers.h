// Every decoder layer of a decode step in one call: LlamaModel.forward's layer loop for a few
// rows (runtime/model.py), run here instead of op by op from Python. The same functions in
// the same order, so the numbers are bit for bit those of the Python loop, without the
// interpreter and the dispatcher between the ~240 kernel calls of a step. The plan (one record
// per linear and layer) is laid out as decode_plan.h declares.

using OptionalTensors = c10::List<c10::optional<at::Tensor>>;

// x [rows, k] times an AWQ / SmoothQuant pre-scale [k] of x's dtype, each product rounded to that
// dtype as PyTorch's x * pre_scale rounds it; a plain loop, without the dispatcher and tensor
// iterator that cost more than the ~600 multiplies of a decode row
static at::Tensor scale_columns(const at::Tensor& x_in, const at::Tensor& pre_scale) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && pre_scale.dim() == 1 && pre_scale.is_contiguous() &&
                  pre_scale.size(0) == x.size(1) && pre_scale.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kiln::decode_layers: a pre_scale must be contiguous [", x.size(1), "] of the activations' dtype");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), k = x.size(1);
  auto run = [&](auto* o, const auto* in, const auto* s) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < k; ++i) o[r * k + i] = static_cast<float>(in[r * k + i]) * static_cast<float>(s[i]);
  };
  if (x.scalar_type() == at::kFloat)
    run(out.data_ptr<float>(), x.data_ptr<float>(), pre_scale.data_ptr<float>());
  else
    run(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), pre_scale.data_ptr<at::BFloat16>());
  return out;
}

// One linear of the plan: its record starts at tensors[t], ints[i], floats[f]
static at::Tensor planned_linear(const at::Tensor& x, const OptionalTensors& tensors, int64_t t, const int64_t* ints,
                                 const double* floats) {
  auto tensor = [&](plan::LinearTensor which) { return tensors.get(t + which); };
  const c10::optional<at::Tensor> weight = tensor(plan::weight), scales = tensor(plan::scales),
                                  bias = tensor(plan::bias), pre_scale = tensor(plan::pre_scale),
                                  weight_sum = tensor(plan::weight_sum);
  const int64_t kind = ints[plan::kind], group = ints[plan::group_size];
  const double input_scale = floats[plan::input_scale], inv_input_scale = floats[plan::inv_input_scale];
  TORCH_CHECK(kind >= 0 && kind < plan::kKinds, "kiln::decode_layers: unknown linear kind ", kind);
  TORCH_CHECK(weight.has_value() && (kind == plan::dense || kind == plan::dense_tiled || scales.has_value()),
              "kiln::decode_layers: a linear's plan lacks its weight or scales");
  at::Tensor in = pre_scale.has_value() ? scale_columns(x, *pre_scale) : x;  // as QuantLinear.__call__
  if (inv_input_scale > 0) in = quantize_fp8(in, inv_input_scale);
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"  // every kind of KILN_LINEAR_KINDS has its case
  switch (static_cast<plan::LinearKind>(kind)) {
    case plan::dense: return in.scalar_type() == at::kBFloat16 ? kiln::linear(in, *weight, bias) : at::linear(in, *weight, bias);
    case plan::dense_tiled: return linear_bf16_tiled(in, *weight, bias);
    case plan::int8: return linear_w8(in, *weight, *scales, bias);
    case plan::int8_tiled: return linear_w8_tiled(in, *weight, *scales, bias);
    case plan::int4: return linear_w4(in, *weight, *scales, group, bias);
    case plan::int4_tiled: return linear_w4_tiled(in, *weight, *scales, group, bias);
    case plan::w4a8: return linear_w4a8(in, *weight, *scales, group, bias);
    case plan::w4a8_tiled: return linear_w4a8_tiled(in, *weight, *scales, group, bias);
    case plan::w8a8:
      TORCH_CHECK(weight_sum.has_value(), "kiln::decode_layers: a W8A8 linear's plan lacks weight_sum");
      return linear_w8a8(in, *weight, *scales, *weight_sum, bias, input_scale);
    case plan::w8a8_tiled: return linear_w8a8_tiled(in, *weight, *scales, bias, input_scale);
    case plan::fp8: return linear_fp8(in, *weight, *scales, bias);
  }
#pragma GCC diagnostic pop
  TORCH_CHECK(false, "kiln::decode_layers: unknown linear kind ", kind);
}

// qkv with the queries and keys RMS-normalized: each head (Qwen3, Gemma 3: norms of head_dim), or
// each row's whole query and key projections (OLMoE: norms of q_size and kv_size). The same kernel
// and the same steps as runtime/model.py's norm_heads, so the fused step stays bit for bit the
// Python loop.
at::Tensor norm_heads(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, int64_t heads,
                      int64_t head_dim, double eps) {
  const int64_t rows = qkv.size(0), q = heads * head_dim, kv = (qkv.size(1) - q) / 2;
  const int64_t dq = q_norm.size(0), dk = k_norm.size(0);
  TORCH_CHECK(q % dq == 0 && kv % dk == 0, "kiln::decode_layers: head norms of ", dq, " and ", dk,
              " do not divide the query and key projections of ", q, " and ", kv);
  const at::Tensor queries = rms_norm(qkv.narrow(1, 0, q).reshape({-1, dq}), q_norm, eps).view({rows, q});
  const at::Tensor keys = rms_norm(qkv.narrow(1, q, kv).reshape({-1, dk}), k_norm, eps).view({rows, kv});
  return at::cat({queries, keys, qkv.narrow(1, q + kv, kv)}, 1);
}

// The gated activation a plan names (decode_plan.h's KILN_ACTIVATIONS) over [rows, 2n] gate / up
static at::Tensor activate(const at::Tensor& gate_up, int64_t activation) {
  return activation == plan::gelu_tanh ? gelu_tanh_mul(gate_up) : silu_mul(gate_up);
}

// A Mixture-of-Experts MLP over planned expert records (moe_ops.h)
static at::Tensor route_experts(const at::Tensor& x, const at::Tensor& router, const OptionalTensors& tensors,
                                int64_t t_first, const int64_t* ints, const double* floats, int64_t top_k,
                                bool normalize, bool round_weights, int64_t activation);
static void check_router(const at::Tensor& x, const at::Tensor& router, int64_t top_k, int64_t activation);
static at::Tensor add_shared_expert(const at::Tensor& routed, const at::Tensor& x, const at::Tensor& shared,
                                    const c10::optional<at::Tensor>& gate);

static at::Tensor layer_loop(at::Tensor& h, const at::Tensor& x0, const OptionalTensors& tensors, at::IntArrayRef ints,
                             at::ArrayRef<double> floats, at::Tensor& kv, const at::Tensor& kv_layers,
                             const at::Tensor& block_tables, const at::Tensor& query_start,
                             const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                             int64_t heads, double scale, double eps, int64_t key_hadamard) {
  using namespace plan;
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2 && kv.is_contiguous(),
              "kiln::decode_layers: kv must be the pool's contiguous [slots, 2, blocks, kv_heads, block_size, "
              "head_dim] storage, got ", kv.sizes());
  TORCH_CHECK(kv_layers.scalar_type() == at::kLong && kv_layers.dim() == 2 && kv_layers.size(1) == 2 &&
                  kv_layers.size(0) > 0 && kv_layers.is_contiguous(),
              "kiln::decode_layers: kv_layers must be a contiguous int64 [layers, 2] tensor (each layer's slot "
              "of the pool and group of block tables), got ", kv_layers.scalar_type(), " ", kv_layers.sizes());
  TORCH_CHECK(block_tables.dim() == 3, "kiln::decode_layers: block_tables must be [groups, sequences, blocks], got ",
              block_tables.sizes());
  const int64_t layers = kv_layers.size(0);
  const int64_t* slot_group = kv_layers.data_ptr<int64_t>();
  for (int64_t i = 0; i < layers; ++i)
    TORCH_CHECK(slot_group[2 * i] >= 0 && slot_group[2 * i] < kv.size(0) && slot_group[2 * i + 1] >= 0 &&
                    slot_group[2 * i + 1] < block_tables.size(0),
                "kiln::decode_layers: layer ", i, "'s slot ", slot_group[2 * i], " and group ", slot_group[2 * i + 1],
                " are outside the pool's ", kv.size(0), " slots and the ", block_tables.size(0), " block tables");
  auto layer_int = [&](int64_t i, LayerInt which) { return ints[i * kLayerInts + kLayerLinears * kLinearInts + which]; };
  int64_t expert_records = 0;  // the experts' linear records after the layers' (two an expert)
  if (static_cast<int64_t>(ints.size()) >= layers * kLayerInts)
    for (int64_t i = 0; i < layers; ++i) {
      TORCH_CHECK(layer_int(i, plan::experts) >= 0, "kiln::decode_layers: layer ", i, " has a negative expert count");
      expert_records += 2 * layer_int(i, plan::experts);
    }
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * kLayerTensors + expert_records * kLinearTensors &&
                  static_cast<int64_t>(ints.size()) == layers * kLayerInts + expert_records * kLinearInts &&
                  static_cast<int64_t>(floats.size()) == layers * kLayerFloats + expert_records * kLinearFloats,
              "kiln::decode_layers: the plan has ", tensors.size(), " tensors, ", ints.size(), " ints and ",
              floats.size(), " floats; ", layers, " layers and ", expert_records / 2, " experts need ",
              layers * kLayerTensors + expert_records * kLinearTensors, ", ",
              layers * kLayerInts + expert_records * kLinearInts, " and ",
              layers * kLayerFloats + expert_records * kLinearFloats);
  int64_t t_expert = layers * kLayerTensors, i_expert = layers * kLayerInts, f_expert = layers * kLayerFloats;
  at::Tensor x = x0;
  PagedShape shape{};
  std::vector<int32_t> token_seq;
  const bool quantized = kv.scalar_type() == at::kChar || kv.scalar_type() == at::kFloat8_e4m3fn;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t t0 = i * kLayerTensors;
    auto run = [&](const at::Tensor& in, LayerLinear j) {  // linear j of the layer
      const PhaseTimer timer(phase_linears);
      return planned_linear(in, tensors, t0 + j * kLinearTensors, ints.data() + i * kLayerInts + j * kLinearInts,
                            floats.data() + i * kLayerFloats + j * kLinearFloats);
    };
    auto own = [&](LayerTensor which) { return tensors.get(t0 + kLayerLinears * kLinearTensors + which); };
    const c10::optional<at::Tensor> post_norm = own(post_attention_norm), after = own(next_norm),
                                    kv_scales = own(plan::kv_scales), head_q = own(q_norm), head_k = own(k_norm),
                                    attn_norm = own(attn_out_norm), mlp_norm = own(mlp_out_norm),
                                    layer_cos = own(plan::cos), layer_sin = own(plan::sin);
    const int64_t window = layer_int(i, plan::window), activation = layer_int(i, plan::activation);
    TORCH_CHECK(post_norm.has_value() && after.has_value(), "kiln::decode_layers: layer ", i, "'s plan lacks a norm");
    TORCH_CHECK(head_q.has_value() == head_k.has_value() && layer_cos.has_value() == layer_sin.has_value(),
                "kiln::decode_layers: layer ", i, "'s plan has one head norm or rotary table without the other");
    TORCH_CHECK(activation >= 0 && activation < kActivations, "kiln::decode_layers: layer ", i,
                "'s activation ", activation, " is not one of the library's ", kActivations);
    const at::Tensor& rope_cos = layer_cos ? *layer_cos : cos;
    const at::Tensor& rope_sin = layer_sin ? *layer_sin : sin;
    const at::Tensor qkv_out =
        head_q ? norm_heads(run(x, qkv), *head_q, *head_k, heads, kv.size(-1), eps) : run(x, qkv);
    if (i == 0)  // the step's metadata and shapes, checked once: every layer's pool is alike
      for (int64_t g = 0; g < block_tables.size(0); ++g)  // and every group's tables
        shape = check_paged(qkv_out, kv.select(0, 0).select(0, 0), kv.select(0, 0).select(0, 1),
                            block_tables.select(0, g), query_start, context_lens, cos, sin, heads, kv_scales,
                            key_hadamard, 0, token_seq);
    TORCH_CHECK(kv_scales.has_value() == quantized &&
                    (!quantized || kv_scales->numel() == 2 * shape.kv_heads * shape.head_dim),
                "kiln::decode_layers: layer ", i, "'s kv_scales do not match its pool");
    if (layer_cos)  // a layer's own tables: as the step's tables were checked
      TORCH_CHECK(rope_cos.scalar_type() == cos.scalar_type() && rope_cos.sizes() == cos.sizes() &&
                      rope_sin.sizes() == cos.sizes() && rope_sin.scalar_type() == cos.scalar_type() &&
                      rope_cos.is_contiguous() && rope_sin.is_contiguous(),
                  "kiln::decode_layers: layer ", i, "'s rotary tables must be contiguous and shaped as the step's ",
                  cos.sizes());
    TORCH_CHECK(window >= 0, "kiln::decode_layers: layer ", i, "'s window ", window, " is negative");
    PagedShape layer_shape = shape;
    layer_shape.window = window;
    const int64_t slot = slot_group[2 * i], group = slot_group[2 * i + 1];
    char* k_pool = static_cast<char*>(kv.data_ptr()) + slot * kv.stride(0) * kv.element_size();
    at::Tensor attn;
    {
      const PhaseTimer timer(phase_attention);
      attn = run_paged(qkv_out, k_pool, k_pool + kv.stride(1) * kv.element_size(), kv.scalar_type(),
                       block_tables.select(0, group), query_start, context_lens, rope_cos, rope_sin, layer_shape,
                       token_seq, scale, kv_scales);
    }
    const at::Tensor attn_o = run(attn, out);
    {
      const PhaseTimer timer(phase_norms);
      x = add_rms_norm(h, attn_norm ? rms_norm(attn_o, *attn_norm, eps) : attn_o, *post_norm, eps);
    }
    at::Tensor mlp;
    if (const int64_t experts = layer_int(i, plan::experts); experts > 0) {  // a Mixture-of-Experts layer
      const c10::optional<at::Tensor> layer_router = own(plan::router);
      TORCH_CHECK(layer_router.has_value() && layer_router->size(0) == experts, "kiln::decode_layers: layer ", i,
                  "'s ", experts, " experts need a router of as many rows");
      const int64_t top_k = layer_int(i, plan::top_k);
      check_router(x, *layer_router, top_k, activation);
      {
        const PhaseTimer timer(phase_experts);  // the routed experts (a shared expert's linears are linears)
        mlp = route_experts(x, *layer_router, tensors, t_expert, ints.data() + i_expert, floats.data() + f_expert,
                            top_k, layer_int(i, plan::normalize_experts) != 0,
                            layer_int(i, plan::round_expert_weights) != 0, activation);
      }
      if (tensors.get(t0 + gate_up * kLinearTensors + plan::weight).has_value())  // a shared expert (Qwen2-MoE)
        mlp = add_shared_expert(mlp, x, run(activate(run(x, gate_up), activation), down), own(plan::shared_gate));
      t_expert += 2 * experts * kLinearTensors;
      i_expert += 2 * experts * kLinearInts;
      f_expert += 2 * experts * kLinearFloats;
    } else {
      const at::Tensor both = run(x, gate_up);
      at::Tensor gated;
      {
        const PhaseTimer timer(phase_activation);
        gated = activate(both, activation);
      }
      mlp = run(gated, down);
    }
    const PhaseTimer timer(phase_norms);
    x = add_rms_norm(h, mlp_norm ? rms_norm(mlp, *mlp_norm, eps) : mlp, *after, eps);
  }
  return x;
}

// Whether a step's threads stay in one OpenMP region (parallel.h's Team) for the whole layer
// loop, instead of a fork and join per kernel: KILN_DECODE_TEAM=0 turns it off at load, the
// set_decode_team op for benchmarks. Either way the results are the same bits.
inline bool g_decode_team = [] {
  const char* env = std::getenv("KILN_DECODE_TEAM");
  return !(env && std::string(env) == "0");
}();

bool set_decode_team(bool on) { return std::exchange(g_decode_team, on); }

// One team a step, only with bf16 activations: float ones send dense linears to PyTorch's GEMM,
// which inside the region would run on one thread.
at::Tensor decode_layers(at::Tensor& h, const at::Tensor& x0, const OptionalTensors& tensors, at::IntArrayRef ints,
                         at::ArrayRef<double> floats, at::Tensor& kv, const at::Tensor& kv_layers,
                         const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& context_lens,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t heads, double scale, double eps,
                         int64_t key_hadamard) {
  const PhaseTimer step_timer(phase_step);
  at::Tensor x;
  auto loop = [&] {
    x = layer_loop(h, x0, tensors, ints, floats, kv, kv_layers, block_tables, query_start, context_lens, cos, sin,
                   heads, scale, eps, key_hadamard);
  };
  if (g_decode_team && x0.scalar_type() == at::kBFloat16)
    Team::run(loop);
  else
    loop();
  return x;
}
