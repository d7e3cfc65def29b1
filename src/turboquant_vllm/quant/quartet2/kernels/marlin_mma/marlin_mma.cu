// Few-token W4A16 GEMM straight from Marlin's NVFP4 words: y (M <= 8, N) = alpha * x (M, K) W^T.
//
// Marlin keeps each 16 (k) x 64 (n) tile of E2M1 codes as 128 words; word n_lo * 16 + k21 * 4 + n54 holds, in nibble
// k0 * 4 + n3 * 2 + k3, the code of n = n_lo + 8 n3 + 16 n54, k = k0 + 2 k21 + 8 k3. Lane l = n_lo * 4 + k21 of a warp
// loads words 4 l .. 4 l + 3 (one 16-byte load), and each of them is, once decoded, the A fragment of one
// mma.m16n8k16 (the weight as A: rows n, columns k; x as B, its 8 columns the tokens). Decoding is shifts and masks
// (each nibble's magnitude bits into a 16-bit float's mantissa / exponent, a constant power of two off) and one
// multiply by the group's scale, exact in bf16 and fp16 (at most 6 significant bits); the power of two goes into alpha.
// The tensor cores sum in fp32; warps of a CTA take every fourth k-tile and add up in a fixed order, CTAs split K and
// their sums are added in split order: on sm_90 by split 0 from the others' shared memory (the splits of an n-tile are
// one thread-block cluster, at most 8), else by the last CTA of the n-tile from global partials. Either way the result
// does not depend on timing, and the two give the same bits.
//
// Scales: Marlin's byte per (k-tile, n), the top byte of fp16(scale * factor * 2^7) << 1, at column
// 8 n_lo + (n54 >> 1) * 4 + n3 * 2 + (n54 & 1) of its 64-column block. A zero byte is a group Marlin flushed; its codes
// are zeroed at load (marlin_mma.zero_flushed_codes). marlin_mma.py holds the plain PyTorch emulation of all of this.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <cooperative_groups.h>

namespace {

constexpr int WARPS = 4;   // a CTA: four warps on one n-tile
constexpr int CHUNK = 4;   // k-tiles a warp loads at once (two chunks in flight)
constexpr int MIN_CTAS = 4;  // CTAs an SM (128 registers a thread): more warps to hide the loads' latency
constexpr int TOKENS = 8;  // the mma's n: tokens a call takes at most
constexpr int MAX_CLUSTER = 8;  // CTAs a portable thread-block cluster holds: the most splits the cluster sum takes

// One Marlin word -> the mma's A fragment, by shifts alone: register r takes nibbles (j, j + 4) (j = 0, 2, 1, 3 for
// r = 0..3, the lower k in the low half), each nibble's 3 magnitude bits (e1 e0 m) placed at the top of the 16-bit
// float's mantissa and the bottom of its exponent, its sign at bit 15. That float is the E2M1 value times 2^-126
// (bf16; 0.5 lands on a subnormal) or 2^-14 (fp16): a constant the scale and alpha take back.
template <bool BF16, int J>
__device__ __forceinline__ uint32_t decode_pair(uint32_t w) {
  constexpr int MAG = (BF16 ? 6 : 9) - 4 * J;  // nibble j's bits 4 j .. 4 j + 2 -> mantissa top (bit 6 / bit 9)
  constexpr uint32_t MAG_MASK = BF16 ? 0x01C001C0u : 0x0E000E00u;
  const uint32_t mag = (MAG >= 0 ? w << MAG : w >> -MAG) & MAG_MASK;
  return mag | ((w << (12 - 4 * J)) & 0x80008000u);
}

template <bool BF16>
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t a[4]) {
  a[0] = decode_pair<BF16, 0>(w);
  a[1] = decode_pair<BF16, 2>(w);
  a[2] = decode_pair<BF16, 1>(w);
  a[3] = decode_pair<BF16, 3>(w);
}

