// GEMMs with the input rows in the vector lanes (AVX2, at many rows: the int16-weight kernels of
// int4_tiled.h, int8.h and w8a8.h, W4A8's byte kernel (w4a8.h) and the float linears of
// dense_lanes.h). Included per ISA inside kiln::<isa> after gemv.h.
//
// Integers: an input is an int16 and so is a weight; one vpmaddwd multiplies 8 rows by a pair of
// one output's weights (broadcast), 16 multiply-adds an instruction with no reduction across
// lanes: each lane holds one (row, output) sum, so a row's sums never depend on which rows share
// its vectors. The inputs go in chunks of kLaneRows rows: X [chunk][pairs][kLaneRows] dwords,
// each dword a row's two int16 inputs of one pair. W4A8's inputs are int8 and its weights
// nibbles: a dword holds 4 inputs of a row, and one vpmaddubsw multiplies 8 rows by 4 inputs.
// Floats: one vfmadd231ps multiplies 8 rows by one output's weight (broadcast); each lane holds
// one (row, output) chain of FMAs, the chains dot() keeps in its lanes (dense_lanes.h).
//
//   kLaneRows             input rows a pass holds in its lanes (two vectors)
//   lane_rows             of a call's rows, those the lanes take (the first ones): none below
//                         kLanesFrom (the integer kernels; the float ones from kFloatLanesFrom,
//                         dense_lanes.h), and the rows past the last whole chunk go to the row
//                         kernel when there are at most kLaneTail of them
//   lanes_inputs_i16      int16 rows [rows][kp] to X (the pairs in order)
//   lanes_inputs_dwords   rows of dwords to X (lanes_inputs_i16 for int16 pairs, and for int8
//                         rows 4 inputs a dword)
//   lanes_four_outputs    int32 sums of one chunk's 16 rows against 4 outputs over `count` pairs
//   lanes_four_outputs_u8 the same for int8 inputs against unsigned 4-bit weights, 4 inputs a
//                         step (vpmaddubsw: twice the multiply-adds of an int16 step)
//   lanes_inputs_f32      float rows to X by chain ([chunk][chain][step][kLaneRows] floats)
//   lanes_store_tile      a tile's [16 outputs][kLaneRows rows] float sums out to the rows
//   lanes_six_outputs     fp32 chains of one chunk's 16 rows against 6 outputs, `count` steps on

#if defined(KILN_ISA_AVX2)
constexpr int64_t kLaneRows = 16;
// The lanes pad a call's last chunk to kLaneRows rows, so 17 rows cost what 32 do. Of a call's
// rows the lanes take: below kLaneRows, all of them from `from` rows on (a call's one padded
// chunk costs less than 15 rows of the W4A16 and W8A16 row kernels, about what 14 do), none
// before; past whole chunks, up to `tail` rows go to the row kernel instead (a further chunk
// costs more than 12 rows of those row kernels or of the dense one, 8 of W8A8's, which is
// slower). Zen 3, one thread, SmolLM2's shapes (docs/benchmarks.md). Every kernel gives a row
// the bits it gets alone, so the split changes no output.
constexpr int64_t kLanesFrom = 15, kLaneTail = 12;
inline int64_t lane_rows(int64_t rows, int64_t from = kLanesFrom, int64_t tail = kLaneTail) {
  if (rows < kLaneRows) return rows >= from ? rows : 0;
  return rows % kLaneRows <= tail ? rows - rows % kLaneRows : rows;
}

// X [chunk][dwords][kLaneRows] from rows of `dwords` dwords each (at `rows_at`, a row's bytes
// in order): dword p of row m at X[m / kLaneRows][p][m % kLaneRows]; the rows past `rows` zero
inline void lanes_inputs_dwords(const void* rows_at, int64_t rows, int64_t dwords, int32_t* X) {
  const int64_t chunks = (rows + kLaneRows - 1) / kLaneRows;
  std::memset(X, 0, sizeof(int32_t) * chunks * dwords * kLaneRows);
  for (int64_t m = 0; m < rows; ++m) {
    int32_t* xm = X + (m / kLaneRows) * dwords * kLaneRows + m % kLaneRows;
    const char* row = static_cast<const char*>(rows_at) + m * dwords * 4;
    for (int64_t p = 0; p < dwords; ++p) std::memcpy(xm + p * kLaneRows, row + 4 * p, 4);
  }
}

