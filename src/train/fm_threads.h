/* The default CPU thread count of a training run (--threads 0): the cores this process may run
 * on (sched_getaffinity) less the ones another process keeps busy now. OpenMP's static schedule
 * gives every thread the same share of each parallel loop, so one thread that shares its core
 * with another busy process makes every loop wait for it (and the others spin meanwhile):
 * measured on a 2-core machine with one core busy, 2 threads trained at half the speed of 1
 * (bench/RESULTS.md). Results are the same for any thread count (the CPU ops split work by
 * output, never a reduction, by thread), so the choice changes speed only. Ranks of one launch
 * that share the machine's cores unbound divide the free cores between them. */
#ifndef FM_THREADS_H
#define FM_THREADS_H

/* What fm_threads_auto saw. */
typedef struct fm_threads_probe {
    int allowed;     /* CPUs in the affinity mask */
    int busy;        /* of those, CPUs more than half busy over the sample (another process's work) */
    int threads;     /* the choice: allowed - busy, at least 1; OMP_NUM_THREADS when it is set */
    int from_env;    /* 1: OMP_NUM_THREADS was set and is used as given */
    int blas_pthreads; /* 1: the BLAS linked is OpenBLAS's pthread build (fm_threads_blas_pthreads):
                          the choice is then 1 thread (below) */
    int local_ranks; /* processes of the launch on this node (OMPI_COMM_WORLD_LOCAL_SIZE,
                        MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE; 1 if none): when the affinity mask
                        is the whole machine (no binding), the choice is divided by them */
} fm_threads_probe;

/* What the environment says about threads: the CLI fills it (src/cli/cli_env.c, cli_threads_env);
 * library code never reads the environment. A zeroed struct with local_ranks 0 or 1 says nothing. */
typedef struct fm_threads_env {
    int omp_num_threads; /* OMP_NUM_THREADS when it reads as a positive integer (atoi), else 0: a
                            count the user gave, used as given */
    int local_ranks;     /* processes of the launch on this node: the first of
                            OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE that
                            reads as a positive integer (atoi), else 1 */
} fm_threads_env;

/* Chooses the thread count as above, sampling /proc/stat over sample_ms milliseconds (0: no
 * sample, busy = 0), with env's OMP_NUM_THREADS and node-local rank count (NULL: neither).
 * Never fails: without /proc/stat or an affinity mask it falls back to the online CPU count.
 * Fills *p when p is not NULL; returns p->threads. */
int fm_threads_auto(int sample_ms, const fm_threads_env *env, fm_threads_probe *p);

/* 1 when the OpenBLAS this process runs is its pthread build (openblas_get_parallel() == 1), whose
 * own thread pool and lock contend with flatmoe's OpenMP threads: measured on 2 cores, tiny.json
 * trained at 5,080 tok/s with 2 threads against 9,775 with 1 and 13,081 with 2 on the OpenMP build
 * (bench/RESULTS.md). Debian's libopenblas-dev selects it; fm_threads_auto then chooses 1 thread,
 * and train says so with the fix. 0 otherwise, and where no OpenBLAS is linked. */
int fm_threads_blas_pthreads(void);

/* Sets the process's OpenMP and OpenBLAS thread counts to threads (>= 1; else nothing), as the CPU
 * backend does at its init: process-wide, so a library session re-applies its own count at each
 * call (another session may have set another since). Never fails. */
void fm_threads_set(int threads);
/* OpenMP's thread count for the next parallel region (omp_get_max_threads; 1 without OpenMP). */
int fm_threads_get(void);

/* The decision: of n CPUs (allowed[c] 0: outside the affinity mask; NULL: all), the ones busy
 * with another process's work, that is more than half of dtotal[c] jiffies busy (dbusy[c]) after
 * this process's own share there (dself[c], NULL: none) is taken off. A process's own threads,
 * such as a pthread BLAS pool spinning when it starts, must not halve its thread count (measured:
 * OpenBLAS's pthread build, the Debian alternative libopenblas-dev selects, made one of 2 idle
 * cores look busy). Never fails. */
int fm_threads_count_busy(int n, const unsigned long long *dbusy, const unsigned long long *dtotal,
                          const unsigned long long *dself, const unsigned char *allowed);

#endif
