// STREAM's copy (a = b) and triad (a = b + s * c) over f32 arrays, OpenMP: the memory
// bandwidth baseline of experiments/bench_adamw8.py, which compiles and runs it.
//
// usage: stream_probe ELEMENTS REPS   (threads from OMP_NUM_THREADS)
// prints one line per rep: copy_seconds triad_seconds

#include <stdio.h>
#include <stdlib.h>
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
  float* a = aligned_alloc(64, n * 4);
  float* b = aligned_alloc(64, n * 4);
  float* c = aligned_alloc(64, n * 4);
  if (!a || !b || !c) return 1;
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; ++i) {
    a[i] = 0.0f;
    b[i] = 1.0f;
    c[i] = 2.0f;
  }
  for (int r = 0; r < reps; ++r) {
    double t0 = now();
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; ++i) a[i] = b[i];
    double t1 = now();
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; ++i) a[i] = b[i] + 3.0f * c[i];
    double t2 = now();
    printf("%.6f %.6f\n", t1 - t0, t2 - t1);
  }
  volatile float sink = a[n / 2];
  (void)sink;
  return 0;
}