// r[q] = element q of each of the 8 vectors r held (an 8 x 8 transposition)
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int q = 0; q < 8; q += 2) {
    t[q] = _mm256_unpacklo_ps(r[q], r[q + 1]);
    t[q + 1] = _mm256_unpackhi_ps(r[q], r[q + 1]);
  }
  for (int q = 0; q < 8; q += 4) {
    u[q] = _mm256_shuffle_ps(t[q], t[q + 2], 0x44);
    u[q + 1] = _mm256_shuffle_ps(t[q], t[q + 2], 0xEE);
    u[q + 2] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0x44);
    u[q + 3] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
  }
  for (int q = 0; q < 8; ++q) r[q] = _mm256_permute2f128_ps(u[q % 4], u[q % 4 + 4], q < 4 ? 0x20 : 0x31);
}

// One tile's outputs for one chunk of rows: out [count rows, 16 outputs from o0] (row stride n,
// from the chunk's first row) = facc [16 outputs][kLaneRows rows], times the row's scale
// xs_row[m] where given, plus the bias, rounded as store_as rounds: the bits of
// store_as(out, facc * xs_row[m] + bias) output by output, 8 outputs of a row a store
template <typename T>
inline void lanes_store_tile(const float* facc, const float* xs_row, const T* bias, T* out, int64_t count, int64_t n,
                             int64_t o0) {
  for (int64_t ob = 0; ob < kTileRows; ob += 8) {
    const __m256 b = bias ? vload(bias + o0 + ob) : _mm256_setzero_ps();
    for (int64_t h = 0; h < std::min<int64_t>(count, kLaneRows); h += 8) {
      __m256 r[8];
      for (int q = 0; q < 8; ++q) r[q] = _mm256_load_ps(facc + (ob + q) * kLaneRows + h);
      transpose8x8(r);  // r[j]: row h + j's 8 outputs
      for (int64_t j = 0; j < std::min<int64_t>(8, count - h); ++j) {
        const __m256 v = xs_row ? _mm256_mul_ps(r[j], _mm256_set1_ps(xs_row[h + j])) : r[j];
        vstore_as(out + (h + j) * n + o0 + ob, _mm256_add_ps(v, b));
      }
    }
  }
}

// X [chunk][kp / 2 pairs][kLaneRows] dwords from int16 rows of kp (even) inputs, pair p of a row
// being its inputs (2p, 2p + 1); the rows past `rows` zero
inline void lanes_inputs_i16(const int16_t* xq, int64_t rows, int64_t kp, int32_t* X) {
  lanes_inputs_dwords(xq, rows, kp / 2, X);
}

