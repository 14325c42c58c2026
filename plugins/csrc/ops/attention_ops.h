// The paged attention op (kernels/attention.h): its checks, and its run on checked arguments
// (which decode_layers calls per layer without the checks).

static void check_int32_vector(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == dims && t.is_contiguous() && t.device().is_cpu(),
              "kiln::paged_attention: ", name, " must be a contiguous int32 CPU tensor with ", dims,
              " dims, got ", t.scalar_type(), " ", t.sizes());
}

// paged_attention's checks, all made before any write (a bad table must not scribble over the
// pool) -> the batch's shape, and each token's sequence in token_seq
static PagedShape check_paged(const at::Tensor& qkv, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& block_tables, const at::Tensor& query_start,
                              const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                              int64_t heads, const c10::optional<at::Tensor>& kv_scales, int64_t key_hadamard,
                              int64_t window, std::vector<int32_t>& token_seq) {
  check_float_or_bf16(qkv, "qkv");
  const auto pool_type = k_pool.scalar_type();
  const bool quantized = pool_type == at::kChar || pool_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes(),
              "kiln::paged_attention: pools must be contiguous [blocks, kv_heads, block_size, head_dim]");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cos, "cos"}, {sin, "sin"}})
    TORCH_CHECK(t.scalar_type() == qkv.scalar_type(), "kiln::paged_attention: ", name, " dtype ",
                t.scalar_type(), " differs from qkv dtype ", qkv.scalar_type());
  TORCH_CHECK(v_pool.scalar_type() == pool_type && (quantized || pool_type == qkv.scalar_type()),
              "kiln::paged_attention: the pools must both be int8, float8_e4m3fn or qkv's dtype ",
              qkv.scalar_type(), ", got ", pool_type, " and ", v_pool.scalar_type());
  check_int32_vector(block_tables, "block_tables", 2);
  check_int32_vector(query_start, "query_start", 1);
  check_int32_vector(context_lens, "context_lens", 1);
  const int64_t kv_heads = k_pool.size(1), head_dim = k_pool.size(3);
  PagedShape shape{qkv.size(0), context_lens.size(0), heads, kv_heads, head_dim, k_pool.size(2),
                   block_tables.size(1), key_hadamard, window, cos.dim() == 2 ? cos.size(1) : 0};
  TORCH_CHECK(window >= 0, "kiln::paged_attention: window must be 0 (none) or a number of positions, got ", window);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * head_dim,
              "kiln::paged_attention: qkv ", qkv.sizes(), " is not [tokens, (", heads, " + 2 x ",
              kv_heads, ") x ", head_dim, "]");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
              "kiln::paged_attention: heads ", heads, " must be a multiple of kv_heads ", kv_heads,
              " and head_dim ", head_dim, " even");
  TORCH_CHECK(key_hadamard == 0 || (key_hadamard >= 2 && (key_hadamard & (key_hadamard - 1)) == 0 &&
                                    head_dim % key_hadamard == 0),
              "kiln::paged_attention: key_hadamard must be 0 or a power of two dividing head_dim ", head_dim,
              ", got ", key_hadamard);
  TORCH_CHECK(quantized == kv_scales.has_value(), "kiln::paged_attention: kv_scales go with an int8 or ",
              "float8_e4m3fn pool, and only with one");
  if (quantized)
    TORCH_CHECK(kv_scales->scalar_type() == at::kFloat && kv_scales->is_contiguous() && kv_scales->dim() == 2 &&
                    kv_scales->size(0) == 2 && kv_scales->size(1) == kv_heads * head_dim,
                "kiln::paged_attention: kv_scales must be contiguous float32 [2, ", kv_heads * head_dim, "], got ",
                kv_scales->sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) > 0 && cos.size(1) <= head_dim && cos.size(1) % 2 == 0 &&
                  sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous(),
              "kiln::paged_attention: cos/sin must be contiguous [positions, rotary dims]: an even number of "
              "rotary dims up to head_dim ", head_dim, ", got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(query_start.size(0) == shape.seqs + 1 && block_tables.size(0) == shape.seqs,
              "kiln::paged_attention: ", shape.seqs, " sequences need query_start of ", shape.seqs + 1,
              " and block_tables of ", shape.seqs, " rows");
  // Validate the metadata before any write: a bad table must not scribble over the pool.
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_pool.size(0);
  TORCH_CHECK(qs[0] == 0 && qs[shape.seqs] == shape.tokens,
              "kiln::paged_attention: query_start must run from 0 to the token count");
  token_seq.assign(shape.tokens, 0);
  for (int64_t s = 0; s < shape.seqs; ++s) {
    TORCH_CHECK(qs[s + 1] >= qs[s] && cl[s] >= 0, "kiln::paged_attention: bad query_start/context_lens");
    const int64_t end = static_cast<int64_t>(cl[s]) + (qs[s + 1] - qs[s]);
    const int64_t used = (end + shape.block_size - 1) / shape.block_size;
    TORCH_CHECK(used <= shape.max_blocks, "kiln::paged_attention: sequence ", s, " reaches position ",
                end, ", beyond its block table of ", shape.max_blocks, " blocks");
    TORCH_CHECK(end <= cos.size(0), "kiln::paged_attention: sequence ", s, " reaches position ", end,
                ", beyond the rotary tables of ", cos.size(0), " positions");
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = bt[s * shape.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "kiln::paged_attention: block id ", block,
                  " outside the pool of ", num_blocks);
    }
    std::fill(token_seq.begin() + qs[s], token_seq.begin() + qs[s + 1], static_cast<int32_t>(s));
  }
  return shape;
}