// A scale byte (in byte 0 of p, byte 2 a copy) -> the 16-bit float pair the decoded codes are multiplied by:
// fp16: fp16(byte << 7) = scale * factor * 2^7 as Marlin stores it; bf16: scale * factor * 2^118 (exponent
// E5 - 22 + 118 + 127 = E5 + 223 <= 253). A zero byte (a group Marlin flushed) has zero codes (prepare zeroes them),
// so its scale's value does not matter.
template <bool BF16>
__device__ __forceinline__ uint32_t scale_dup(uint32_t p) {
  if (BF16) return (p << 4) + 0x6F806F80u;
  return p << 7;
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

struct Chunk {
  int4 w[CHUNK];           // the lane's 4 words of each k-tile
  uint2 s[CHUNK];          // its 8 scale bytes
  uint32_t b[CHUNK][2];    // x: the B fragment (token g, k 2 t, 2 t + 1 and + 8)
};

__device__ __forceinline__ void load_chunk(Chunk& ck, const int4* cbase, size_t crow, const uint8_t* sbase,
                                           int padded_n, const uint32_t* xrow, bool has_row, int t, int first,
                                           int count, int chunk) {
#pragma unroll
  for (int i = 0; i < CHUNK; ++i) {
    const int j = chunk * CHUNK + i;
    const bool ok = j < count;
    const int k = first + WARPS * j;
    ck.w[i] = ok ? __ldg(cbase + k * crow) : make_int4(0, 0, 0, 0);
    ck.s[i] = ok ? __ldg(reinterpret_cast<const uint2*>(sbase + (size_t)k * padded_n)) : make_uint2(0u, 0u);
    ck.b[i][0] = ok && has_row ? __ldg(xrow + k * 8 + t) : 0u;
    ck.b[i][1] = ok && has_row ? __ldg(xrow + k * 8 + 4 + t) : 0u;
  }
}

template <bool BF16>
__device__ __forceinline__ void compute_chunk(const Chunk& ck, float c[4][4]) {
#pragma unroll
  for (int i = 0; i < CHUNK; ++i) {
    const uint32_t words[4] = {(uint32_t)ck.w[i].x, (uint32_t)ck.w[i].y, (uint32_t)ck.w[i].z, (uint32_t)ck.w[i].w};
    const uint32_t u = ck.s[i].x, v = ck.s[i].y;
    // scale byte of (n54, n3) at 8 g + (n54 >> 1) * 4 + n3 * 2 + (n54 & 1): (u, v) bytes by n54 = 0..3
    const uint32_t row0[4] = {__byte_perm(u, 0u, 0x4040u), __byte_perm(u, 0u, 0x4141u), __byte_perm(v, 0u, 0x4040u),
                              __byte_perm(v, 0u, 0x4141u)};
    const uint32_t row8[4] = {__byte_perm(u, 0u, 0x4242u), __byte_perm(u, 0u, 0x4343u), __byte_perm(v, 0u, 0x4242u),
                              __byte_perm(v, 0u, 0x4343u)};
#pragma unroll
    for (int n54 = 0; n54 < 4; ++n54) {
      const uint32_t s0 = scale_dup<BF16>(row0[n54]), s1 = scale_dup<BF16>(row8[n54]);
      uint32_t a[4];
      decode_word<BF16>(words[n54], a);
      a[0] = mul2<BF16>(a[0], s0);
      a[2] = mul2<BF16>(a[2], s0);
      a[1] = mul2<BF16>(a[1], s1);
      a[3] = mul2<BF16>(a[3], s1);
      mma<BF16>(c[n54], a, ck.b[i][0], ck.b[i][1]);
    }
  }
}

// A CTA's outputs: its warps' sums (one thread an output (n, token) of the M tokens, e = token * 64 + n), the K
// splits' added in split order.
using WarpSums = float[WARPS][TOKENS][64];

__device__ __forceinline__ float cta_sum(const WarpSums& sums, int tok, int n) {
  return ((sums[0][tok][n] + sums[1][tok][n]) + sums[2][tok][n]) + sums[3][tok][n];
}

// The splits of an n-tile are one cluster: split 0 reads the others' sums from their shared memory.
template <bool BF16>
__device__ __forceinline__ void cluster_sum(const WarpSums& sums, uint16_t* out, int M, int N, int ntile, int split,
                                            int splits, float alpha) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  __shared__ float total[TOKENS * 64];
  const cg::cluster_group cluster = cg::this_cluster();
  for (int e = threadIdx.x; e < M * 64; e += WARPS * 32) total[e] = cta_sum(sums, e >> 6, e & 63);
  cluster.sync();
  if (split == 0) {
    for (int e = threadIdx.x; e < M * 64; e += WARPS * 32) {
      const int gn = ntile * 64 + (e & 63);
      float sum = 0.f;
      for (int sp = 0; sp < splits; ++sp) sum += cluster.map_shared_rank(total, sp)[e];
      if (gn < N) out[(size_t)(e >> 6) * N + gn] = to_half_bits<BF16>(alpha * sum);
    }
  }
  cluster.sync();  // every CTA's shared memory stays until split 0 has read it
#endif
}