// sums [4 outputs][kLaneRows rows] = the int32 dot products over `count` > 0 pairs of X (one
// chunk, from a pair on) with 4 outputs of the weights W: dwords of two int16 weights, output j's
// pair i at W + j * OutputStep + i * PairStep (in dwords; the caller's layout, constants so that
// they are the loads' displacements: registers as strides cost the int4 kernel 3-5%). Written in
// assembly: GCC kept the 8 accumulators in registers only by copying each one every pass (8 extra
// moves) or spilled them (a scratch copy of the int4 kernel, not kept: 43-45 and 30 GMAC/s
// against 48-49 with this loop, one thread).
template <int64_t OutputStep, int64_t PairStep>
inline void lanes_four_outputs(const int32_t* X, const int32_t* W, int64_t count, int32_t* sums) {
  asm volatile(
      "vpxor %%ymm8, %%ymm8, %%ymm8\n\t"
      "vpxor %%ymm9, %%ymm9, %%ymm9\n\t"
      "vpxor %%ymm10, %%ymm10, %%ymm10\n\t"
      "vpxor %%ymm11, %%ymm11, %%ymm11\n\t"
      "vpxor %%ymm12, %%ymm12, %%ymm12\n\t"
      "vpxor %%ymm13, %%ymm13, %%ymm13\n\t"
      "vpxor %%ymm14, %%ymm14, %%ymm14\n\t"
      "vpxor %%ymm15, %%ymm15, %%ymm15\n\t"
      "1:\n\t"
      "vmovdqu (%[x]), %%ymm0\n\t"  // rows 0-7 of this pair
      "vmovdqu 32(%[x]), %%ymm1\n\t"  // rows 8-15
      "vpbroadcastd (%[w]), %%ymm2\n\t"  // output 0's weight pair
      "vpbroadcastd %c[o1](%[w]), %%ymm3\n\t"  // output 1's
      "vpmaddwd %%ymm2, %%ymm0, %%ymm4\n\t"
      "vpmaddwd %%ymm2, %%ymm1, %%ymm5\n\t"
      "vpmaddwd %%ymm3, %%ymm0, %%ymm6\n\t"
      "vpmaddwd %%ymm3, %%ymm1, %%ymm7\n\t"
      "vpaddd %%ymm4, %%ymm8, %%ymm8\n\t"
      "vpaddd %%ymm5, %%ymm9, %%ymm9\n\t"
      "vpaddd %%ymm6, %%ymm10, %%ymm10\n\t"
      "vpaddd %%ymm7, %%ymm11, %%ymm11\n\t"
      "vpbroadcastd %c[o2](%[w]), %%ymm2\n\t"  // outputs 2 and 3
      "vpbroadcastd %c[o3](%[w]), %%ymm3\n\t"
      "vpmaddwd %%ymm2, %%ymm0, %%ymm4\n\t"
      "vpmaddwd %%ymm2, %%ymm1, %%ymm5\n\t"
      "vpmaddwd %%ymm3, %%ymm0, %%ymm6\n\t"
      "vpmaddwd %%ymm3, %%ymm1, %%ymm7\n\t"
      "vpaddd %%ymm4, %%ymm12, %%ymm12\n\t"
      "vpaddd %%ymm5, %%ymm13, %%ymm13\n\t"
      "vpaddd %%ymm6, %%ymm14, %%ymm14\n\t"
      "vpaddd %%ymm7, %%ymm15, %%ymm15\n\t"
      "add $64, %[x]\n\t"  // the next pair: kLaneRows dwords of X
      "add %[ps], %[w]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      "vmovdqu %%ymm8, (%[s])\n\t"
      "vmovdqu %%ymm9, 32(%[s])\n\t"
      "vmovdqu %%ymm10, 64(%[s])\n\t"
      "vmovdqu %%ymm11, 96(%[s])\n\t"
      "vmovdqu %%ymm12, 128(%[s])\n\t"
      "vmovdqu %%ymm13, 160(%[s])\n\t"
      "vmovdqu %%ymm14, 192(%[s])\n\t"
      "vmovdqu %%ymm15, 224(%[s])\n\t"
      : [x] "+r"(X), [w] "+r"(W), [n] "+r"(count)
      : [s] "r"(sums), [o1] "i"(4 * OutputStep), [o2] "i"(8 * OutputStep), [o3] "i"(12 * OutputStep),
        [ps] "i"(4 * PairStep)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "xmm14", "xmm15", "memory", "cc");
  static_assert(kLaneRows == 16, "the assembly's strides");
}

