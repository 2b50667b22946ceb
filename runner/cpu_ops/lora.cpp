// The segmented LoRA delta of a step: for each segment (one resident adapter and the rows
// that run it), y[rows] += (x[rows] @ A[slot]^T) @ Bt[slot], in one call for all segments.
//
// A decode step of 32 rows over 4 adapters is 8 rows per adapter: torch's matmuls run
// such skinny shapes at a fraction of peak, and the gather and index_add around them cost
// as much again. Here each segment's rows are read in place through their row indices, a
// block of rows meets each loaded weight vector (A and B are read once per row block), the
// shrink is accumulated and kept in fp32 (no rounding between the two products), and y is
// rounded to its dtype once. With AVX512-BF16 the bf16 shrink uses its pair dot products.
//
//   y      [T, N]  fp32 or bf16, updated in place (rows of no segment untouched)
//   x      [T, K]  y's dtype (rows may be strided; each row contiguous)
//   a      [S, W, K]  the stacked slots' A, contiguous
//   bt     [S, W, N]  the stacked slots' B transposed (B^T), contiguous: the expand reads
//                     a row of it per rank column, N contiguous outputs
//   rows   [R] int64  rows of y/x, segment after segment
//   starts [G + 1] int64  segment g is rows[starts[g]:starts[g + 1]]
//   slots  [G] int64  each segment's slot
//   width  [S]        the columns of W slot s fills (0: no delta)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace headrace;

constexpr int RB = 4;  // rows per register block (shrink and expand)
constexpr int JB = 4;  // rank columns per shrink block: 4 x 4 accumulators
#if HEADRACE_VEC
constexpr int CV = 4;  // vectors of output columns per expand block
constexpr int VN = Vec::N;
#else
constexpr int CV = 1;
constexpr int VN = 16;
#endif
constexpr int64_t CW = CV * VN;  // output columns per expand work item
// Below this many multiply-adds a call runs on one thread: a fork/join costs more.
constexpr int64_t SERIAL_MACS = 1 << 16;

struct Segment {
  const int64_t* rows;  // into `rows`
  int64_t n;            // rows in the segment
  int64_t pos;          // first row of the segment in the shrink scratch
  int64_t slot;
  int64_t w;
};

// s[r][j] = x[r] . a[j] for NR rows and NJ rank columns (a's rows are K contiguous).
template <typename T, int NR, int NJ>
void shrink_tile(const T* const* x, const T* a, int64_t k_dim, float* s, int64_t ld) {
  int64_t k = 0;
  float out[NR][NJ];
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bf16 x bf16 pairs summed into fp32 lanes (the products are exact in fp32): half the
    // instructions of widening both to fp32, and no conversions.
    __m512 acc[NR][NJ];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
    for (; k + 32 <= k_dim; k += 32) {
      __m512bh av[NJ];
      for (int j = 0; j < NJ; ++j) av[j] = (__m512bh)_mm512_loadu_si512(a + j * k_dim + k);
      for (int r = 0; r < NR; ++r) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[r] + k);
        for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, av[j]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NJ; ++j) out[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  } else
#endif
  {
#if HEADRACE_VEC
  Vec acc[NR][NJ];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) acc[r][j] = Vec::set1(0.0f);
  for (; k + VN <= k_dim; k += VN) {
    Vec av[NJ];
    for (int j = 0; j < NJ; ++j) av[j] = Vec::load(a + j * k_dim + k);
    for (int r = 0; r < NR; ++r) {
      const Vec xv = Vec::load(x[r] + k);
      for (int j = 0; j < NJ; ++j) acc[r][j] = Vec::fmadd(xv, av[j], acc[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) out[r][j] = acc[r][j].sum();
#else
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) out[r][j] = 0.0f;
#endif
  }
  for (; k < k_dim; ++k)
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NJ; ++j) out[r][j] += widen(x[r][k]) * widen(a[j * k_dim + k]);
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) s[r * ld + j] = out[r][j];
}

template <typename T, int NR>
void shrink_rows(const T* const* x, const T* a, int64_t k_dim, int nj, float* s, int64_t ld) {
  switch (nj) {
    case 1: return shrink_tile<T, NR, 1>(x, a, k_dim, s, ld);
    case 2: return shrink_tile<T, NR, 2>(x, a, k_dim, s, ld);
    case 3: return shrink_tile<T, NR, 3>(x, a, k_dim, s, ld);
    default: return shrink_tile<T, NR, 4>(x, a, k_dim, s, ld);
  }
}

