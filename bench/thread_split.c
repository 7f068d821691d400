// One decode step's weight products and nothing else: y = W x for each matrix named on the command line, the rows of
// each product shared between the threads by the schedule asked for. bench/thread_split.py compiles and times it.
//
//     thread_split SCHEDULE REPS ROWSxCOLS[*COUNT] ...     SCHEDULE: even (Inductor's `omp for`), dynamic, guided
//
// Prints one line: the median seconds of REPS passes over every matrix. Weights lie in memory advised for 2 MiB
// pages, as the package's `generate` puts them. Each row's dot product is vectorised without reordering beyond
// what `omp simd` allows, as Inductor's loops are.
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef struct { long rows, cols; float *w; } Matrix;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static float row_dot(const float *w, const float *x, long n) {
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (long i = 0; i < n; i++) s += w[i] * x[i];
    return s;
}

static int by_value(const void *a, const void *b) {
    double d = *(const double *)a - *(const double *)b;
    return (d > 0) - (d < 0);
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s even|dynamic|guided REPS ROWSxCOLS[*COUNT] ...\n", argv[0]); return 2; }
    const char *schedule = argv[1];
    int reps = atoi(argv[2]), n = 0;
    int kind = !strcmp(schedule, "even") ? 0 : !strcmp(schedule, "dynamic") ? 1 : !strcmp(schedule, "guided") ? 2 : -1;
    if (kind < 0) { fprintf(stderr, "SCHEDULE must be even, dynamic or guided; got %s\n", schedule); return 2; }
    if (reps < 1) { fprintf(stderr, "REPS must be a positive integer; got %s\n", argv[2]); return 2; }
    Matrix *m = calloc(4096, sizeof(Matrix));
    long widest = 0;
    for (int a = 3; a < argc; a++) {
        long rows, cols, count = 1;
        if (sscanf(argv[a], "%ldx%ld*%ld", &rows, &cols, &count) < 2 || rows < 1 || cols < 1 || count < 1) {
            fprintf(stderr, "each shape must be ROWSxCOLS or ROWSxCOLS*COUNT, positive; got %s\n", argv[a]);
            return 2;
        }
        for (long c = 0; c < count; c++, n++) {
            size_t bytes = (size_t)rows * cols * sizeof(float), huge = 2u << 20;
            bytes = (bytes + huge - 1) / huge * huge;
            m[n] = (Matrix){rows, cols, aligned_alloc(huge, bytes)};
            madvise(m[n].w, bytes, MADV_HUGEPAGE);
            for (long i = 0; i < rows * cols; i++) m[n].w[i] = 1e-3f * (float)(i % 7);  // touched: pages are real
        }
        if (rows > widest) widest = rows;
        if (cols > widest) widest = cols;
    }
    float *x = malloc(widest * sizeof(float)), *y = malloc(widest * sizeof(float));
    for (long i = 0; i < widest; i++) x[i] = 1.0f;
    double *seconds = malloc(reps * sizeof(double));
    for (int r = -2; r < reps; r++) {  // two passes to warm up
        double start = now();
        #pragma omp parallel  // one region for the step, as Inductor writes a graph's kernel
        for (int k = 0; k < n; k++) {
            const Matrix M = m[k];
            if (kind == 0) {
                #pragma omp for
                for (long o = 0; o < M.rows; o++) y[o] = row_dot(M.w + o * M.cols, x, M.cols);
            } else if (kind == 1) {
                #pragma omp for schedule(dynamic, 16)
                for (long o = 0; o < M.rows; o++) y[o] = row_dot(M.w + o * M.cols, x, M.cols);
            } else {
                #pragma omp for schedule(guided, 8)
                for (long o = 0; o < M.rows; o++) y[o] = row_dot(M.w + o * M.cols, x, M.cols);
            }
        }
        if (r >= 0) seconds[r] = now() - start;
    }
    qsort(seconds, reps, sizeof(double), by_value);
    printf("%.9f\n", seconds[reps / 2]);
    return 0;
}
