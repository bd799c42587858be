/* fm_build_info.h: the generated fm_version.h (cmake/fm_version.cmake) is included here only,
 * so a new commit recompiles this file alone. */
#include "fm_build_info.h"

#include "fm_version.h"

const char *fm_build_version(void) { return FM_VERSION; }
const char *fm_build_commit(void) { return FM_GIT_COMMIT; }
const char *fm_build_backend(void) {
#ifdef FM_ACT_BF16
    return "cuda";
#else
    return "cpu";
#endif
}
