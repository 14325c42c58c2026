// A Mixture-of-Experts MLP for a few rows (decode steps): the router, each row's top-k experts and
// their weights, and each chosen expert once over the rows routed to it, in expert order, its
// output times the rows' weights added into the result: runtime/model.py's LlamaModel.mixture
// with the same ATen ops and the same linear kernels in the same order, so the same bits, without
// the interpreter between the ~30 calls a layer makes. The experts come as a plan of linear
// records (decode_plan.h), expert e's gate/up projection at record 2e and its down projection at
// record 2e + 1; a shared expert's (Qwen2-MoE) after them.

// The experts' records start at tensors[t_first], ints[0], floats[0] (gate_up of expert e at record 2e)
static at::Tensor route_experts(const at::Tensor& x, const at::Tensor& router, const OptionalTensors& tensors,
                                int64_t t_first, const int64_t* ints, const double* floats, int64_t top_k,
                                bool normalize, bool round_weights, int64_t activation) {
  using namespace plan;
  const int64_t experts = router.size(0);
  auto run = [&](const at::Tensor& in, int64_t record) {
    return planned_linear(in, tensors, t_first + record * kLinearTensors, ints + record * kLinearInts,
                          floats + record * kLinearFloats);
  };
  const at::Tensor probs = at::linear(x, router).to(at::kFloat).softmax(-1);
  auto [weights, chosen] = at::topk(probs, top_k, -1);
  if (normalize) weights = weights / weights.sum(-1, true);
  if (round_weights) weights = weights.to(x.scalar_type());
  at::Tensor out = at::zeros_like(x);
  const at::Tensor picks = chosen.contiguous();
  const int64_t* pick = picks.data_ptr<int64_t>();
  const at::Tensor flat_weights = weights.reshape({-1});
  for (int64_t e = 0; e < experts; ++e) {
    std::vector<int64_t> rows, slots;  // (row, slot) pairs routed to e, row-major as torch.where gives them
    for (int64_t i = 0; i < picks.numel(); ++i)
      if (pick[i] == e) {
        rows.push_back(i / top_k);
        slots.push_back(i);
      }
    if (rows.empty()) continue;
    const at::Tensor row_index = at::tensor(rows, at::kLong), slot_index = at::tensor(slots, at::kLong);
    const at::Tensor y = run(activate(run(x.index_select(0, row_index), 2 * e), activation), 2 * e + 1);
    out.index_add_(0, row_index, (y * flat_weights.index_select(0, slot_index).unsqueeze(1)).to(x.scalar_type()));
  }
  return out;
}

// The routed experts' output plus a shared expert's, `shared` (the expert on every row), times
// sigmoid(x @ gate.T) where the family gates it: the order and the ops of runtime/model.py's mixture
static at::Tensor add_shared_expert(const at::Tensor& routed, const at::Tensor& x, const at::Tensor& shared,
                                    const c10::optional<at::Tensor>& gate) {
  if (!gate) return routed + shared;
  TORCH_CHECK(gate->dim() == 2 && gate->size(0) == 1 && gate->size(1) == x.size(1) &&
                  gate->scalar_type() == x.scalar_type(),
              "kiln::moe_mlp: a shared expert's gate must be [1, ", x.size(1), "] of x's dtype, got ", gate->sizes());
  return routed + at::sigmoid(at::linear(x, *gate)) * shared;
}

static void check_router(const at::Tensor& x, const at::Tensor& router, int64_t top_k, int64_t activation) {
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && router.size(1) == x.size(1) &&
                  router.scalar_type() == x.scalar_type(),
              "kiln::moe_mlp: x must be [rows, hidden] and router [experts, hidden] of its dtype, got ", x.sizes(),
              " and ", router.sizes());
  TORCH_CHECK(top_k > 0 && top_k <= router.size(0), "kiln::moe_mlp: top_k ", top_k, " must be in [1, ",
              router.size(0), "]");
  TORCH_CHECK(activation >= 0 && activation < plan::kActivations, "kiln::moe_mlp: activation ", activation,
              " is not one of the library's ", plan::kActivations);
}

at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& router, const OptionalTensors& tensors, at::IntArrayRef ints,
                   at::ArrayRef<double> floats, int64_t top_k, bool normalize, bool round_weights, int64_t activation,
                   const c10::optional<at::Tensor>& shared_gate) {
  using namespace plan;
  check_float_or_bf16(x, "x");
  check_router(x, router, top_k, activation);
  const int64_t experts = router.size(0);
  const int64_t records = static_cast<int64_t>(tensors.size()) / kLinearTensors;  // 2 an expert, the shared one's too
  const bool shared = records == 2 * (experts + 1);
  TORCH_CHECK((records == 2 * experts || shared) && static_cast<int64_t>(tensors.size()) == records * kLinearTensors &&
                  static_cast<int64_t>(ints.size()) == records * kLinearInts &&
                  static_cast<int64_t>(floats.size()) == records * kLinearFloats,
              "kiln::moe_mlp: the plan has ", tensors.size(), " tensors, ", ints.size(), " ints and ", floats.size(),
              " floats; ", experts, " experts need ", 2 * experts * kLinearTensors, ", ",
              2 * experts * kLinearInts, " and ", 2 * experts * kLinearFloats, " (and a shared expert 2 records more)");
  TORCH_CHECK(shared || !shared_gate.has_value(), "kiln::moe_mlp: a shared_gate without a shared expert in the plan");
  const at::Tensor routed =
      route_experts(x, router, tensors, 0, ints.data(), floats.data(), top_k, normalize, round_weights, activation);
  if (!shared) return routed;
  auto run = [&](const at::Tensor& in, int64_t record) {
    return planned_linear(in, tensors, record * kLinearTensors, ints.data() + record * kLinearInts,
                          floats.data() + record * kLinearFloats);
  };
  return add_shared_expert(routed, x, run(activate(run(x, 2 * experts), activation), 2 * experts + 1), shared_gate);
}
