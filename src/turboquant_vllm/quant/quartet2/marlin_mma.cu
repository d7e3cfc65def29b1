// Few-token W4A16 GEMM straight from Marlin's NVFP4 words: y (M <= 8, N) = alpha * x (M, K) W^T.
//
// Marlin keeps each 16 (k) x 64 (n) tile of E2M1 codes as 128 words; word n_lo * 16 + k21 * 4 + n54 holds, in nibble
// k0 * 4 + n3 * 2 + k3, the code of n = n_lo + 8 n3 + 16 n54, k = k0 + 2 k21 + 8 k3. Lane l = n_lo * 4 + k21 of a warp
// loads words 4 l .. 4 l + 3 (one 16-byte load), and each of them is, once decoded, the A fragment of one
// mma.m16n8k16 (the weight as A: rows n, columns k; x as B, its 8 columns the tokens). Decoding is byte permutes
// (the 16-bit float's high and low byte of each E2M1 magnitude, looked up by the nibble) and the sign bit, then a
// multiply by the group's scale: code * scale is exact in bf16 and fp16 (at most 6 significant bits). The tensor
// cores sum in fp32; warps of a CTA take every fourth k-tile and add up in a fixed order, CTAs split K and the last
// one of an n-tile adds the splits' partials in split order: the result does not depend on timing.
//
// Scales: Marlin's byte per (k-tile, n), the top byte of fp16(scale * factor * 2^7) << 1, at column
// 8 n_lo + (n54 >> 1) * 4 + n3 * 2 + (n54 & 1) of its 64-column block; the value is fp16(byte << 7) * 2^-7, zero for a
// zero byte (groups Marlin flushed). marlin_mma.py holds the plain PyTorch emulation of all of this.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 4;   // a CTA: four warps on one n-tile
constexpr int CHUNK = 8;   // k-tiles a warp loads before it decodes them
constexpr int TOKENS = 8;  // the mma's n: tokens a call takes at most

// E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7): their 16-bit float's high and low byte, 8 bytes a table.
template <bool BF16> struct E2M1Bytes;
template <> struct E2M1Bytes<true> {
  static constexpr uint32_t hi0 = 0x3F3F3F00u, hi1 = 0x40404040u, lo0 = 0xC0800000u, lo1 = 0xC0804000u;
};
template <> struct E2M1Bytes<false> {
  static constexpr uint32_t hi0 = 0x3E3C3800u, hi1 = 0x46444240u, lo0 = 0u, lo1 = 0u;
};

// One Marlin word -> the mma's A fragment: a[0] <- nibbles (0, 4), a[1] <- (2, 6), a[2] <- (1, 5), a[3] <- (3, 7),
// the lower k (nibble j) in the low half.
template <bool BF16>
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t a[4]) {
  using T = E2M1Bytes<BF16>;
  const uint32_t m = w & 0x77777777u;                 // magnitudes: PRMT's index, its mode bit clear
  const uint32_t sa = __byte_perm(m, 0u, 0x0020u);    // nibbles 0, 1, 4, 5
  const uint32_t sb = __byte_perm(m, 0u, 0x0031u);    // nibbles 2, 3, 6, 7
  const uint32_t ha = __byte_perm(T::hi0, T::hi1, sa), la = __byte_perm(T::lo0, T::lo1, sa);
  const uint32_t hb = __byte_perm(T::hi0, T::hi1, sb), lb = __byte_perm(T::lo0, T::lo1, sb);
  a[0] = __byte_perm(la, ha, 0x6240u) | ((w << 12) & 0x80008000u);
  a[2] = __byte_perm(la, ha, 0x7351u) | ((w << 8) & 0x80008000u);
  a[1] = __byte_perm(lb, hb, 0x6240u) | ((w << 4) & 0x80008000u);
  a[3] = __byte_perm(lb, hb, 0x7351u) | (w & 0x80008000u);
}

// Two scale bytes in 16-bit lanes -> their 16-bit float values (a zero byte stays zero).
template <bool BF16>
__device__ __forceinline__ uint32_t scale_pair(uint32_t p) {
  const uint32_t nonzero = ((p + 0x00FF00FFu) >> 8) & 0x00010001u;
  if (BF16) return (p << 4) + nonzero * 0x3480u;      // bf16 exponent E5 - 15 - 7 + 127 = E5 + 105
  return (p << 7) - nonzero * 0x1C00u;                 // fp16 exponent E5 - 7 (scale bytes >= 0x40)
}

