// Dense linears: out = x @ w^T (+ bias), w [out, in] in the model dtype.
//
//   dense_rows      the driver both share: a weight row against four input rows at a time
//   linear_float    the weights widened per vector, fp32 FMAs (every ISA)
//   linear_bf16_dp  AVX512-BF16, bf16: vdpbf16ps on the stored bf16 pairs
//
// Skinny linear layer for decode steps: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), for a
// handful of rows m. At batch 1 a decode step is a GEMV that only has to stream the weights
// once at memory bandwidth: each weight row is read once and widened once, and used for up to
// four input rows at a time (inputs widened to fp32 up front; 2-3 rows left over as the last
// four, one alone). fp32 accumulation, one rounding to T at the end.
// Included per ISA inside kiln::<isa> after vec.h.

// The dense driver: each weight row o of w against the input rows four at a time (four(m, o,
// sums) fills sums[0, 4)), the rows left over one by one (one(m, o)), or where 2-3 are left, as
// the last four rows of the call (some computed twice); out = sums + bias, rounded once. Many
// rows go a block at a time (row_blocks) against a block of weight rows, so neither
// is fetched from further than L2 for every row of the other.
template <typename T, typename Four, typename One>
void dense_rows(const T* w, int64_t k, const T* bias, T* out, int64_t rows, int64_t n, Four four, One one) {
  const WeightRows stream{w, k * static_cast<int64_t>(sizeof(T))};
  const RowBlocks blocks = row_blocks(k * static_cast<int64_t>(sizeof(float)), stream.row_bytes);
  parallel_for(0, n, 32, [&](int64_t begin, int64_t end) {
    float sums[4];
    for (int64_t o0 = begin; o0 < end; o0 += blocks.weights) {
      const int64_t o1 = std::min(end, o0 + blocks.weights);
      for (int64_t m0 = 0; m0 < rows; m0 += blocks.inputs) {
        const int64_t m1 = std::min(rows, m0 + blocks.inputs), grouped = m0 + (m1 - m0) / 4 * 4;
        for (int64_t o = o0; o < o1; ++o) {
          if (m0 == 0) stream.ahead(o);  // later blocks find the weights in L2
          const float b = bias ? to_f32(bias[o]) : 0.f;
          for (int64_t m = m0; m < grouped; m += 4) {
            four(m, o, sums);
            for (int64_t r = 0; r < 4; ++r) store_as(out + (m + r) * n + o, sums[r] + b);
          }
          if (m1 - grouped >= 2 && m1 >= 4) {  // 2-3 rows left: the four rows ending at m1, the
            four(m1 - 4, o, sums);              // earlier ones' sums dropped (a group of four takes
            for (int64_t m = grouped; m < m1; ++m)  // less than two rows alone, the same bits)
              store_as(out + m * n + o, sums[m - (m1 - 4)] + b);
          } else {
            for (int64_t m = grouped; m < m1; ++m) store_as(out + m * n + o, one(m, o) + b);
          }
        }
      }
    }
  });
}

template <typename T>
void linear_float(const T* x, const T* w, const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  const LineBuffer<float> buffer(rows * k);
  float* xf = buffer.data;
  for (int64_t i = 0; i < rows * k; ++i) xf[i] = to_f32(x[i]);
  dense_rows(
      w, k, bias, out, rows, n,
      [&](int64_t m, int64_t o, float* sums) {
        const float* x0 = xf + m * k;
        dot4(x0, x0 + k, x0 + 2 * k, x0 + 3 * k, w + o * k, k, sums);
      },
      [&](int64_t m, int64_t o) { return dot(xf + m * k, w + o * k, k); });
}

#if defined(KILN_ISA_AVX512BF16)
// bf16 x bf16 with AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs and accumulates in fp32, so
// neither side is widened first (half the instructions of the widen-and-FMA path).
inline __m512bh load_bf16x32(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline float dot_dp(const bf16* a, const bf16* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, load_bf16x32(a + i), load_bf16x32(b + i));
    acc1 = _mm512_dpbf16_ps(acc1, load_bf16x32(a + i + 32), load_bf16x32(b + i + 32));
  }
  for (; i + 32 <= n; i += 32) acc0 = _mm512_dpbf16_ps(acc0, load_bf16x32(a + i), load_bf16x32(b + i));
  float total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; i < n; ++i) total += to_f32(a[i]) * to_f32(b[i]);
  return total;
}

inline void dot4_dp(const bf16* x, int64_t stride, const bf16* w, int64_t n, float* out) {
  // each row summed as dot_dp sums it (two chains over 64, a last 32 into the first, the two
  // added before the reduction, then the tail): a row gets the same bits in a group of four as alone
  __m512 a[4], b[4];
  for (int r = 0; r < 4; ++r) a[r] = b[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512bh w0 = load_bf16x32(w + i), w1 = load_bf16x32(w + i + 32);
    for (int r = 0; r < 4; ++r) {
      a[r] = _mm512_dpbf16_ps(a[r], load_bf16x32(x + r * stride + i), w0);
      b[r] = _mm512_dpbf16_ps(b[r], load_bf16x32(x + r * stride + i + 32), w1);
    }
  }
  for (; i + 32 <= n; i += 32) {
    const __m512bh w0 = load_bf16x32(w + i);
    for (int r = 0; r < 4; ++r) a[r] = _mm512_dpbf16_ps(a[r], load_bf16x32(x + r * stride + i), w0);
  }
  for (int r = 0; r < 4; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r], b[r]));
  for (; i < n; ++i) {
    const float wi = to_f32(w[i]);
    for (int r = 0; r < 4; ++r) out[r] += to_f32(x[r * stride + i]) * wi;
  }
}

void linear_bf16_dp(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t rows, int64_t k,
                    int64_t n) {
  dense_rows(
      w, k, bias, out, rows, n, [&](int64_t m, int64_t o, float* sums) { dot4_dp(x + m * k, k, w + o * k, k, sums); },
      [&](int64_t m, int64_t o) { return dot_dp(x + m * k, w + o * k, k); });
}
#endif