// y[r][c : c + NV * VN] += s[r] . bt[:, c : ...] for NR rows: each bt vector loaded once
// meets all NR rows; the accumulators start from y and are rounded to T once.
template <typename T, int NR, int NV>
void expand_tile(T* const* y, const float* s, int64_t ld, const T* bt, int64_t n_dim,
                 int64_t w) {
#if HEADRACE_VEC
  Vec acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::load(y[r] + v * VN);
  for (int64_t j = 0; j < w; ++j) {
    Vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = Vec::load(bt + j * n_dim + v * VN);
    for (int r = 0; r < NR; ++r) {
      const Vec sv = Vec::set1(s[r * ld + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fmadd(sv, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(y[r] + v * VN);
#endif
}

template <typename T, int NR>
void expand_rows(T* const* y, const float* s, int64_t ld, const T* bt, int64_t n_dim,
                 int64_t w, int64_t cols) {
  int64_t c = 0;
#if HEADRACE_VEC
  T* yc[NR];
  for (; c + VN <= cols;) {
    const int nv = static_cast<int>(std::min<int64_t>(CV, (cols - c) / VN));
    for (int r = 0; r < NR; ++r) yc[r] = y[r] + c;
    switch (nv) {
      case 1: expand_tile<T, NR, 1>(yc, s, ld, bt + c, n_dim, w); break;
      case 2: expand_tile<T, NR, 2>(yc, s, ld, bt + c, n_dim, w); break;
      case 3: expand_tile<T, NR, 3>(yc, s, ld, bt + c, n_dim, w); break;
      default: expand_tile<T, NR, 4>(yc, s, ld, bt + c, n_dim, w); break;
    }
    c += nv * VN;
  }
#endif
  for (; c < cols; ++c)
    for (int r = 0; r < NR; ++r) {
      float acc = widen(y[r][c]);
      for (int64_t j = 0; j < w; ++j) acc += s[r * ld + j] * widen(bt[j * n_dim + c]);
      y[r][c] = narrow<T>(acc);
    }
}

template <typename T>
void lora_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const std::vector<Segment>& segs, int64_t total_rows, int64_t w_max) {
  const int64_t k_dim = x.size(1), n_dim = y.size(1), w_stride = a.size(1);
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  std::vector<float> scratch(static_cast<size_t>(total_rows * w_max));
  float* s = scratch.data();
  const int64_t ld = w_max;

  // Work items: (segment, block of JB rank columns) for the shrink, (segment, CW output
  // columns) for the expand; each walks all of its segment's rows in blocks of RB.
  std::vector<std::pair<int, int64_t>> shrink, expand;
  int64_t macs = 0;
  for (int g = 0; g < static_cast<int>(segs.size()); ++g) {
    for (int64_t j = 0; j < segs[g].w; j += JB) shrink.emplace_back(g, j);
    for (int64_t c = 0; c < n_dim; c += CW) expand.emplace_back(g, c);
    macs += segs[g].n * segs[g].w * (k_dim + n_dim);
  }

  auto run_shrink = [&](const std::pair<int, int64_t>& item) {
    const Segment& sg = segs[item.first];
    const int64_t j0 = item.second;
    const int nj = static_cast<int>(std::min<int64_t>(JB, sg.w - j0));
    const T* aj = ap + (sg.slot * w_stride + j0) * k_dim;
    const T* xr[RB];
    for (int64_t r0 = 0; r0 < sg.n; r0 += RB) {
      const int nr = static_cast<int>(std::min<int64_t>(RB, sg.n - r0));
      for (int r = 0; r < nr; ++r) xr[r] = xp + sg.rows[r0 + r] * xs;
      float* out = s + (sg.pos + r0) * ld + j0;
      switch (nr) {
        case 1: shrink_rows<T, 1>(xr, aj, k_dim, nj, out, ld); break;
        case 2: shrink_rows<T, 2>(xr, aj, k_dim, nj, out, ld); break;
        case 3: shrink_rows<T, 3>(xr, aj, k_dim, nj, out, ld); break;
        default: shrink_rows<T, 4>(xr, aj, k_dim, nj, out, ld); break;
      }
    }
  };
  auto run_expand = [&](const std::pair<int, int64_t>& item) {
    const Segment& sg = segs[item.first];
    const int64_t c0 = item.second, cols = std::min<int64_t>(CW, n_dim - c0);
    const T* bc = bp + sg.slot * w_stride * n_dim + c0;
    T* yr[RB];
    for (int64_t r0 = 0; r0 < sg.n; r0 += RB) {
      const int nr = static_cast<int>(std::min<int64_t>(RB, sg.n - r0));
      for (int r = 0; r < nr; ++r) yr[r] = yp + sg.rows[r0 + r] * ys + c0;
      const float* sr = s + (sg.pos + r0) * ld;
      switch (nr) {
        case 1: expand_rows<T, 1>(yr, sr, ld, bc, n_dim, sg.w, cols); break;
        case 2: expand_rows<T, 2>(yr, sr, ld, bc, n_dim, sg.w, cols); break;
        case 3: expand_rows<T, 3>(yr, sr, ld, bc, n_dim, sg.w, cols); break;
        default: expand_rows<T, 4>(yr, sr, ld, bc, n_dim, sg.w, cols); break;
      }
    }
  };

  const int64_t n_shrink = static_cast<int64_t>(shrink.size());
  const int64_t n_expand = static_cast<int64_t>(expand.size());
  const int threads =
      (macs < SERIAL_MACS || at::in_parallel_region()) ? 1 : at::get_num_threads();
  if (threads <= 1) {
    for (const auto& item : shrink) run_shrink(item);
    for (const auto& item : expand) run_expand(item);
    return;
  }
  // One parallel region: the implicit barrier after the first loop is the only sync the
  // expand needs (it reads every rank column of its segment's shrink).
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_shrink; ++i) run_shrink(shrink[i]);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_expand; ++i) run_expand(expand[i]);
  }
}

void lora_delta_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                 const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& slots,
                 at::IntArrayRef width) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2, "lora_delta_: y and x must be 2-D");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3, "lora_delta_: a and bt must be [S, W, *]");
  TORCH_CHECK(x.size(0) == y.size(0), "lora_delta_: x and y have different row counts");
  TORCH_CHECK(a.size(2) == x.size(1), "lora_delta_: a's inner size is not x's");
  TORCH_CHECK(bt.size(2) == y.size(1), "lora_delta_: bt's outer size is not y's");
  TORCH_CHECK(a.size(0) == bt.size(0) && a.size(1) == bt.size(1),
              "lora_delta_: a and bt hold different slots or widths");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  bt.scalar_type() == y.scalar_type(),
              "lora_delta_: y, x, a and bt must share one dtype");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16,
              "lora_delta_: float32 or bfloat16 only");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_delta_: rows must be contiguous");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous(), "lora_delta_: a and bt must be contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && starts.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong && rows.is_contiguous() &&
                  starts.is_contiguous() && slots.is_contiguous(),
              "lora_delta_: rows, starts and slots must be contiguous int64");
  const int64_t num_slots = a.size(0), w_cap = a.size(1), t = y.size(0);
  TORCH_CHECK(static_cast<int64_t>(width.size()) == num_slots,
              "lora_delta_: width must name every slot");
  const int64_t g = slots.numel(), r = rows.numel();
  TORCH_CHECK(starts.numel() == g + 1, "lora_delta_: starts must have one more entry than slots");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = slots.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] == 0 && sp[g] == r, "lora_delta_: starts must run from 0 to rows' length");
  // Segments write their rows of y in parallel: a row in two segments would race.
  std::vector<char> seen(static_cast<size_t>(t), 0);
  for (int64_t i = 0; i < r; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < t, "lora_delta_: row ", rp[i], " is out of range");
    TORCH_CHECK(!seen[rp[i]], "lora_delta_: row ", rp[i], " is in two segments");
    seen[rp[i]] = 1;
  }
  std::vector<Segment> segs;
  int64_t w_max = 0;
  for (int64_t i = 0; i < g; ++i) {
    TORCH_CHECK(sp[i + 1] >= sp[i], "lora_delta_: starts must not decrease");
    TORCH_CHECK(lp[i] >= 0 && lp[i] < num_slots, "lora_delta_: slot ", lp[i], " out of range");
    const int64_t w = width[lp[i]];
    TORCH_CHECK(w >= 0 && w <= w_cap, "lora_delta_: width ", w, " of slot ", lp[i],
                " is outside 0..", w_cap);
    if (w == 0 || sp[i + 1] == sp[i]) continue;
    segs.push_back({rp + sp[i], sp[i + 1] - sp[i], sp[i], lp[i], w});
    w_max = std::max(w_max, w);
  }
  if (segs.empty()) return;
  if (y.scalar_type() == at::kFloat)
    lora_impl<float>(y, x, a, bt, segs, r, w_max);
  else
    lora_impl<c10::BFloat16>(y, x, a, bt, segs, r, w_max);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def(
      "lora_delta_(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor rows, Tensor starts, "
      "Tensor slots, int[] width) -> ()");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) { m.impl("lora_delta_", &lora_delta_); }