template <bool BF16>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {  // exact here: fma with -0 as the addend
  uint32_t d;
  if (BF16) asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  else asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

template <bool BF16>
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if (BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <bool BF16>
__device__ __forceinline__ uint16_t to_half_bits(float v) {
  if (BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return __half_as_ushort(__float2half_rn(v));
}

template <bool BF16>
__global__ void __launch_bounds__(WARPS * 32) marlin_mma_kernel(
    const uint32_t* __restrict__ x, const int4* __restrict__ codes, const uint8_t* __restrict__ scales,
    float* __restrict__ partial, int* __restrict__ counters, uint16_t* __restrict__ out, int M, int N, int K,
    int padded_n, int tiles_per_split, float alpha) {
  __shared__ float sums[WARPS][64][TOKENS];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int ntile = blockIdx.x, split = blockIdx.y;
  const int kt0 = split * tiles_per_split, kt1 = min(kt0 + tiles_per_split, K / 16);
  const bool has_row = g < M;                          // B's column g is token g
  const uint32_t* xrow = x + (size_t)(has_row ? g : 0) * (K / 2);
  const int4* cbase = codes + (size_t)ntile * 32 + lane;
  const size_t crow = (size_t)padded_n / 2;            // int4s a k-tile row: 2 padded_n words
  const uint8_t* sbase = scales + ntile * 64 + 8 * g;

  float c[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;

  for (int kt = kt0 + warp; kt < kt1; kt += WARPS * CHUNK) {
    int4 w[CHUNK];
    uint2 s[CHUNK];
    uint32_t b[CHUNK][2];
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
      const int k = kt + WARPS * i;
      const bool ok = k < kt1;
      w[i] = ok ? __ldg(cbase + k * crow) : make_int4(0, 0, 0, 0);
      s[i] = ok ? __ldg(reinterpret_cast<const uint2*>(sbase + (size_t)k * padded_n)) : make_uint2(0u, 0u);
      b[i][0] = ok && has_row ? __ldg(xrow + k * 8 + t) : 0u;
      b[i][1] = ok && has_row ? __ldg(xrow + k * 8 + 4 + t) : 0u;
    }
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
      const uint32_t words[4] = {(uint32_t)w[i].x, (uint32_t)w[i].y, (uint32_t)w[i].z, (uint32_t)w[i].w};
      const uint32_t pairs[4] = {s[i].x & 0x00FF00FFu, (s[i].x >> 8) & 0x00FF00FFu, s[i].y & 0x00FF00FFu,
                                 (s[i].y >> 8) & 0x00FF00FFu};  // (row n_lo, row n_lo + 8) of n54 = 0..3
#pragma unroll
      for (int n54 = 0; n54 < 4; ++n54) {
        const uint32_t r = scale_pair<BF16>(pairs[n54]);
        const uint32_t s0 = __byte_perm(r, 0u, 0x1010u), s1 = __byte_perm(r, 0u, 0x3232u);
        uint32_t a[4];
        decode_word<BF16>(words[n54], a);
        a[0] = mul2<BF16>(a[0], s0);
        a[2] = mul2<BF16>(a[2], s0);
        a[1] = mul2<BF16>(a[1], s1);
        a[3] = mul2<BF16>(a[3], s1);
        mma<BF16>(c[n54], a, b[i][0], b[i][1]);
      }
    }
  }

  // C fragment: c[n54][0 / 1] = (n = 16 n54 + g, token 2 t / 2 t + 1), c[n54][2 / 3] the same at n + 8.
#pragma unroll
  for (int n54 = 0; n54 < 4; ++n54) {
    sums[warp][16 * n54 + g][2 * t] = c[n54][0];
    sums[warp][16 * n54 + g][2 * t + 1] = c[n54][1];
    sums[warp][16 * n54 + g + 8][2 * t] = c[n54][2];
    sums[warp][16 * n54 + g + 8][2 * t + 1] = c[n54][3];
  }
  __syncthreads();
  const int splits = gridDim.y;
  for (int e = threadIdx.x; e < 64 * TOKENS; e += WARPS * 32) {
    const int n = e / TOKENS, tok = e % TOKENS, gn = ntile * 64 + n;
    if (tok >= M) continue;
    const float sum = ((sums[0][n][tok] + sums[1][n][tok]) + sums[2][n][tok]) + sums[3][n][tok];
    if (splits == 1) {
      if (gn < N) out[(size_t)tok * N + gn] = to_half_bits<BF16>(alpha * sum);
    } else {
      partial[((size_t)split * TOKENS + tok) * padded_n + gn] = sum;
    }
  }
  if (splits == 1) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counters + ntile, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int e = threadIdx.x; e < 64 * TOKENS; e += WARPS * 32) {
    const int n = e / TOKENS, tok = e % TOKENS, gn = ntile * 64 + n;
    if (tok >= M || gn >= N) continue;
    float sum = 0.f;
    for (int sp = 0; sp < splits; ++sp) sum += __ldcg(partial + ((size_t)sp * TOKENS + tok) * padded_n + gn);
    out[(size_t)tok * N + gn] = to_half_bits<BF16>(alpha * sum);
  }
  if (threadIdx.x == 0) counters[ntile] = 0;  // ready for the next call (CUDA-graph replays included)
}

}  // namespace

// x (M, K) and out (M, N) row-major 16-bit floats (bf16 if bf16 != 0, else fp16); codes / scales as Marlin keeps
// them; partial: splits * 8 * padded_n fp32; counters: padded_n / 64 int32, zero. Returns a cudaError_t.
extern "C" int tq_marlin_mma(const void* x, const void* codes, const void* scales, void* partial, void* counters,
                             void* out, int M, int N, int K, int padded_n, int splits, int tiles_per_split,
                             float alpha, int bf16, void* stream) {
  if (M < 1 || M > TOKENS || K % 16 != 0 || padded_n % 64 != 0 || N > padded_n || splits < 1)
    return (int)cudaErrorInvalidValue;
  const dim3 grid(padded_n / 64, splits), block(WARPS * 32);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (bf16)
    marlin_mma_kernel<true><<<grid, block, 0, s>>>(
        static_cast<const uint32_t*>(x), static_cast<const int4*>(codes), static_cast<const uint8_t*>(scales),
        static_cast<float*>(partial), static_cast<int*>(counters), static_cast<uint16_t*>(out), M, N, K, padded_n,
        tiles_per_split, alpha);
  else
    marlin_mma_kernel<false><<<grid, block, 0, s>>>(
        static_cast<const uint32_t*>(x), static_cast<const int4*>(codes), static_cast<const uint8_t*>(scales),
        static_cast<float*>(partial), static_cast<int*>(counters), static_cast<uint16_t*>(out), M, N, K, padded_n,
        tiles_per_split, alpha);
  return (int)cudaGetLastError();
}
