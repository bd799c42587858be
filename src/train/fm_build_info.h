/* What this binary was built from: flatmoe's version and the source tree's commit, embedded at
 * build time by CMake (cmake/fm_version.cmake: `git describe --always --dirty`, "unknown"
 * outside a git checkout). */
#ifndef FM_BUILD_INFO_H
#define FM_BUILD_INFO_H

const char *fm_build_version(void); /* "0.1.0" */
const char *fm_build_commit(void);  /* e.g. "e6e82e6-dirty", or "unknown" */
const char *fm_build_backend(void); /* "cpu" (fp32) or "cuda" (bf16): this build's engine */

#endif