// Through global memory: each split's sums to partial, the n-tile's last CTA (its counter) adds them.
template <bool BF16>
__device__ __forceinline__ void global_sum(const WarpSums& sums, float* partial, int* counters, uint16_t* out, int M,
                                           int N, int padded_n, int ntile, int split, int splits, float alpha) {
  __shared__ int last;
  for (int e = threadIdx.x; e < M * 64; e += WARPS * 32) {
    const int n = e & 63, tok = e >> 6, gn = ntile * 64 + n;
    const float sum = cta_sum(sums, tok, n);
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
  for (int e = threadIdx.x; e < M * 64; e += WARPS * 32) {
    const int n = e & 63, tok = e >> 6, gn = ntile * 64 + n;
    if (gn >= N) continue;
    const float* p = partial + (size_t)tok * padded_n + gn;
    const size_t stride = (size_t)TOKENS * padded_n;
    float sum = 0.f;
    int sp = 0;
    for (; sp + 4 <= splits; sp += 4) {  // four loads in flight, added in split order
      const float p0 = __ldcg(p + sp * stride), p1 = __ldcg(p + (sp + 1) * stride);
      const float p2 = __ldcg(p + (sp + 2) * stride), p3 = __ldcg(p + (sp + 3) * stride);
      sum += p0;
      sum += p1;
      sum += p2;
      sum += p3;
    }
    for (; sp < splits; ++sp) sum += __ldcg(p + sp * stride);
    out[(size_t)tok * N + gn] = to_half_bits<BF16>(alpha * sum);
  }
  if (threadIdx.x == 0) counters[ntile] = 0;  // ready for the next call (CUDA-graph replays included)
}

template <bool BF16, bool CLUSTER>
__global__ void __launch_bounds__(WARPS * 32, MIN_CTAS) marlin_mma_kernel(
    const uint32_t* __restrict__ x, const int4* __restrict__ codes, const uint8_t* __restrict__ scales,
    float* __restrict__ partial, int* __restrict__ counters, uint16_t* __restrict__ out, int M, int N, int K,
    int padded_n, int tiles_per_split, float alpha) {
  __shared__ float sums[WARPS][TOKENS][64];  // n fastest: the reads below are conflict-free
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

  // this warp's k-tiles kt0 + warp + WARPS i, CHUNK at a time, the next chunk's loads issued before this one's math
  const int count = kt1 - kt0 - warp > 0 ? (kt1 - kt0 - warp + WARPS - 1) / WARPS : 0;
  const int chunks = (count + CHUNK - 1) / CHUNK;
  Chunk bufs[2];
  load_chunk(bufs[0], cbase, crow, sbase, padded_n, xrow, has_row, t, kt0 + warp, count, 0);
  for (int ch = 0; ch < chunks; ch += 2) {
    load_chunk(bufs[1], cbase, crow, sbase, padded_n, xrow, has_row, t, kt0 + warp, count, ch + 1);
    compute_chunk<BF16>(bufs[0], c);
    if (ch + 1 >= chunks) break;
    load_chunk(bufs[0], cbase, crow, sbase, padded_n, xrow, has_row, t, kt0 + warp, count, ch + 2);
    compute_chunk<BF16>(bufs[1], c);
  }

  // C fragment: c[n54][0 / 1] = (n = 16 n54 + g, token 2 t / 2 t + 1), c[n54][2 / 3] the same at n + 8.
#pragma unroll
  for (int n54 = 0; n54 < 4; ++n54) {
    sums[warp][2 * t][16 * n54 + g] = c[n54][0];
    sums[warp][2 * t + 1][16 * n54 + g] = c[n54][1];
    sums[warp][2 * t][16 * n54 + g + 8] = c[n54][2];
    sums[warp][2 * t + 1][16 * n54 + g + 8] = c[n54][3];
  }
  __syncthreads();
  if constexpr (CLUSTER) cluster_sum<BF16>(sums, out, M, N, ntile, split, gridDim.y, alpha);
  else global_sum<BF16>(sums, partial, counters, out, M, N, padded_n, ntile, split, gridDim.y, alpha);
}

template <bool BF16>
cudaError_t launch(bool cluster, int splits, dim3 grid, cudaStream_t stream, const void* x, const void* codes,
                   const void* scales, void* partial, void* counters, void* out, int M, int N, int K, int padded_n,
                   int tiles_per_split, float alpha) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(WARPS * 32);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = 1;
  attribute.val.clusterDim.y = splits;  // an n-tile's splits
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = cluster ? 1 : 0;
  auto kernel = cluster ? marlin_mma_kernel<BF16, true> : marlin_mma_kernel<BF16, false>;
  return cudaLaunchKernelEx(&config, kernel, static_cast<const uint32_t*>(x), static_cast<const int4*>(codes),
                            static_cast<const uint8_t*>(scales), static_cast<float*>(partial),
                            static_cast<int*>(counters), static_cast<uint16_t*>(out), M, N, K, padded_n,
                            tiles_per_split, alpha);
}

}  // namespace

// x (M, K) and out (M, N) row-major 16-bit floats (bf16 if bf16 != 0, else fp16); codes / scales as Marlin keeps
// them; cluster: add the splits in a thread-block cluster (sm_90, splits <= MAX_CLUSTER), else through partial
// (splits * 8 * padded_n fp32) and counters (padded_n / 64 int32, zero). Returns a cudaError_t.
extern "C" int tq_marlin_mma(const void* x, const void* codes, const void* scales, void* partial, void* counters,
                             void* out, int M, int N, int K, int padded_n, int splits, int tiles_per_split,
                             float alpha, int bf16, int cluster, void* stream) {
  if (M < 1 || M > TOKENS || K % 16 != 0 || padded_n % 64 != 0 || N > padded_n || splits < 1 ||
      (cluster && splits > MAX_CLUSTER))
    return (int)cudaErrorInvalidValue;
  const dim3 grid(padded_n / 64, splits);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return (int)(bf16 ? launch<true>(cluster != 0, splits, grid, s, x, codes, scales, partial, counters, out, M, N, K,
                                   padded_n, tiles_per_split, alpha)
                    : launch<false>(cluster != 0, splits, grid, s, x, codes, scales, partial, counters, out, M, N, K,
                                    padded_n, tiles_per_split, alpha));
}
