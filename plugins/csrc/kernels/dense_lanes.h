// Dense linears at many rows on AVX2: the input rows in the vector lanes (lanes.h), every
// (row, output) sum in the order dot() and dot4() give it, so a row gets the same bits from 1
// row to max_num_tokens and whichever rows share its step. Included per ISA inside kiln::<isa>
// after lanes.h.
//
// dot() keeps kChains = 16 chains a row: input i of the first E inputs (the steps of 16, then
// one of 8 into the first eight chains when 8 or more are left) joins chain i % 16 by one FMA;
// the chains start at zero; the sum is vsum(chains 0-7) + vsum(chains 8-15), then each of the
// last k - E inputs is multiplied and added. Here one chain of 16 rows against 6 outputs runs
// as its own loop of FMAs over its steps (lanes_six_outputs: 12 multiply-adds of 8 lanes for 8
// loads, where dot4 spends 10 loads and 2 widenings on 8), the chains then add up as vsum adds
// them, 8 rows a vector, and the tails follow as dot() does them.
//
//   kFloatLanesFrom      rows from which linear (select.h) takes the lanes: in a scratch program
//                        (one process, SmolLM2's shapes, one thread, rows line-aligned) they ran
//                        at 0.82-1.02x dot4's speed at 16 rows, 1.02-1.18x at 32, 1.01-1.35x at 48
//   linear_float_lanes   out = x @ w^T (+ bias), float or bf16
//   kFloatLaneOutputs    outputs a group: the kernel's 12 accumulators are 2 row vectors x 6
//   kFloatLanePass       inputs of a group's weights widened to fp32 at a time (18 KB, in L1)
//   kFloatLaneBlock      chunks of 16 rows a pass over a group's weights serves

#if defined(KILN_ISA_AVX2)
constexpr int64_t kFloatLanesFrom = 32;
constexpr int64_t kFloatLaneOutputs = 6, kFloatLanePass = 768, kFloatLaneBlock = 4;
constexpr int64_t kFloatLaneStride = kFloatLanePass + 16;  // a pass's row in Wf (skewed off 4 KB)

// Wf [6][kFloatLaneStride]: inputs [p0, p1) of output rows w [on][k] widened to fp32 (outputs on
// and up zero); p1 - p0 is a multiple of 8
template <typename T>
inline void lanes_float_weights(const T* w, int64_t k, int64_t on, int64_t p0, int64_t p1, float* Wf) {
  for (int64_t o = 0; o < kFloatLaneOutputs; ++o) {
    float* dst = Wf + o * kFloatLaneStride;
    for (int64_t i = p0; i < p1; i += 8) vstore(dst + i - p0, o < on ? vload(w + o * k + i) : vzero());
  }
}

// out rows of chunk c, outputs [o0, o0 + on): each row's chains (chains [chain][output][row])
// added as dot() adds its two accumulators' lanes, the inputs from E on one by one, + bias
template <typename T>
void lanes_float_store(const float* chains, const T* x, const T* w, const T* bias, T* out, int64_t rows,
                       int64_t k, int64_t n, int64_t E, int64_t c, int64_t o0, int64_t on) {
  for (int64_t o = 0; o < on; ++o) {
    alignas(32) float total[kLaneRows];
    for (int64_t h = 0; h < kLaneRows; h += 8) {
      __m256 p[kChains];
      for (int64_t j = 0; j < kChains; ++j)
        p[j] = _mm256_loadu_ps(chains + (j * kFloatLaneOutputs + o) * kLaneRows + h);
      auto vsum8 = [&](int b) {  // vsum's order (vec.h): ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
        return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(p[b], p[b + 4]), _mm256_add_ps(p[b + 2], p[b + 6])),
                             _mm256_add_ps(_mm256_add_ps(p[b + 1], p[b + 5]), _mm256_add_ps(p[b + 3], p[b + 7])));
      };
      _mm256_store_ps(total + h, _mm256_add_ps(vsum8(0), vsum8(8)));
    }
    const T* wo = w + (o0 + o) * k;
    const float b = bias ? to_f32(bias[o0 + o]) : 0.f;
    for (int64_t r = 0; r < kLaneRows && c * kLaneRows + r < rows; ++r) {
      const int64_t m = c * kLaneRows + r;
      float t = total[r];
      for (int64_t i = E; i < k; ++i) t += to_f32(x[m * k + i]) * to_f32(wo[i]);
      store_as(out + m * n + o0 + o, t + b);
    }
  }
}

template <typename T>
void linear_float_lanes(const T* x, const T* w, const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  // dot()'s vector part: its steps of two vectors, then one more vector if a whole one is left
  const int64_t E = k / kChains * kChains + (k % kChains >= kLanes ? kLanes : 0);
  const int64_t steps = (E + kChains - 1) / kChains;
  const int64_t chunks = (rows + kLaneRows - 1) / kLaneRows;
  const LineBuffer<float> buffer(chunks * kChains * steps * kLaneRows);
  float* X = buffer.data;
  parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) { lanes_inputs_f32(x, rows, k, E, steps, c0, c1, X); });
  const int64_t per_chunk = kChains * kFloatLaneOutputs * kLaneRows;  // a chunk's chains of a group
  parallel_for(0, (n + kFloatLaneOutputs - 1) / kFloatLaneOutputs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Wf(kFloatLaneOutputs * kFloatLaneStride);
    std::vector<float> chains(kFloatLaneBlock * per_chunk);  // [chunk of the block][chain][output][row]
    for (int64_t g = begin; g < end; ++g) {
      const int64_t o0 = g * kFloatLaneOutputs, on = std::min(kFloatLaneOutputs, n - o0);
      for (int64_t b0 = 0; b0 < chunks; b0 += kFloatLaneBlock) {
        const int64_t b1 = std::min(chunks, b0 + kFloatLaneBlock);
        std::fill(chains.begin(), chains.begin() + (b1 - b0) * per_chunk, 0.f);
        for (int64_t p0 = 0; p0 < E; p0 += kFloatLanePass) {
          const int64_t p1 = std::min(E, p0 + kFloatLanePass);
          lanes_float_weights(w + o0 * k, k, on, p0, p1, Wf.data());
          for (int64_t c = b0; c < b1; ++c)
            for (int64_t j = 0; j < kChains; ++j) {
              const int64_t count = (p1 - p0 - j + kChains - 1) / kChains;  // chain j's steps in [p0, p1)
              if (count <= 0) continue;
              float* acc = chains.data() + (c - b0) * per_chunk + j * kFloatLaneOutputs * kLaneRows;
              lanes_six_outputs<kFloatLaneStride>(X + ((c * kChains + j) * steps + p0 / kChains) * kLaneRows,
                                                  Wf.data() + j, count, acc);
            }
        }
        for (int64_t c = b0; c < b1; ++c)
          lanes_float_store(chains.data() + (c - b0) * per_chunk, x, w, bias, out, rows, k, n, E, c, o0, on);
      }
    }
  });
}
#endif
