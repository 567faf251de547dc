// The host AdamW kernel's memory traffic with trivial arithmetic: what the machine's
// memory allows for the same access pattern. Per element it reads a bf16 gradient and
// three f32 state values, writes the three back and a bf16 copy: 28 bytes, as the
// kernel moves with a donated out. experiments/bench_host.py compiles and runs it.
//
// usage: traffic_probe ELEMENTS REPS   (threads from OMP_NUM_THREADS)
// prints one line per rep: seconds

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s ELEMENTS REPS\n", argv[0]);
    return 2;
  }
  const long n = atol(argv[1]);
  const int reps = atoi(argv[2]);
  float* master = aligned_alloc(64, n * 4);
  float* mu = aligned_alloc(64, n * 4);
  float* nu = aligned_alloc(64, n * 4);
  uint16_t* grad = aligned_alloc(64, n * 2);
  uint16_t* out = aligned_alloc(64, n * 2);
  if (!master || !mu || !nu || !grad || !out) return 1;
  // First touch from the loop's threads, as the state is in a real run.
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; ++i) {
    master[i] = mu[i] = nu[i] = 0.0f;
    grad[i] = out[i] = 0;
  }
  for (int r = 0; r < reps; ++r) {
    const double start = now();
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; ++i) {
      const float g = (float)grad[i];
      const float p = master[i] * 0.999f + g;
      mu[i] = mu[i] * 0.9f + g;
      nu[i] = nu[i] * 0.99f + g;
      master[i] = p;
      out[i] = (uint16_t)p;
    }
    printf("%.6f\n", now() - start);
  }
  return 0;
}
