// The decode plan: how runtime/linear.py describes each linear, and runtime/model.py each layer,
// to decode_layers. Declared here once; the Python side reads these names and their order from
// the library (library_info) and builds the plan by name (plugins/ops.py, decode_plan), so the two
// sides cannot disagree on a position.
//
// A linear is one record: its kind (how to run it), tensors, ints and floats, each by name; a
// layer is its linears' records in KILN_LAYER_LINEARS order, then its own tensors. The plan of
// a step is the layers' records one after the other, as three flat lists (tensors, ints, floats).
#define KILN_LINEAR_KINDS(X)                                                                        \
  X(dense) X(dense_tiled) X(int8) X(int8_tiled) X(int4) X(int4_tiled) X(w4a8) X(w4a8_tiled) X(w8a8) \
  X(w8a8_tiled) X(fp8)
// weight (or qweight), scales, bias, the AWQ / SmoothQuant input pre-scale, W8A8's sum of each weight row
#define KILN_LINEAR_TENSORS(X) X(weight) X(scales) X(bias) X(pre_scale) X(weight_sum)
#define KILN_LINEAR_INTS(X) X(kind) X(group_size)
// W8A8's static input scale (0: per-row dynamic); FP8 activations' 1 / input_scale (0: none)
#define KILN_LINEAR_FLOATS(X) X(input_scale) X(inv_input_scale)
#define KILN_LAYER_LINEARS(X) X(qkv) X(out) X(gate_up) X(down)
// the post-attention norm (the MLP's input norm), the norm after the layer (the next layer's
// input norm or the final norm), the KV-cache scales of a quantized pool, Qwen3's and Gemma 3's
// RMSNorms over each query and key head, Gemma's norms of the attention's and the MLP's outputs
// before each joins the residual, and the layer's own rotary tables where they differ from the
// step's (Gemma 3's local layers); absent (None) where a model has no such thing
// (and a Mixture-of-Experts layer's router, [experts, hidden], and its shared expert's gate, [1, hidden])
#define KILN_LAYER_TENSORS(X)                                                                               \
  X(post_attention_norm) X(next_norm) X(kv_scales) X(q_norm) X(k_norm) X(attn_out_norm) X(mlp_out_norm) X(cos) \
  X(sin) X(router) X(shared_gate)
// the layer's sliding window (0: none), its MLP's gated activation (a name of KILN_ACTIVATIONS), and
// for a Mixture-of-Experts layer its number of experts (0: a dense MLP), how many a token takes, and
// whether their weights are rescaled to sum to 1 / rounded to the model dtype. A Mixture-of-Experts
// layer's gate_up and down records are its shared expert's (Qwen2-MoE), or empty; its experts' linear
// records (gate_up, down, for each expert) follow all the layers' records, layer by layer, in the
// plan's three lists.
#define KILN_LAYER_INTS(X) X(window) X(activation) X(experts) X(top_k) X(normalize_experts) X(round_expert_weights)
#define KILN_ACTIVATIONS(X) X(silu) X(gelu_tanh)

namespace plan {
#define KILN_PLAN_ENUM(name) name,
#define KILN_PLAN_COUNT(name) +1
enum LinearKind : int64_t { KILN_LINEAR_KINDS(KILN_PLAN_ENUM) };
enum LinearTensor : int64_t { KILN_LINEAR_TENSORS(KILN_PLAN_ENUM) };
enum LinearInt : int64_t { KILN_LINEAR_INTS(KILN_PLAN_ENUM) };
enum LinearFloat : int64_t { KILN_LINEAR_FLOATS(KILN_PLAN_ENUM) };
enum LayerLinear : int64_t { KILN_LAYER_LINEARS(KILN_PLAN_ENUM) };
enum LayerTensor : int64_t { KILN_LAYER_TENSORS(KILN_PLAN_ENUM) };
enum LayerInt : int64_t { KILN_LAYER_INTS(KILN_PLAN_ENUM) };
enum Activation : int64_t { KILN_ACTIVATIONS(KILN_PLAN_ENUM) };

constexpr int64_t kKinds = 0 KILN_LINEAR_KINDS(KILN_PLAN_COUNT);
constexpr int64_t kLinearTensors = 0 KILN_LINEAR_TENSORS(KILN_PLAN_COUNT);
constexpr int64_t kLinearInts = 0 KILN_LINEAR_INTS(KILN_PLAN_COUNT);
constexpr int64_t kLinearFloats = 0 KILN_LINEAR_FLOATS(KILN_PLAN_COUNT);
constexpr int64_t kLayerLinears = 0 KILN_LAYER_LINEARS(KILN_PLAN_COUNT);
constexpr int64_t kLayerTensors = kLayerLinears * kLinearTensors + (0 KILN_LAYER_TENSORS(KILN_PLAN_COUNT));
constexpr int64_t kActivations = 0 KILN_ACTIVATIONS(KILN_PLAN_COUNT);
constexpr int64_t kLayerInts = kLayerLinears * kLinearInts + (0 KILN_LAYER_INTS(KILN_PLAN_COUNT));
constexpr int64_t kLayerFloats = kLayerLinears * kLinearFloats;
#undef KILN_PLAN_ENUM
#undef KILN_PLAN_COUNT

// The layout as JSON for library_info: {"linear_kinds": [...], "linear_tensors": [...], ...}
inline std::string layout_json() {
#define KILN_PLAN_NAME(name) "\"" #name "\","
  auto list = [](const char* key, std::string names) {
    if (!names.empty()) names.pop_back();  // the last comma
    return std::string("\"") + key + "\": [" + names + "]";
  };
  return "{" + list("linear_kinds", KILN_LINEAR_KINDS(KILN_PLAN_NAME)) + ", " +
         list("linear_tensors", KILN_LINEAR_TENSORS(KILN_PLAN_NAME)) + ", " +
         list("linear_ints", KILN_LINEAR_INTS(KILN_PLAN_NAME)) + ", " +
         list("linear_floats", KILN_LINEAR_FLOATS(KILN_PLAN_NAME)) + ", " +
         list("layer_linears", KILN_LAYER_LINEARS(KILN_PLAN_NAME)) + ", " +
         list("layer_tensors", KILN_LAYER_TENSORS(KILN_PLAN_NAME)) + ", " +
         list("layer_ints", KILN_LAYER_INTS(KILN_PLAN_NAME)) + ", " +
         list("activations", KILN_ACTIVATIONS(KILN_PLAN_NAME)) + "}";
#undef KILN_PLAN_NAME
}
}  // namespace plan
