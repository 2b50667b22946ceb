// Splitting a kernel's work units over the threads by their work, not their count: each
// thread takes one contiguous run (its units' data stays in its own cache; a shared counter
// moved a cache line between the cores every unit). Used by the prompt and decode attention
// kernels, whose units differ in work by up to a whole context.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace headrace {

// The first unit of each of `runs` contiguous runs holding an even share of the work, and
// the unit count last: run t is [cut[t], cut[t + 1]). `work_before[u]` is the work of the
// units before u (work_before[0] = 0, one entry past the last unit).
inline std::vector<int64_t> even_runs(const std::vector<int64_t>& work_before, int64_t runs) {
  std::vector<int64_t> cut(runs + 1);
  for (int64_t t = 0; t < runs; ++t)
    cut[t] = std::lower_bound(work_before.begin(), work_before.end(),
                              work_before.back() * t / runs) -
             work_before.begin();
  cut[runs] = static_cast<int64_t>(work_before.size()) - 1;
  return cut;
}

// Calls body(first, last) once on each thread, with its run [first, last) of the units
// (`work_before` as above); a thread whose run is empty makes no call.
template <typename Body>
void parallel_even_runs(const std::vector<int64_t>& work_before, const Body& body) {
  const int64_t units = static_cast<int64_t>(work_before.size()) - 1;
  const int64_t runs = std::min<int64_t>(at::get_num_threads(), units);
  if (runs <= 0) return;
  const std::vector<int64_t> cut = even_runs(work_before, runs);
  at::parallel_for(0, runs, 1, [&](int64_t begin, int64_t end) {
    if (cut[begin] < cut[end]) body(cut[begin], cut[end]);
  });
}

}  // namespace headrace
