// kiln's plugin library, one translation unit (compiling one that includes torch's headers takes
// most of a minute, so the sources are headers included here):
//
//   parallel.h          parallel_for, how kernels split a loop between threads (a Team keeps
//                       the threads of a whole decode step in one OpenMP region)
//   formats.h           the shapes and weight layouts the kernels and ops agree on
//   kernels/            one header per kernel family, each ISA's paths side by side, compiled
//                       below once per instruction set in its own namespace; kernels/select.h
//                       chooses which implementation each entry point runs on that ISA
//   kernel_table.h      the table of entry points, filled by name per ISA; dispatch.h picks one
//                       table when the library loads
//   ops/                the torch ops (namespace `kiln`): argument checks, then a table entry
//   op_table.h          every op's name and schema, registered below
//
// Fake (meta) implementations live in kiln/plugins/ops.py so the ops trace and export.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace kiln {

using bf16 = c10::BFloat16;

#include "parallel.h"
#include "formats.h"

// How many bytes ahead of their reads the GEMVs prefetch their weights (kernels/vec.h; 0: no
// software prefetch): KILN_PREFETCH_BYTES sets it at load, the set_prefetch op for benchmarks
constexpr int64_t kMaxPrefetchBytes = 1 << 20;
inline int64_t prefetch_bytes_at_load() {
  const char* env = std::getenv("KILN_PREFETCH_BYTES");
  return env ? std::clamp<int64_t>(std::atoll(env), 0, kMaxPrefetchBytes) : 4096;
}
inline int64_t g_prefetch_ahead = prefetch_bytes_at_load();

namespace scalar {
#define KILN_ISA_SCALAR
#include "kernels/all.h"
#undef KILN_ISA_SCALAR
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define KILN_ISA_AVX2
#include "kernels/all.h"
#undef KILN_ISA_AVX2
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace avx2vnni {  // AVX2 with AVX-VNNI: vpdpbusd on 256-bit registers (Alder Lake, Zen 5)
#define KILN_ISA_AVX2
#define KILN_ISA_AVXVNNI
#include "kernels/all.h"
#undef KILN_ISA_AVXVNNI
#undef KILN_ISA_AVX2
}  // namespace avx2vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
#define KILN_ISA_AVX512
#include "kernels/all.h"
#undef KILN_ISA_AVX512
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c")
namespace avx512bf16 {  // AVX512-BF16 and AVX512-VNNI (Cooper Lake, Sapphire Rapids, Zen 4 and later)
#define KILN_ISA_AVX512
#define KILN_ISA_AVX512BF16
#define KILN_ISA_VNNI
#include "kernels/all.h"
#undef KILN_ISA_VNNI
#undef KILN_ISA_AVX512BF16
#undef KILN_ISA_AVX512
}  // namespace avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,amx-tile,amx-int8,amx-bf16,avx2,fma,f16c")
namespace avx512amx {  // avx512bf16 with AMX tiles (Sapphire Rapids and later Xeons): bf16 at every row count, int8 and int4 at many
#define KILN_ISA_AVX512
#define KILN_ISA_AVX512BF16
#define KILN_ISA_VNNI
#define KILN_ISA_AMX
#include "kernels/all.h"
#undef KILN_ISA_AMX
#undef KILN_ISA_VNNI
#undef KILN_ISA_AVX512BF16
#undef KILN_ISA_AVX512
}  // namespace avx512amx
#pragma GCC pop_options

#include "kernel_table.h"
#include "dispatch.h"

#include "ops/checks.h"
#include "ops/dense_ops.h"
#include "ops/attention_ops.h"
#include "ops/quant_ops.h"
#include "ops/layout_ops.h"
#include "ops/decode_plan.h"
#include "ops/step_clock.h"
#include "ops/decode_layers.h"
#include "ops/moe_ops.h"
#include "op_table.h"

// What the Python side checks the library against when it loads it (plugins/ops.py), as JSON:
// the ops (fakes are registered for exactly these), the decode plan's layout, the tiled
// layouts' constants.
std::string library_info() {
#define KILN_OP_NAME(name, schema) "\"" #name "\","
  std::string ops = KILN_OP_LIST(KILN_OP_NAME), host = KILN_HOST_OP_LIST(KILN_OP_NAME);
#undef KILN_OP_NAME
  ops.pop_back();
  host.pop_back();
  return "{\"ops\": [" + ops + "], \"host_ops\": [" + host + "], \"decode_plan\": " + plan::layout_json() +
         ", \"tile_rows\": " + std::to_string(kTileRows) + ", \"tiled_max_group\": " + std::to_string(kTiledMaxGroup) +
         ", \"w8a8_tiled_max_in\": " + std::to_string(kW8A8TiledMaxIn) + "}";
}

}  // namespace kiln

TORCH_LIBRARY(kiln, m) {
#define KILN_DEFINE(name, schema) m.def(#name schema);
  KILN_OP_LIST(KILN_DEFINE)
#undef KILN_DEFINE
#define KILN_DEFINE_HOST(name, schema) m.def(#name schema, &kiln::name);
  KILN_HOST_OP_LIST(KILN_DEFINE_HOST)
#undef KILN_DEFINE_HOST
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
#define KILN_IMPLEMENT(name, schema) m.impl(#name, &kiln::name);
  KILN_OP_LIST(KILN_IMPLEMENT)
#undef KILN_IMPLEMENT
}
