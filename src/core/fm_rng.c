#include "fm_rng.h"
#include <math.h>

double fm_rng_normal(fm_rng *r) {
    double u1 = fm_rng_uniform_d(r), u2 = fm_rng_uniform_d(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
