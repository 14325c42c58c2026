// Ops that lay weights out at load: 2 MB pages, and the tiled int4 / int8 / bf16 packers (formats.h:
// the same bytes and scales as the stored tensors, reordered; shapes are kept). The packers
// allocate ordinary memory of the tensor's size: the loader copies every streamed weight into one
// arena of 2 MB pages (runtime/weight_arena.py), and pages of their own, each rounded up to 2 MB,
// would make a load of many small weights (a Mixture-of-Experts model's) peak far above them.

// --- weights in 2 MB pages ------------------------------------------------------------------
// Decode streams every weight once per step; with 4 KB pages the walk through a few hundred MB
// misses the TLB often (SmolLM2 int8_wo, one thread, its row-layout weights in ordinary
// anonymous memory / the safetensors file's pages / 2 MB pages: 6.5 / 6.7 / 6.1 ms a step;
// benchmarks/ablations/decode_variants.py --memory).
// The memory is asked for transparent huge pages (madvise; where the kernel has them off it
// stays ordinary pages and nothing else changes).
constexpr size_t kHugePage = size_t(2) << 20;

static at::Tensor empty_hugepages(at::IntArrayRef sizes, at::TensorOptions options) {
  int64_t count = 1;
  for (auto d : sizes) count *= d;
  const size_t bytes = static_cast<size_t>(count) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  const size_t size = std::max(kHugePage, (bytes + kHugePage - 1) / kHugePage * kHugePage);
  void* p = std::aligned_alloc(kHugePage, size);
  TORCH_CHECK(p != nullptr, "kiln: out of memory allocating ", size, " bytes for weights");
  madvise(p, size, MADV_HUGEPAGE);  // a hint; its failure leaves ordinary pages
  return at::from_blob(p, sizes, [](void* q) { std::free(q); }, options.device(at::kCPU));
}

at::Tensor to_hugepages(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "kiln::to_hugepages: t must be on the CPU");
  auto src = t.contiguous();
  auto out = empty_hugepages(src.sizes(), src.options());
  if (src.numel() > 0) std::memcpy(out.data_ptr(), src.data_ptr(), src.numel() * src.element_size());
  return out;
}

std::tuple<at::Tensor, at::Tensor> pack_int4_tiled(const at::Tensor& qweight, const at::Tensor& scales,
                                                   int64_t group_size) {
  check_tiled("pack_int4_tiled", qweight, scales, group_size);
  auto packed = at::empty(qweight.sizes(), qweight.options());  // the loader moves it into 2 MB pages
  auto packed_scales = at::empty_like(scales);
  pack_int4_tiled_bytes(static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(), group_size,
                        static_cast<uint8_t*>(packed.data_ptr()), packed_scales.data_ptr<float>(),
                        qweight.size(1) * 2, qweight.size(0));
  return {packed, packed_scales};
}

at::Tensor pack_int8_tiled(const at::Tensor& qweight) {
  check_tiled8("pack_int8_tiled", qweight, at::kChar);
  auto packed = at::empty(qweight.sizes(), qweight.options().dtype(at::kByte));  // (as pack_int4_tiled's)
  pack_int8_tiled_bytes(static_cast<const int8_t*>(qweight.data_ptr()), static_cast<uint8_t*>(packed.data_ptr()),
                        qweight.size(1), qweight.size(0));
  return packed;
}

at::Tensor pack_bf16_tiled(const at::Tensor& weight) {
  check_tiled_bf16("pack_bf16_tiled", weight);
  auto packed = at::empty(weight.sizes(), weight.options());  // (as pack_int4_tiled's)
  pack_bf16_tiled_values(reinterpret_cast<const bf16*>(weight.data_ptr()), reinterpret_cast<bf16*>(packed.data_ptr()),
                         weight.size(1), weight.size(0));
  return packed;
}
