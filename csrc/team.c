/* torch's OpenMP team, reached at run time: a run copied by the threads that
 * torch's own parallel copies use (and keep warm between calls), without the
 * Python call of Tensor.copy_ around them.
 *
 *   fp_team_t    the OpenMP runtime's entry points, looked up through a
 *                loaded library's dependencies (torch's libtorch_cpu links
 *                GNU libgomp; Intel's libiomp5 has the same GOMP_ entries)
 *     -> job     one fp_team_copy call: the run, on the caller's stack
 *       -> slice the run's bytes a team member copies: its share of the
 *                whole, cut on cache lines, across entries
 *
 * The caller asks GOMP_parallel for a team and copies the first slice
 * itself, as torch's parallel_for does; it returns when every member is
 * done. A pool of threads belongs to each thread that starts a team (the
 * runtime's rule), so torch's copies and these share one per calling thread.
 * Nothing here is linked against the runtime: a build without OpenMP, or a
 * process whose torch has another parallel backend, finds no team and the
 * caller copies another way.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdint.h>
#include <string.h>
#include "fastpin.h"

#if defined(__SANITIZE_THREAD__)
/* The runtime (not instrumented) orders the members' copies before the
 * caller's return; ThreadSanitizer is told so. */
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
#define FP_TSAN_ACQUIRE(p) __tsan_acquire(p)
#define FP_TSAN_RELEASE(p) __tsan_release(p)
#else
#define FP_TSAN_ACQUIRE(p) ((void)(p))
#define FP_TSAN_RELEASE(p) ((void)(p))
#endif

typedef struct {
    const char *owner; /* file name prefix looked for */
    size_t owner_len;
    char path[4096];   /* the first loaded object's path that has it; "" none */
} fp_team_search_t;

static int fp_team_visit(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    fp_team_search_t *s = arg;
    const char *name = info->dlpi_name, *base = name ? strrchr(name, '/') : NULL;
    base = base ? base + 1 : name;
    if (!base || strncmp(base, s->owner, s->owner_len) || strlen(name) >= sizeof s->path)
        return 0;
    strcpy(s->path, name);
    return 1;
}

int fp_team_find(const char *owner, fp_team_t *team)
{
    memset(team, 0, sizeof *team);
    fp_team_search_t s = {.owner = owner, .owner_len = strlen(owner)};
    if (!s.owner_len || !dl_iterate_phdr(fp_team_visit, &s))
        return FP_EINVAL;
    /* NOLOAD: a handle on what is there, never a second copy; it is kept
     * (the entry points must outlive every call), one reference of a
     * library the process holds anyway. */
    void *lib = dlopen(s.path, RTLD_LAZY | RTLD_NOLOAD);
    if (!lib)
        return FP_EINVAL;
    /* dlsym on a handle searches the object and then its dependencies:
     * the runtime the owner itself calls, whatever else is loaded. */
    *(void **)&team->parallel = dlsym(lib, "GOMP_parallel");
    *(void **)&team->thread_num = dlsym(lib, "omp_get_thread_num");
    *(void **)&team->num_threads = dlsym(lib, "omp_get_num_threads");
    *(void **)&team->max_threads = dlsym(lib, "omp_get_max_threads");
    if (!team->parallel || !team->thread_num || !team->num_threads || !team->max_threads) {
        dlclose(lib);
        memset(team, 0, sizeof *team);
        return FP_EINVAL;
    }
    return 0;
}

typedef struct {
    const fp_team_t *team;
    const fp_copy_t *copies;
    size_t count;
    size_t total; /* bytes of every entry */
} fp_team_job_t;

/* Where member k of n starts: its share of total, on a cache line. */
static size_t fp_team_cut(size_t total, size_t k, size_t n)
{
    if (k >= n)
        return total;
    return (size_t)((unsigned __int128)total * k / n) & ~(size_t)63;
}

/* Copies bytes [lo, hi) of the run (its entries back to back). */
static void fp_team_copy_range(const fp_copy_t *copies, size_t count, size_t lo, size_t hi)
{
    size_t at = 0;
    for (size_t i = 0; i < count && at < hi; at += copies[i++].size) {
        size_t end = at + copies[i].size;
        if (end <= lo)
            continue;
        size_t from = lo > at ? lo - at : 0, to = (hi < end ? hi : end) - at;
        memcpy((char *)copies[i].dst + from, (const char *)copies[i].src + from, to - from);
    }
}

/* A team member's part; the team's size is what the runtime gave (one,
 * inside another parallel region), not what was asked. */
static void fp_team_slice(void *arg)
{
    fp_team_job_t *job = arg;
    FP_TSAN_ACQUIRE(job);
    size_t n = (size_t)job->team->num_threads(), k = (size_t)job->team->thread_num();
    fp_team_copy_range(job->copies, job->count, fp_team_cut(job->total, k, n),
                       fp_team_cut(job->total, k + 1, n));
    FP_TSAN_RELEASE(job);
}

void fp_team_copy(const fp_team_t *team, const fp_copy_t *copies, size_t count, unsigned threads)
{
    fp_team_job_t job = {.team = team, .copies = copies, .count = count};
    for (size_t i = 0; i < count; i++)
        job.total += copies[i].size;
    if (threads < 2 || !team || !team->parallel) {
        fp_team_copy_range(copies, count, 0, job.total);
        return;
    }
    FP_TSAN_RELEASE(&job);
    team->parallel(fp_team_slice, &job, threads, 0);
    FP_TSAN_ACQUIRE(&job);
}
