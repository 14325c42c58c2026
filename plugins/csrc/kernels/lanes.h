// Integer GEMMs with the input rows in the vector lanes (AVX2: the int16-weight kernels at many
// rows, int4_tiled.h, int8.h and w8a8.h). Included per ISA inside kiln::<isa> after gemv.h.
//
// An input is an int16 and so is a weight; one vpmaddwd multiplies 8 rows by a pair of one
// output's weights (broadcast), 16 multiply-adds an instruction with no reduction across lanes:
// each lane holds one (row, output) sum, so a row's sums never depend on which rows share its
// vectors. The inputs go in chunks of kLaneRows rows: X [chunk][pairs][kLaneRows] dwords, each
// dword a row's two int16 inputs of one pair.
//
//   kLaneRows             input rows a pass holds in its lanes (two vectors)
//   kLanesFrom            rows from which the kernels take the lanes
//   lanes_inputs_i16      int16 rows [rows][kp] to X (the pairs in order)
//   lanes_four_outputs    int32 sums of one chunk's 16 rows against 4 outputs over `count` pairs

#if defined(KILN_ISA_AVX2)
constexpr int64_t kLaneRows = 16;
constexpr int64_t kLanesFrom = 16;  // (8 would fill half the lanes)

// X [chunk][kp / 2 pairs][kLaneRows] dwords from int16 rows of kp (even) inputs, pair p of a row
// being its inputs (2p, 2p + 1); the rows past `rows` zero
inline void lanes_inputs_i16(const int16_t* xq, int64_t rows, int64_t kp, int32_t* X) {
  const int64_t pairs = kp / 2, chunks = (rows + kLaneRows - 1) / kLaneRows;
  std::memset(X, 0, sizeof(int32_t) * chunks * pairs * kLaneRows);
  for (int64_t m = 0; m < rows; ++m) {
    int32_t* xm = X + (m / kLaneRows) * pairs * kLaneRows + m % kLaneRows;
    const int16_t* row = xq + m * kp;
    for (int64_t p = 0; p < pairs; ++p) {
      int32_t pair;
      std::memcpy(&pair, row + 2 * p, sizeof pair);
      xm[p * kLaneRows] = pair;
    }
  }
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
#endif
