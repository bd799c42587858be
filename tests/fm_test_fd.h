/* Finite-difference gradient checks for the op tests (CPU: fm_test_ops_cpu.h; CUDA:
 * tests/gpu/gpu_dense_test.h, gpu_moe_test.h), one implementation behind their fd_check wrappers. */
#ifndef FM_TEST_FD_H
#define FM_TEST_FD_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/fm_rng.h"
#include "fm_test.h"

typedef double (*objective_fn)(void *state);

enum { FD_ELEMS = 24, FD_DIRS = 3 };
static const double FD_H = 1e-6;

/* Checks `grad` (the op's gradient of the objective w.r.t. x, n elements) against central
 * differences (f(x+h e) - f(x-h e)) / 2h of the fp64 objective `f`, which reads x (a double
 * copy of the op's input, perturbed here in place and restored). Elementwise on every element
 * when n <= FD_ELEMS, else on FD_ELEMS elements drawn from rng, error normalized by
 * max(max|grad|, floor, 1e-12), at tol; then on FD_DIRS random directions u (normal, from rng)
 * over the whole vector: <grad, u> against the directional difference, normalized by
 * max(sum|grad_i u_i|, floor sum|u_i|), at tol * dir_factor (a direction averages the rounding
 * noise of many elements, so it is held tighter, and it sees an error in any element). `floor`
 * only matters where the exact gradient is ~0; h is the step (FD_H, larger where the objective
 * is huge). */
static inline void fm_fd_check(const char *what, objective_fn f, void *st, double *x, int64_t n, const double *grad,
                               double tol, double floor, double h, double dir_factor, fm_rng *rng) {
    double gmax = floor > 1e-12 ? floor : 1e-12;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(grad[i])) {
            CHECK_MSG(0, "%s: gradient element %lld is %g", what, (long long)i, grad[i]);
            return;
        }
        gmax = fabs(grad[i]) > gmax ? fabs(grad[i]) : gmax;
    }
    double worst = 0, worst_fd = 0;
    int64_t worst_i = -1;
    const int64_t ne = n <= FD_ELEMS ? n : FD_ELEMS;
    for (int64_t s = 0; s < ne; s++) {
        const int64_t i = n <= FD_ELEMS ? s : (int64_t)fm_rng_below(rng, (uint64_t)n);
        const double x0 = x[i];
        x[i] = x0 + h;
        const double fp = f(st);
        x[i] = x0 - h;
        const double fm = f(st);
        x[i] = x0;
        const double fd = (fp - fm) / (2 * h);
        const double e = fabs(fd - grad[i]) / (gmax > fabs(fd) ? gmax : fabs(fd));
        if (e > worst) worst = e, worst_i = i, worst_fd = fd;
    }
    CHECK_MSG(worst <= tol, "%s: element %lld: op %.9g vs finite difference %.9g (nerr %.3g > %.3g)", what,
              (long long)worst_i, worst_i >= 0 ? grad[worst_i] : 0.0, worst_fd, worst, tol);
    double *x0 = dnew(n), *u = dnew(n);
    memcpy(x0, x, (size_t)n * sizeof(double));
    const double dtol = tol * dir_factor;
    for (int d = 0; d < FD_DIRS; d++) {
        double an = 0, mag = 1e-300, umag = 0;
        for (int64_t i = 0; i < n; i++) {
            u[i] = fm_rng_normal(rng);
            an += grad[i] * u[i];
            mag += fabs(grad[i] * u[i]);
            umag += fabs(u[i]);
        }
        mag = mag > floor * umag ? mag : floor * umag;
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] + h * u[i];
        const double fp = f(st);
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] - h * u[i];
        const double fm = f(st);
        memcpy(x, x0, (size_t)n * sizeof(double));
        const double fd = (fp - fm) / (2 * h), e = fabs(fd - an) / mag;
        CHECK_MSG(e <= dtol, "%s: direction %d: <grad,u> %.9g vs finite difference %.9g (nerr %.3g > %.3g)", what, d,
                  an, fd, e, dtol);
    }
    free(x0);
    free(u);
}

#endif