// paged_attention on checked arguments, the pools given as pointers of type pool_type
static at::Tensor run_paged(const at::Tensor& qkv, void* k_pool, void* v_pool, at::ScalarType pool_type,
                            const at::Tensor& block_tables, const at::Tensor& query_start,
                            const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                            const PagedShape& shape, const std::vector<int32_t>& token_seq, double scale,
                            const c10::optional<at::Tensor>& kv_scales) {
  const bool quantized = pool_type == at::kChar || pool_type == at::kFloat8_e4m3fn;
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t heads = shape.heads, head_dim = shape.head_dim;
  auto qkvc = qkv.contiguous();
  auto out = at::empty({shape.tokens, heads * head_dim}, qkvc.options());
  if (shape.tokens == 0) return out;
  const float* ks = quantized ? kv_scales->data_ptr<float>() : nullptr;
  const Kernels& k = active();
  // the kernel for (activations T, pool element P), the pools as P
  auto run = [&](auto kernel, auto* t, auto* pool) {
    using T = std::remove_pointer_t<decltype(t)>;
    using P = std::remove_pointer_t<decltype(pool)>;
    kernel(static_cast<const T*>(qkvc.data_ptr()), static_cast<const T*>(cos.data_ptr()),
           static_cast<const T*>(sin.data_ptr()), static_cast<P*>(k_pool), static_cast<P*>(v_pool),
           static_cast<T*>(out.data_ptr()), bt, qs, cl, token_seq.data(), shape, static_cast<float>(scale), ks);
  };
  if (qkv.scalar_type() == at::kFloat) {
    float* t = nullptr;
    if (pool_type == at::kChar) run(k.paged_attention_f32_i8, t, static_cast<int8_t*>(nullptr));
    else if (quantized) run(k.paged_attention_f32_fp8, t, static_cast<fp8e4m3*>(nullptr));
    else run(k.paged_attention_f32, t, static_cast<float*>(nullptr));
  } else {
    bf16* t = nullptr;
    if (pool_type == at::kChar) run(k.paged_attention_bf16_i8, t, static_cast<int8_t*>(nullptr));
    else if (quantized) run(k.paged_attention_bf16_fp8, t, static_cast<fp8e4m3*>(nullptr));
    else run(k.paged_attention_bf16, t, static_cast<bf16*>(nullptr));
  }
  return out;
}

at::Tensor paged_attention(const at::Tensor& qkv, at::Tensor& k_pool, at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                           int64_t heads, double scale, const c10::optional<at::Tensor>& kv_scales,
                           int64_t key_hadamard, int64_t window) {
  std::vector<int32_t> token_seq;
  const PagedShape shape = check_paged(qkv, k_pool, v_pool, block_tables, query_start, context_lens, cos, sin, heads,
                                       kv_scales, key_hadamard, window, token_seq);
  return run_paged(qkv, k_pool.data_ptr(), v_pool.data_ptr(), k_pool.scalar_type(), block_tables, query_start,
                   context_lens, cos, sin, shape, token_seq, scale, kv_scales);
}