// sums [4 outputs][kLaneRows rows] = addend (the same shape: sums itself, or where a group starts)
// + the int32 dot products over `count` (1 to 8) steps of X (one chunk of int8 rows, 4 inputs a
// dword, from a step on) with 4 outputs' weights: dwords of 4 unsigned bytes below 16 (int4
// nibbles), output j's of step i at W + j * OutputStep + i * StepStride (dwords). One vpmaddubsw
// multiplies 8 rows by 4 inputs (32 multiply-adds) into int16 pairs; the pairs add up in int16
// for up to 8 steps (at most 8 * 2 * 15 * 127 = 30,480: no overflow, for inputs in [-127, 127])
// and are then widened to int32 by vpmaddwd with ones. Assembly for the reason
// lanes_four_outputs is. (A group's first pass adds its starting values, prepared once per call,
// rather than sums zeroed just before: loading back those stores cost a third of the kernel's
// time, Zen 3.)
template <int64_t OutputStep, int64_t StepStride>
inline void lanes_four_outputs_u8(const int32_t* X, const int32_t* W, int64_t count, const int32_t* addend,
                                  int32_t* sums) {
  asm volatile(
      "vpxor %%ymm8, %%ymm8, %%ymm8\n\t"
      "vpxor %%ymm9, %%ymm9, %%ymm9\n\t"
      "vpxor %%ymm10, %%ymm10, %%ymm10\n\t"
      "vpxor %%ymm11, %%ymm11, %%ymm11\n\t"
      "vpxor %%ymm12, %%ymm12, %%ymm12\n\t"
      "vpxor %%ymm13, %%ymm13, %%ymm13\n\t"
      "vpxor %%ymm14, %%ymm14, %%ymm14\n\t"
      "vpxor %%ymm15, %%ymm15, %%ymm15\n\t"
      "1:\n\t"
      "vmovdqu (%[x]), %%ymm0\n\t"  // rows 0-7 of this step (signed bytes)
      "vmovdqu 32(%[x]), %%ymm1\n\t"  // rows 8-15
      "vpbroadcastd (%[w]), %%ymm2\n\t"  // output 0's 4 weights (unsigned bytes)
      "vpbroadcastd %c[o1](%[w]), %%ymm3\n\t"  // output 1's
      "vpmaddubsw %%ymm0, %%ymm2, %%ymm4\n\t"
      "vpmaddubsw %%ymm1, %%ymm2, %%ymm5\n\t"
      "vpmaddubsw %%ymm0, %%ymm3, %%ymm6\n\t"
      "vpmaddubsw %%ymm1, %%ymm3, %%ymm7\n\t"
      "vpaddw %%ymm4, %%ymm8, %%ymm8\n\t"
      "vpaddw %%ymm5, %%ymm9, %%ymm9\n\t"
      "vpaddw %%ymm6, %%ymm10, %%ymm10\n\t"
      "vpaddw %%ymm7, %%ymm11, %%ymm11\n\t"
      "vpbroadcastd %c[o2](%[w]), %%ymm2\n\t"  // outputs 2 and 3
      "vpbroadcastd %c[o3](%[w]), %%ymm3\n\t"
      "vpmaddubsw %%ymm0, %%ymm2, %%ymm4\n\t"
      "vpmaddubsw %%ymm1, %%ymm2, %%ymm5\n\t"
      "vpmaddubsw %%ymm0, %%ymm3, %%ymm6\n\t"
      "vpmaddubsw %%ymm1, %%ymm3, %%ymm7\n\t"
      "vpaddw %%ymm4, %%ymm12, %%ymm12\n\t"
      "vpaddw %%ymm5, %%ymm13, %%ymm13\n\t"
      "vpaddw %%ymm6, %%ymm14, %%ymm14\n\t"
      "vpaddw %%ymm7, %%ymm15, %%ymm15\n\t"
      "add $64, %[x]\n\t"  // the next step: kLaneRows dwords of X
      "add %[ss], %[w]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      "vpcmpeqw %%ymm0, %%ymm0, %%ymm0\n\t"
      "vpsrlw $15, %%ymm0, %%ymm0\n\t"  // int16 ones: vpmaddwd adds a dword's two int16
      "vpmaddwd %%ymm0, %%ymm8, %%ymm8\n\t"
      "vpmaddwd %%ymm0, %%ymm9, %%ymm9\n\t"
      "vpmaddwd %%ymm0, %%ymm10, %%ymm10\n\t"
      "vpmaddwd %%ymm0, %%ymm11, %%ymm11\n\t"
      "vpmaddwd %%ymm0, %%ymm12, %%ymm12\n\t"
      "vpmaddwd %%ymm0, %%ymm13, %%ymm13\n\t"
      "vpmaddwd %%ymm0, %%ymm14, %%ymm14\n\t"
      "vpmaddwd %%ymm0, %%ymm15, %%ymm15\n\t"
      "vpaddd (%[a]), %%ymm8, %%ymm8\n\t"
      "vpaddd 32(%[a]), %%ymm9, %%ymm9\n\t"
      "vpaddd 64(%[a]), %%ymm10, %%ymm10\n\t"
      "vpaddd 96(%[a]), %%ymm11, %%ymm11\n\t"
      "vpaddd 128(%[a]), %%ymm12, %%ymm12\n\t"
      "vpaddd 160(%[a]), %%ymm13, %%ymm13\n\t"
      "vpaddd 192(%[a]), %%ymm14, %%ymm14\n\t"
      "vpaddd 224(%[a]), %%ymm15, %%ymm15\n\t"
      "vmovdqu %%ymm8, (%[s])\n\t"
      "vmovdqu %%ymm9, 32(%[s])\n\t"
      "vmovdqu %%ymm10, 64(%[s])\n\t"
      "vmovdqu %%ymm11, 96(%[s])\n\t"
      "vmovdqu %%ymm12, 128(%[s])\n\t"
      "vmovdqu %%ymm13, 160(%[s])\n\t"
      "vmovdqu %%ymm14, 192(%[s])\n\t"
      "vmovdqu %%ymm15, 224(%[s])\n\t"
      : [x] "+r"(X), [w] "+r"(W), [n] "+r"(count)
      : [s] "r"(sums), [a] "r"(addend), [o1] "i"(4 * OutputStep), [o2] "i"(8 * OutputStep),
        [o3] "i"(12 * OutputStep), [ss] "i"(4 * StepStride)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "xmm14", "xmm15", "memory", "cc");
  static_assert(kLaneRows == 16, "the assembly's strides");
}

