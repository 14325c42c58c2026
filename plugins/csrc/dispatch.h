// Which ISA's kernel table runs: chosen once when the library loads (KILN_ISA overrides, e.g. to
// run the scalar reference path), switched only by the select_isa op (tests, benchmarks).

// AMX's tile registers are usable once the kernel grants this process their state (Linux 5.16+:
// arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; a hypervisor may leave it off). Asked once.
static bool amx_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

static bool host_supports(const std::string& isa) {
  if (isa == "avx512amx")
    return host_supports("avx512bf16") && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
           __builtin_cpu_supports("amx-bf16") &&
           amx_permitted();
  if (isa == "avx512bf16")
    return host_supports("avx512") && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2vnni") return host_supports("avx2") && __builtin_cpu_supports("avxvnni");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == "scalar";
}

static Kernels kernels_for(const std::string& requested) {
  std::string isa = requested;
  if (isa == "auto")
    isa = host_supports("avx512amx")    ? "avx512amx"
          : host_supports("avx512bf16") ? "avx512bf16"
          : host_supports("avx512")     ? "avx512"
          : host_supports("avx2vnni")   ? "avx2vnni"
          : host_supports("avx2")       ? "avx2"
                                        : "scalar";
  TORCH_CHECK(isa == "avx512amx" || isa == "avx512bf16" || isa == "avx512" || isa == "avx2vnni" || isa == "avx2" ||
                  isa == "scalar",
              "kiln: unknown ISA '", requested,
              "'; expected auto, avx512amx, avx512bf16, avx512, avx2vnni, avx2 or scalar");
  TORCH_CHECK(host_supports(isa), "kiln: this CPU does not support ISA '", isa, "'");
  if (isa == "avx512amx") return KILN_KERNELS_OF(avx512amx);
  if (isa == "avx512bf16") return KILN_KERNELS_OF(avx512bf16);
  if (isa == "avx512") return KILN_KERNELS_OF(avx512);
  if (isa == "avx2vnni") return KILN_KERNELS_OF(avx2vnni);
  if (isa == "avx2") return KILN_KERNELS_OF(avx2);
  return KILN_KERNELS_OF(scalar);
}

static Kernels& active() {
  static Kernels k = kernels_for(std::getenv("KILN_ISA") ? std::getenv("KILN_ISA") : "auto");
  return k;
}

std::string select_isa(std::string isa) {
  active() = kernels_for(isa);
  return active().isa;
}

std::string active_isa() { return active().isa; }

// The weight layouts the runtime should make at load for the active ISA, comma-separated
// ("int4,int8,bf16,w8a8": all four tiled)
std::string tiled_layouts() {
  const Kernels& k = active();
  const std::pair<const char*, bool> layouts[] = {
      {"int4", k.tiled_int4}, {"int8", k.tiled_int8}, {"bf16", k.tiled_bf16}, {"w8a8", k.tiled_w8a8}};
  std::string out;
  for (const auto& [name, tiled] : layouts)
    if (tiled) out += (out.empty() ? "" : ",") + std::string(name);
  return out;
}

// The GEMVs' software prefetch distance in bytes (0: none); returns the previous one
int64_t set_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= kMaxPrefetchBytes, "kiln::set_prefetch: bytes must be in [0, ", kMaxPrefetchBytes,
              "], got ", bytes);
  const int64_t before = g_prefetch_ahead;
  g_prefetch_ahead = bytes;
  return before;
}
