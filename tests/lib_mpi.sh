# Shared helpers for the tests under mpirun (sourced, as tests/lib_cli.sh is by the CLI tests):
#   bash tests/mpi_X.sh MPIEXEC BINARY [MODE]   (as ctest runs them; BINARY: flatmoe or a test binary)
# Sets MPIEXEC=$1, FM=$2 (absolute), MODE=$3 (empty if none); ROOT, the repository; TEXT, real
# English text (the shared Shakespeare, else Debian's fortunes, else this repo's README); FLAGS,
# mpirun's flags: --oversubscribe (4 ranks on a 2-core CI machine), --allow-run-as-root (CI is
# root), shared memory only (btl self,vader; no network in a container), no single-copy (CMA needs
# ptrace rights containers often lack), pml ob1 (no UCX probing), no binding; and exports Open
# MPI's oversubscription and yield-when-idle settings. Then:
#   mpi_tmp NAME      TMP = a fresh folder /tmp/flatmoe-NAME.XXXXXX, removed at exit
#   bad MSG...        counts a failure in FAILED and prints it to stderr
#   mpi NP ARGS...    flatmoe ($FM) under mpirun at NP ranks, killed after 120 s; the array MPI_ENV
#                     (empty unless the test sets it, e.g. (-x FLATMOE_TEST_FORCE_ROUTE)) goes
#                     before -np
#   compare REF RUN [ARGS...]   tests/mpi_compare.py: losses to 1e-6 relative, gradient norms to
#                     1e-3 (mpi_compare.py says why), final tensors to 5e-4 of each tensor's scale (tests/mpi_train.sh says
#                     why), unless ARGS say otherwise
#   mpi_finish NAME   prints "NAME: passed" or "NAME: N failed"; its status is the test's
MPIEXEC=${1:?usage: $0 MPIEXEC BINARY [MODE]} FM=$(readlink -f "${2:?usage: $0 MPIEXEC BINARY [MODE]}") MODE=${3:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TEXT="$ROOT/../shared/data/tinyshakespeare.txt"
[ -f "$TEXT" ] || TEXT=/usr/share/games/fortunes/fortunes
[ -f "$TEXT" ] || TEXT="$ROOT/README.md"
FLAGS=(--oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader
       --mca btl_vader_single_copy_mechanism none --mca pml ob1)
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1
MPI_ENV=()
FAILED=0

mpi_tmp() { TMP=$(mktemp -d "/tmp/flatmoe-$1.XXXXXX"); trap 'rm -rf "$TMP"' EXIT; }
bad() { FAILED=$((FAILED + 1)); echo "FAIL: $*" >&2; }
mpi() { # np, then flatmoe's arguments
    local np=$1; shift
    timeout 120 "$MPIEXEC" "${FLAGS[@]}" "${MPI_ENV[@]}" -np "$np" "$FM" "$@"
}
compare() { python3 "$ROOT/tests/mpi_compare.py" "$@"; }
mpi_finish() {
    [ $FAILED -eq 0 ] && echo "$1: passed" || echo "$1: $FAILED failed"
    [ $FAILED -eq 0 ]
}