// The float lanes' chains: dot() (vec.h) sums input i of a row in lane i % kChains of its two
// accumulators, one FMA a step of kChains inputs, so chain j holds inputs j, j + 16, j + 32, ...
constexpr int64_t kChains = 2 * kLanes;

// X [chunk][kChains][steps][kLaneRows] floats: input i < E (a multiple of 8) of row m at chain
// i % kChains, step i / kChains, lane m % kLaneRows of chunk m / kLaneRows (steps = the longest
// chain's length; the rows past `rows` zero), for the chunks [c0, c1). 8 rows by 8 inputs at a
// time through an 8 x 8 transposition.
template <typename T>
void lanes_inputs_f32(const T* x, int64_t rows, int64_t k, int64_t E, int64_t steps, int64_t c0, int64_t c1,
                      float* X) {
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t h = 0; h < kLaneRows; h += 8) {
      const int64_t m0 = c * kLaneRows + h;
      for (int64_t i0 = 0; i0 < E; i0 += 8) {
        __m256 r[8];
        for (int q = 0; q < 8; ++q) r[q] = m0 + q < rows ? vload(x + (m0 + q) * k + i0) : _mm256_setzero_ps();
        transpose8x8(r);
        for (int q = 0; q < 8; ++q) {  // input i0 + q of the 8 rows
          const int64_t i = i0 + q;
          _mm256_storeu_ps(X + ((c * kChains + i % kChains) * steps + i / kChains) * kLaneRows + h, r[q]);
        }
      }
    }
}

