// One OpenMP team at a time in the process. libgomp gives every thread that starts a parallel
// region a team of its own (the step's thread one, the capture's worker another) and keeps it
// for the thread's life; once the process manages more OpenMP threads than it has cores it
// throttles every team's spinning (GOMP_SPINCOUNT's throttled count), and each parallel region
// then wakes its threads through the kernel: eager steps after captured ones, and the worker's
// kernels, paid for it (bench/omp_slowdown.py). So the step's thread lets its team go as a step
// begins (the worker computes; at most every 100 ms, capture.cpp) and the worker lets its own
// go once no step came within its poll after a step's end (the step's thread computes again):
// each makes its team anew where it next runs a parallel region, with the same number of
// threads as before (a parallel reduction's result depends on it). Measurements: docs/coexec.md,
// *One OpenMP team at a time*.
#pragma once

#include <dlfcn.h>

namespace coexec {

// Let go of the calling thread's OpenMP team, if it has one (OpenMP 5.0's
// omp_pause_resource_all, soft: the threads end, the settings stay); a no-op where the process
// has no OpenMP runtime that offers it. Not inside a parallel region.
inline void release_openmp_team() {
  using Pause = int (*)(int);
  static const Pause pause = reinterpret_cast<Pause>(dlsym(RTLD_DEFAULT, "omp_pause_resource_all"));
  constexpr int kSoft = 1;  // (omp_pause_soft)
  if (pause != nullptr) pause(kSoft);
}

}  // namespace coexec
