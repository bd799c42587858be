/* The environment, read here and nowhere below cli/ (DESIGN.md §3): the test hooks'
 * FLATMOE_TEST_* variables into fm_test_hooks. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

fm_status cli_test_hooks_from_env(fm_test_hooks *h) {
    memset(h, 0, sizeof *h);
    const char *force = getenv("FLATMOE_TEST_FORCE_ROUTE"); /* adversarial routing (fm_router.h) */
    if (force && *force) { /* FIRST (every token) or FIRST:PCT (PCT% of the tokens, the rest routed as usual) */
        char *end = NULL;
        const long long first = strtoll(force, &end, 10);
        long pct = 100;
        if (end != force && *end == ':') {
            const char *p = end + 1;
            pct = strtol(p, &end, 10);
            if (end == p) pct = -1;
        }
        if (end == force || *end || first < 0 || pct < 0 || pct > 100)
            return fm_error(FM_ERR_ARG, "FLATMOE_TEST_FORCE_ROUTE='%s': expected FIRST or FIRST:PCT (the first forced "
                            "expert >= 0, the percent of tokens forced in [0,100]), e.g. 0 or 0:90; unset it to route "
                            "normally", force);
        h->force_route = true;
        h->force_first = first;
        h->force_percent = (int)pct;
    }
    return FM_OK;
}