// acc [6 outputs][kLaneRows rows] += the products of one chunk's chain (X, from a step on) with
// 6 outputs' weights over `count` > 0 steps, one FMA per (output, 8 rows) a step, in order: output
// j's weight of step s at W + j * OutputStep + s * kChains (floats; a constant, as the loads'
// displacement). Written in assembly for the reason lanes_four_outputs is.
template <int64_t OutputStep>
inline void lanes_six_outputs(const float* X, const float* W, int64_t count, float* acc) {
  asm volatile(
      "vmovups (%[a]), %%ymm4\n\t"
      "vmovups 32(%[a]), %%ymm5\n\t"
      "vmovups 64(%[a]), %%ymm6\n\t"
      "vmovups 96(%[a]), %%ymm7\n\t"
      "vmovups 128(%[a]), %%ymm8\n\t"
      "vmovups 160(%[a]), %%ymm9\n\t"
      "vmovups 192(%[a]), %%ymm10\n\t"
      "vmovups 224(%[a]), %%ymm11\n\t"
      "vmovups 256(%[a]), %%ymm12\n\t"
      "vmovups 288(%[a]), %%ymm13\n\t"
      "vmovups 320(%[a]), %%ymm14\n\t"
      "vmovups 352(%[a]), %%ymm15\n\t"
      "1:\n\t"
      "vmovups (%[x]), %%ymm0\n\t"  // rows 0-7 of this step
      "vmovups 32(%[x]), %%ymm1\n\t"  // rows 8-15
      "vbroadcastss (%[w]), %%ymm2\n\t"  // output 0's weight
      "vbroadcastss %c[o1](%[w]), %%ymm3\n\t"  // output 1's
      "vfmadd231ps %%ymm2, %%ymm0, %%ymm4\n\t"
      "vfmadd231ps %%ymm2, %%ymm1, %%ymm5\n\t"
      "vfmadd231ps %%ymm3, %%ymm0, %%ymm6\n\t"
      "vfmadd231ps %%ymm3, %%ymm1, %%ymm7\n\t"
      "vbroadcastss %c[o2](%[w]), %%ymm2\n\t"  // outputs 2 and 3
      "vbroadcastss %c[o3](%[w]), %%ymm3\n\t"
      "vfmadd231ps %%ymm2, %%ymm0, %%ymm8\n\t"
      "vfmadd231ps %%ymm2, %%ymm1, %%ymm9\n\t"
      "vfmadd231ps %%ymm3, %%ymm0, %%ymm10\n\t"
      "vfmadd231ps %%ymm3, %%ymm1, %%ymm11\n\t"
      "vbroadcastss %c[o4](%[w]), %%ymm2\n\t"  // outputs 4 and 5
      "vbroadcastss %c[o5](%[w]), %%ymm3\n\t"
      "vfmadd231ps %%ymm2, %%ymm0, %%ymm12\n\t"
      "vfmadd231ps %%ymm2, %%ymm1, %%ymm13\n\t"
      "vfmadd231ps %%ymm3, %%ymm0, %%ymm14\n\t"
      "vfmadd231ps %%ymm3, %%ymm1, %%ymm15\n\t"
      "add $64, %[x]\n\t"  // the chain's next step: kLaneRows floats of X
      "add $64, %[w]\n\t"  // kChains floats further in each output's weights
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      "vmovups %%ymm4, (%[a])\n\t"
      "vmovups %%ymm5, 32(%[a])\n\t"
      "vmovups %%ymm6, 64(%[a])\n\t"
      "vmovups %%ymm7, 96(%[a])\n\t"
      "vmovups %%ymm8, 128(%[a])\n\t"
      "vmovups %%ymm9, 160(%[a])\n\t"
      "vmovups %%ymm10, 192(%[a])\n\t"
      "vmovups %%ymm11, 224(%[a])\n\t"
      "vmovups %%ymm12, 256(%[a])\n\t"
      "vmovups %%ymm13, 288(%[a])\n\t"
      "vmovups %%ymm14, 320(%[a])\n\t"
      "vmovups %%ymm15, 352(%[a])\n\t"
      : [x] "+r"(X), [w] "+r"(W), [n] "+r"(count)
      : [a] "r"(acc), [o1] "i"(4 * OutputStep), [o2] "i"(8 * OutputStep), [o3] "i"(12 * OutputStep),
        [o4] "i"(16 * OutputStep), [o5] "i"(20 * OutputStep)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "xmm14", "xmm15", "memory", "cc");
  static_assert(kLaneRows == 16 && kChains == 16, "the assembly's strides");
}
#endif
