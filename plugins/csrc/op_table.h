// Every op of the `kiln` library, one entry each: OP(name, schema after the name). The entry
// both declares the schema and registers kiln::name as its CPU implementation (library.cpp), so
// a declared op without an implementation, or the other way round, does not compile. Their fake
// (meta) implementations are plugins/ops.py's, keyed by the same names; loading the library
// checks that the two lists agree (library_info).
#define KILN_OP_LIST(OP)                                                                                         \
  OP(rms_norm, "(Tensor x, Tensor weight, float eps) -> Tensor")                                                \
  OP(add_rms_norm, "(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor")                       \
  OP(silu_mul, "(Tensor gate_up) -> Tensor")                                                                    \
  OP(gelu_tanh_mul, "(Tensor gate_up) -> Tensor")                                                               \
  OP(linear, "(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")                                          \
  OP(linear_bf16_tiled, "(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")                               \
  OP(paged_attention,                                                                                           \
     "(Tensor qkv, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor block_tables, Tensor query_start, "             \
     "Tensor context_lens, Tensor cos, Tensor sin, int heads, float scale, Tensor? kv_scales=None, "            \
     "int key_hadamard=0, int window=0) -> Tensor")                                                             \
  OP(decode_layers,                                                                                             \
     "(Tensor(a!) h, Tensor x, Tensor?[] tensors, int[] ints, float[] floats, Tensor(b!) kv, Tensor kv_layers, " \
     "Tensor block_tables, Tensor query_start, Tensor context_lens, Tensor cos, Tensor sin, int heads, "        \
     "float scale, float eps, int key_hadamard=0) -> Tensor")                                                   \
  OP(moe_mlp,                                                                                                   \
     "(Tensor x, Tensor router, Tensor?[] tensors, int[] ints, float[] floats, int top_k, bool normalize, "     \
     "bool round_weights, int activation, Tensor? shared_gate=None) -> Tensor")                                                           \
  OP(linear_w8, "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None) -> Tensor")                       \
  OP(linear_w8_tiled, "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None) -> Tensor")                 \
  OP(dequantize_int8_tiled, "(Tensor qweight, Tensor scales, ScalarType dtype=float) -> Tensor")                \
  OP(linear_w4, "(Tensor x, Tensor qweight, Tensor scales, int group_size, Tensor? bias=None) -> Tensor")       \
  OP(dequantize_int4, "(Tensor qweight, Tensor scales, int group_size, ScalarType dtype=float) -> Tensor")      \
  OP(linear_w4_tiled, "(Tensor x, Tensor qweight, Tensor scales, int group_size, Tensor? bias=None) -> Tensor") \
  OP(dequantize_int4_tiled,                                                                                     \
     "(Tensor qweight, Tensor scales, int group_size, ScalarType dtype=float) -> Tensor")                       \
  OP(linear_w8a8,                                                                                               \
     "(Tensor x, Tensor qweight, Tensor scales, Tensor weight_sum, Tensor? bias=None, float input_scale=0.) "   \
     "-> Tensor")                                                                                               \
  OP(linear_w8a8_tiled,                                                                                         \
     "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None, float input_scale=0.) -> Tensor")            \
  OP(linear_w4a8, "(Tensor x, Tensor qweight, Tensor scales, int group_size, Tensor? bias=None) -> Tensor")     \
  OP(linear_w4a8_tiled,                                                                                         \
     "(Tensor x, Tensor qweight, Tensor scales, int group_size, Tensor? bias=None) -> Tensor")                  \
  OP(linear_fp8, "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None) -> Tensor")                      \
  OP(quantize_fp8, "(Tensor x, float inv_scale) -> Tensor")                                                     \
  OP(dequantize_fp8, "(Tensor qweight, ScalarType dtype=float) -> Tensor")                                      \
  OP(gptq_block,                                                                                                \
     "(Tensor(a!) pending, Tensor hinv, Tensor(b!) scales, Tensor? clip, int column, int group_size, str grid) " \
     "-> (Tensor, Tensor)")                                                                                     \
  OP(fake_quant_int4, "(Tensor w, Tensor? column_scales, int group_size, float ratio=1.) -> Tensor")           \
  OP(pack_int4_tiled, "(Tensor qweight, Tensor scales, int group_size) -> (Tensor, Tensor)")                    \
  OP(pack_int8_tiled, "(Tensor qweight) -> Tensor")                                                             \
  OP(pack_bf16_tiled, "(Tensor weight) -> Tensor")                                                              \
  OP(to_hugepages, "(Tensor t) -> Tensor")

// Ops on the library itself (no tensors, so no fake and no dispatch key): HOST_OP(name, schema)
#define KILN_HOST_OP_LIST(OP)              \
  OP(select_isa, "(str isa) -> str")       \
  OP(active_isa, "() -> str")              \
  OP(tiled_layouts, "() -> str")           \
  OP(set_prefetch, "(int bytes) -> int")   \
  OP(step_clock, "(bool on) -> str")       \
  OP(set_decode_team, "(bool on) -> bool") \
  OP(library_info, "() -> str")
