/* Each thread of a team of the C kernels on a CPU of its own.
 *
 * libgomp's workers spin a few milliseconds after a parallel region, then sleep. The scheduler wakes
 * a sleeping worker on a CPU it picks, on a 2-CPU VM often the CPU of the thread that woke it, which
 * then spins at the region's first barrier: the worker runs only at the scheduler's next tick. Every
 * first region after a pause of 5 ms or more then waited 4-8 ms for its worker (benchmarks/RESULTS.md,
 * "a woken worker waits for the scheduler's tick"). A worker pinned to a CPU that the calling thread
 * stays off while it computes starts at once when woken (0.2 ms).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>

#include "cpu_common.h"

/* Pins worker t (0 < t < count) of the calling thread's team of ``count`` threads to CPU cpus[t]. The
 * calling thread itself (thread 0) is not pinned here: the caller keeps it on cpus[0] while it runs
 * the kernels. libgomp keeps a calling thread's workers from region to region, so this holds for its
 * later teams of up to ``count`` threads. Returns the number of workers that could not be pinned. */
int ricllm_pin_team(const int32_t *cpus, int count) {
    int failed = 0;
#pragma omp parallel num_threads(count) reduction(+ : failed)
    {
        const int thread = team_thread();
        if (thread > 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[thread], &set);
            failed += pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0;
        }
    }
    return failed;
}
