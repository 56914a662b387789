/* The copy engine: a pool of pthreads that share large memcpy work with the
 * thread that asks for it.
 *
 *   fp_copier_t   the pool: workers, one mutex, one queue of runs
 *     -> run      one fp_copier_run call: the caller's entries and a cursor
 *                 over them; lives on the caller's stack
 *       -> chunk  up to run->chunk bytes taken at the cursor; it may end
 *                 inside an entry or span many small ones
 *
 * The caller queues its run, takes chunks of it alongside the pool, and then
 * waits only for the chunks pool threads still hold. Runs are served oldest
 * first; a caller only ever copies its own run, so its latency never depends
 * on someone else's.
 *
 * Idle workers sleep on a condition variable, so a run pays a futex wake per
 * thread it wakes. With fp_copier_set_spin(ns > 0) a worker that copied a
 * chunk stays ready for up to ns afterwards, polling `gen` (bumped under the
 * lock with every run queued, and by stop) without the lock, and takes the
 * next run without being woken; the caller wakes only the sleepers its run
 * needs beyond the spinners. A spinner always takes the lock and looks at the
 * queue before it sleeps, so a run queued while it spun is never missed.
 * No more workers spin at once than the cores left beside the caller's
 * (max_spin): a spinner past that would take a core from a thread with work.
 *
 * The cut-overs (which runs the caller copies alone, which it shares with
 * spinners only, the chunk sizes, where streaming stores start) are read
 * once per run from fp_copier_tuning_t fields that fp_copier_set_tuning may
 * change at any time; each field is valid alone, so a run that sees some
 * old and some new values still copies every byte once.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "fastpin.h"
#include "streaming.h"

/* FP_COPIER_CHUNK, the largest chunk's default (fastpin.h): ~0.2-0.5 ms of
 * one core's memcpy, long enough that taking the lock per chunk costs
 * nothing, short enough to balance the tail. FP_COPIER_CHUNK_MIN, the
 * smallest a run is cut into when it is too small to give every thread a few
 * of the largest: below it a wakeup costs more than it saves. */
/* Chunks per thread we aim for, so threads that wake late still find work. */
#define FP_COPIER_CHUNKS_PER_THREAD 4
/* Cuts inside an entry end on this boundary of the destination, so two
 * threads never write the same cache line. */
#define FP_COPIER_CUT_ALIGN 64
/* A spinner reads the clock once per this many polls of `gen`. */
#define FP_COPIER_SPIN_POLLS 64

typedef struct fp_run_s {
    const fp_copy_t *copies; /* the caller's entries; read-only while queued */
    size_t count;            /* entries in copies; read-only */
    size_t chunk;            /* bytes one claim aims for; read-only */
    size_t next;             /* entry the next claim starts in (== count:
                                all claimed); copier->lock */
    size_t offset;           /* bytes of copies[next] already claimed;
                                copier->lock */
    int inflight;            /* chunks pool threads hold and have not
                                finished; copier->lock */
    struct fp_run_s *prev;   /* older neighbour while queued; copier->lock */
    struct fp_run_s *after;  /* newer neighbour while queued; copier->lock */
    int queued;              /* 1 while in the queue; copier->lock */
    int stream;              /* streaming stores (fp_copy_bytes); read-only */
    pthread_cond_t done;     /* signalled by the pool thread that finishes
                                the last chunk; waited on by the caller */
} fp_run_t;

typedef struct fp_chunk_s {
    size_t entry;  /* first entry the chunk touches */
    size_t offset; /* where in that entry it starts */
    size_t bytes;  /* total bytes, across as many entries as it spans */
} fp_chunk_t;

struct fp_copier_s {
    pthread_mutex_t lock;  /* guards every field marked copier->lock */
    pthread_cond_t work;   /* workers wait here when the queue is empty */
    fp_run_t *head;        /* oldest run with unclaimed bytes; copier->lock */
    fp_run_t *tail;        /* newest; copier->lock */
    int idle;              /* workers waiting on `work`; copier->lock */
    int spinning;          /* workers polling `gen` between runs; written
                              under copier->lock by atomics, read unlocked
                              (relaxed) as a hint by fp_copier_run */
    unsigned gen;          /* bumped by every run queued with chunks left
                              for the pool, and by stop;
                              written under copier->lock by atomics, polled
                              unlocked by spinners (acquire) */
    uint64_t spin_ns;      /* how long a worker stays ready after a chunk
                              (0: sleeps at once); atomic
                              (fp_copier_set_spin) */
    int stop;              /* set once by destroy; copier->lock */
    int threads;           /* total parallelism, caller included; read-only */
    int nworkers;          /* pool threads started (threads - 1); read-only
                              after create */
    int stream;            /* runs from tuning.stream_min use streaming
                              stores; atomic (fp_copier_set_streaming) */
    fp_copier_tuning_t tuning; /* the cut-overs; each field atomic, read
                              relaxed once per run (fp_copier_set_tuning) */
    int max_spin;          /* most workers spinning at once: the CPUs the
                              pool may use less one (the caller's), at most
                              nworkers; atomic (set_affinity), compared with
                              `spinning` under copier->lock */
    pid_t pid;             /* process that started the pool; read-only */
    pthread_t *workers;    /* nworkers handles; create and destroy only */
#ifdef FP_TEST
    uint64_t test_spun;    /* chunks taken by a worker that spun, not woken;
                              copier->lock */
    uint64_t test_spin_runs; /* runs shared with spinners only; copier->lock */
    int test_max_spinning;   /* the most workers ever spinning at once;
                                copier->lock */
#endif
};

/* ---- runs and chunks (all under copier->lock) --------------------------- */

static void fp_run_skip_empty(fp_run_t *run)
{
    while (run->next < run->count && run->copies[run->next].size == 0)
        run->next++;
}

static int fp_run_exhausted(const fp_run_t *run)
{
    return run->next == run->count;
}

static void fp_queue_push(fp_copier_t *c, fp_run_t *run)
{
    run->prev = c->tail;
    run->after = NULL;
    if (c->tail)
        c->tail->after = run;
    else
        c->head = run;
    c->tail = run;
    run->queued = 1;
}

static void fp_queue_unlink(fp_copier_t *c, fp_run_t *run)
{
    if (run->prev)
        run->prev->after = run->after;
    else
        c->head = run->after;
    if (run->after)
        run->after->prev = run->prev;
    else
        c->tail = run->prev;
    run->prev = run->after = NULL;
    run->queued = 0;
}

#ifdef FP_DEBUG
/* Invariants: the queue is a well-linked list of exactly the runs that have
 * unclaimed bytes; a queued run's cursor points at a non-empty entry. */
static int fp_copier_is_valid(const fp_copier_t *c)
{
    const fp_run_t *prev = NULL;
    for (const fp_run_t *r = c->head; r; prev = r, r = r->after) {
        if (r->prev != prev || !r->queued || fp_run_exhausted(r))
            return 0;
        if (r->offset >= r->copies[r->next].size || r->inflight < 0)
            return 0;
    }
    int spinning = fp_atomic_load_relaxed(&c->spinning);
    return c->tail == prev && c->idle >= 0 && spinning >= 0 &&
           c->idle + spinning <= c->nworkers;
}
#define FP_COPIER_CHECK(c)                                                 \
    do {                                                                   \
        if (!fp_copier_is_valid(c))                                        \
            abort();                                                       \
    } while (0)
#else
#define FP_COPIER_CHECK(c) ((void)0)
#endif

/* Takes up to run->chunk bytes at the cursor; the run must not be
 * exhausted. Dequeues the run when this claim takes its last bytes. */
static fp_chunk_t fp_run_claim(fp_copier_t *c, fp_run_t *run)
{
    fp_chunk_t ch = {run->next, run->offset, 0};
    size_t want = run->chunk;

    while (want > 0 && run->next < run->count) {
        const fp_copy_t *e = &run->copies[run->next];
        size_t left = e->size - run->offset;
        if (left <= want) {
            ch.bytes += left;
            want -= left;
            run->next++;
            run->offset = 0;
            continue;
        }
        size_t take = want;
        size_t trim = ((uintptr_t)e->dst + run->offset + take) %
                      FP_COPIER_CUT_ALIGN;
        if (take > trim)
            take -= trim;
        ch.bytes += take;
        run->offset += take;
        break;
    }
    fp_run_skip_empty(run);
    if (fp_run_exhausted(run) && run->queued)
        fp_queue_unlink(c, run);
    return ch;
}

/* Entries under this are copied by memcpy even in a streaming run: each
 * streaming copy ends with a fence, which would cost more than it saves on a
 * few cache lines (a batch's labels, 8 bytes a sample). */
#define FP_COPIER_STREAM_ENTRY ((size_t)4 << 10)

/* n bytes, by streaming stores where asked (and there are some). */
static void fp_copy_bytes(void *dst, const void *src, size_t n, int stream)
{
#if FP_HAVE_STREAMING
    if (stream && n >= FP_COPIER_STREAM_ENTRY) {
        fp_copy_streaming(dst, src, n);
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, n);
}

/* Runs without the lock: a chunk's bytes belong to whoever claimed it. */
static void fp_chunk_copy(const fp_copy_t *copies, fp_chunk_t ch, int stream)
{
    size_t i = ch.entry, off = ch.offset, left = ch.bytes;
    while (left > 0) {
        const fp_copy_t *e = &copies[i];
        size_t n = e->size - off;
        if (n > left)
            n = left;
        if (n > 0)
            fp_copy_bytes((char *)e->dst + off, (const char *)e->src + off, n, stream);
        left -= n;
        i++;
        off = 0;
    }
}

/* ---- the pool ------------------------------------------------------------ */

static uint64_t fp_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Tells the core the thread is polling, so a sibling hyperthread gets the
 * pipeline meanwhile. */
static inline void fp_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    sched_yield();
#endif
}

/* Called with the lock held and the queue empty. Until `until` (a
 * fp_now_ns time), polls for a new run with the lock dropped; returns with
 * the lock held again: 1 when `gen` moved (a run was queued, or stop), 0
 * when the time ran out. The caller looks at the queue either way. */
static int fp_copier_spin(fp_copier_t *c, uint64_t until)
{
    unsigned gen = fp_atomic_load_relaxed(&c->gen); /* stable: we hold the lock */
    int moved = 0;
    int now_spinning = fp_atomic_add_acq_rel(&c->spinning, 1);
#ifdef FP_TEST
    if (now_spinning > c->test_max_spinning)
        c->test_max_spinning = now_spinning;
#else
    (void)now_spinning;
#endif
    pthread_mutex_unlock(&c->lock);
    for (unsigned polls = 1;; polls++) {
        if (fp_atomic_load_acquire(&c->gen) != gen) {
            moved = 1;
            break;
        }
        if (polls % FP_COPIER_SPIN_POLLS == 0 && fp_now_ns() >= until)
            break;
        fp_cpu_relax();
    }
    /* The caller that moved `gen` holds the lock a moment longer: poll for
     * it rather than sleep in the mutex, which would cost the caller a
     * wake when it lets go. */
    for (unsigned tries = 0;; tries++) {
        if (pthread_mutex_trylock(&c->lock) == 0)
            break;
        if (!moved || tries >= FP_COPIER_SPIN_POLLS * 16) {
            pthread_mutex_lock(&c->lock);
            break;
        }
        fp_cpu_relax();
    }
    fp_atomic_sub_acq_rel(&c->spinning, 1);
    return moved;
}

static void *fp_copier_worker(void *arg)
{
    fp_copier_t *c = arg;
    uint64_t ready_until = 0; /* stays ready (spins) until then */
    int spun = 0;             /* the last look at the queue followed a spin */

    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (!c->stop && c->head == NULL) {
            if (ready_until > 0 &&
                fp_atomic_load_relaxed(&c->spinning) < fp_atomic_load_relaxed(&c->max_spin) &&
                fp_now_ns() < ready_until) {
                /* Moved but nothing left (the caller and others took it):
                 * spin on, to the same time. */
                if (!fp_copier_spin(c, ready_until))
                    ready_until = 0;
                spun = 1;
                continue;
            }
            ready_until = 0;
            spun = 0;
            c->idle++;
            pthread_cond_wait(&c->work, &c->lock);
            c->idle--;
            /* Woken for a run: should the caller have finished it alone
             * meanwhile, stay ready for the next. */
            uint64_t spin = fp_atomic_load_relaxed(&c->spin_ns);
            ready_until = spin ? fp_now_ns() + spin : 0;
        }
        if (c->stop)
            break;
#ifdef FP_TEST
        c->test_spun += (uint64_t)spun;
#else
        (void)spun;
#endif
        spun = 0;
        fp_run_t *run = c->head;
        fp_chunk_t ch = fp_run_claim(c, run);
        run->inflight++;
        FP_COPIER_CHECK(c);
        pthread_mutex_unlock(&c->lock);

        /* inflight > 0 keeps the caller, and so `run`, waiting for us. */
        fp_chunk_copy(run->copies, ch, run->stream);

        uint64_t spin = fp_atomic_load_relaxed(&c->spin_ns);
        ready_until = spin ? fp_now_ns() + spin : 0;
        pthread_mutex_lock(&c->lock);
        if (--run->inflight == 0 && fp_run_exhausted(run))
            pthread_cond_signal(&run->done);
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* Stops and joins the first `n` workers; spinners see `gen` move. */
static void fp_copier_stop(fp_copier_t *c, int n)
{
    pthread_mutex_lock(&c->lock);
    c->stop = 1;
    fp_atomic_add_acq_rel(&c->gen, 1);
    pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->lock);
    for (int i = 0; i < n; i++)
        pthread_join(c->workers[i], NULL);
}

int fp_cpu_count(void)
{
    /* Start at glibc's default set size; grow for machines past 1024 CPUs. */
    for (size_t ncpu = CPU_SETSIZE; ncpu <= ((size_t)1 << 20); ncpu *= 2) {
        cpu_set_t *set = CPU_ALLOC(ncpu);
        if (set == NULL)
            break;
        size_t size = CPU_ALLOC_SIZE(ncpu);
        CPU_ZERO_S(size, set);
        if (sched_getaffinity(0, size, set) == 0) {
            int n = CPU_COUNT_S(size, set);
            CPU_FREE(set);
            return n > 0 ? n : 1;
        }
        int err = errno;
        CPU_FREE(set);
        if (err != EINVAL)
            break;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* The most of `nworkers` that may spin at once on `cpus` CPUs: one is the
 * caller's. */
static int fp_copier_spin_cap(int nworkers, int cpus)
{
    int cap = cpus - 1;
    if (cap > nworkers)
        cap = nworkers;
    return cap > 0 ? cap : 0;
}

void fp_copier_tuning_default(fp_copier_tuning_t *t)
{
    t->inline_max = FP_COPIER_INLINE;
    t->inline_spin = FP_COPIER_INLINE_SPIN;
    t->stream_min = FP_COPIER_STREAM;
    t->chunk_min = FP_COPIER_CHUNK_MIN;
    t->chunk_max = FP_COPIER_CHUNK;
    t->chunk_min_spin = FP_COPIER_CHUNK_MIN_SPIN;
}

int fp_copier_tuning_check(const fp_copier_tuning_t *t)
{
    if (t == NULL)
        return fp_error_set(FP_EINVAL, "copier tuning: NULL");
    const struct {
        const char *name;
        size_t value, lo, hi;
    } fields[] = {
        {"inline_max", t->inline_max, 0, FP_COPIER_TUNE_MAX},
        {"inline_spin", t->inline_spin, 0, FP_COPIER_TUNE_MAX},
        {"stream_min", t->stream_min, 0, FP_COPIER_TUNE_MAX},
        {"chunk_min", t->chunk_min, FP_COPIER_CHUNK_FLOOR, FP_COPIER_TUNE_MAX},
        {"chunk_max", t->chunk_max, FP_COPIER_CHUNK_FLOOR, FP_COPIER_TUNE_MAX},
        {"chunk_min_spin", t->chunk_min_spin, FP_COPIER_CHUNK_FLOOR, FP_COPIER_TUNE_MAX},
    };
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++)
        if (fields[i].value < fields[i].lo || fields[i].value > fields[i].hi)
            return fp_error_set(FP_EINVAL, "copier tuning: %s must be %zu to %zu bytes, not %zu",
                                fields[i].name, fields[i].lo, fields[i].hi, fields[i].value);
    if (t->chunk_min > t->chunk_max || t->chunk_min_spin > t->chunk_max)
        return fp_error_set(FP_EINVAL, "copier tuning: chunk_min (%zu) and chunk_min_spin (%zu) "
                                       "may not exceed chunk_max (%zu)",
                            t->chunk_min, t->chunk_min_spin, t->chunk_max);
    return FP_OK;
}

int fp_copier_set_tuning(fp_copier_t *copier, const fp_copier_tuning_t *t)
{
    if (copier == NULL)
        return fp_error_set(FP_EINVAL, "copier tuning: NULL copier");
    int status = fp_copier_tuning_check(t);
    if (status)
        return status;
    fp_atomic_store_release(&copier->tuning.inline_max, t->inline_max);
    fp_atomic_store_release(&copier->tuning.inline_spin, t->inline_spin);
    fp_atomic_store_release(&copier->tuning.stream_min, t->stream_min);
    fp_atomic_store_release(&copier->tuning.chunk_min, t->chunk_min);
    fp_atomic_store_release(&copier->tuning.chunk_max, t->chunk_max);
    fp_atomic_store_release(&copier->tuning.chunk_min_spin, t->chunk_min_spin);
    return FP_OK;
}

void fp_copier_get_tuning(const fp_copier_t *copier, fp_copier_tuning_t *t)
{
    t->inline_max = fp_atomic_load_relaxed(&copier->tuning.inline_max);
    t->inline_spin = fp_atomic_load_relaxed(&copier->tuning.inline_spin);
    t->stream_min = fp_atomic_load_relaxed(&copier->tuning.stream_min);
    t->chunk_min = fp_atomic_load_relaxed(&copier->tuning.chunk_min);
    t->chunk_max = fp_atomic_load_relaxed(&copier->tuning.chunk_max);
    t->chunk_min_spin = fp_atomic_load_relaxed(&copier->tuning.chunk_min_spin);
}

int fp_copier_spinners(const fp_copier_t *copier)
{
    return fp_atomic_load_relaxed(&copier->max_spin);
}

int fp_copier_create(fp_copier_t **out, int threads)
{
    if (out == NULL)
        return fp_error_set(FP_EINVAL, "copier: no output pointer");
    *out = NULL;
    if (threads < 0)
        return fp_error_set(FP_EINVAL,
                            "copier: threads must be >= 0, got %d", threads);
    if (threads == 0) {
        threads = fp_cpu_count();
        if (threads > FP_COPIER_MAX_DEFAULT)
            threads = FP_COPIER_MAX_DEFAULT;
    }

    fp_copier_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        return fp_error_set(FP_EOS, "copier: out of memory");
    c->threads = threads;
    c->stream = FP_HAVE_STREAMING;
    fp_copier_tuning_default(&c->tuning);
    c->max_spin = fp_copier_spin_cap(threads - 1, fp_cpu_count());
    c->pid = fp_pid();
    if (threads > 1) {
        c->workers = calloc((size_t)threads - 1, sizeof *c->workers);
        if (c->workers == NULL) {
            free(c);
            return fp_error_set(FP_EOS, "copier: out of memory");
        }
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->work, NULL);

    /* Workers start with every signal blocked, so signals meant for the
     * process (SIGINT for Python) land on threads that handle them. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int status = FP_OK;
    for (int i = 0; i < threads - 1; i++) {
        int rc = pthread_create(&c->workers[i], NULL, fp_copier_worker, c);
        if (rc != 0) {
            status = fp_error_set(FP_EOS,
                                  "copier: starting thread %d of %d: %s",
                                  i + 1, threads - 1, strerror(rc));
            break;
        }
        pthread_setname_np(c->workers[i], "fastpin-copy");
        c->nworkers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);

    if (status != FP_OK) {
        fp_copier_stop(c, c->nworkers);
        pthread_cond_destroy(&c->work);
        pthread_mutex_destroy(&c->lock);
        free(c->workers);
        free(c);
        return status;
    }
    *out = c;
    return FP_OK;
}

void fp_copier_destroy(fp_copier_t *copier)
{
    if (copier == NULL)
        return;
    /* In a forked child the workers do not exist and the lock may have been
     * held at the fork: joining would hang, locking might. Leak the stacks;
     * free only what is ours. */
    if (fp_same_process(copier->pid)) {
        fp_copier_stop(copier, copier->nworkers);
        pthread_cond_destroy(&copier->work);
        pthread_mutex_destroy(&copier->lock);
    }
    free(copier->workers);
    free(copier);
}

int fp_copier_threads(const fp_copier_t *copier)
{
    return copier->threads;
}

int fp_copier_streams(const fp_copier_t *copier)
{
    return fp_atomic_load_relaxed(&copier->stream);
}

void fp_copier_set_streaming(fp_copier_t *copier, int on)
{
    fp_atomic_store_release(&copier->stream, on && FP_HAVE_STREAMING);
}

int fp_copier_set_spin(fp_copier_t *copier, uint64_t ns)
{
    if (copier == NULL)
        return fp_error_set(FP_EINVAL, "copier spin: NULL copier");
    if (ns > FP_COPIER_SPIN_MAX)
        return fp_error_set(FP_EINVAL, "copier spin: %llu ns is more than the most, %llu",
                            (unsigned long long)ns, (unsigned long long)FP_COPIER_SPIN_MAX);
    fp_atomic_store_release(&copier->spin_ns, ns);
    return FP_OK;
}

uint64_t fp_copier_spin_ns(const fp_copier_t *copier)
{
    return fp_atomic_load_relaxed(&copier->spin_ns);
}

#ifdef FP_TEST
void fp_copier_test_counts(fp_copier_t *copier, uint64_t *spun, uint64_t *spin_runs)
{
    pthread_mutex_lock(&copier->lock);
    *spun = copier->test_spun;
    *spin_runs = copier->test_spin_runs;
    pthread_mutex_unlock(&copier->lock);
}

int fp_copier_test_max_spinning(fp_copier_t *copier)
{
    pthread_mutex_lock(&copier->lock);
    int n = copier->test_max_spinning;
    pthread_mutex_unlock(&copier->lock);
    return n;
}
#endif

/* The calling thread's affinity into a set of `ncpu` CPUs (grown past 1024
 * as fp_cpu_count does); returns the set or NULL with the error set. */
static cpu_set_t *fp_affinity_of_caller(size_t *ncpu)
{
    for (*ncpu = CPU_SETSIZE; *ncpu <= (size_t)FP_COPIER_MAX_CPU; *ncpu *= 2) {
        cpu_set_t *set = CPU_ALLOC(*ncpu);
        if (set == NULL)
            break;
        CPU_ZERO_S(CPU_ALLOC_SIZE(*ncpu), set);
        if (sched_getaffinity(0, CPU_ALLOC_SIZE(*ncpu), set) == 0)
            return set;
        int err = errno;
        CPU_FREE(set);
        if (err != EINVAL) {
            fp_error_set(FP_EOS, "copier: sched_getaffinity: %s", strerror(err));
            return NULL;
        }
    }
    fp_error_set(FP_EOS, "copier: cannot read this thread's CPU affinity");
    return NULL;
}

int fp_copier_set_affinity(fp_copier_t *copier, const int *cpus, size_t count)
{
    if (copier == NULL || (cpus == NULL && count > 0))
        return fp_error_set(FP_EINVAL, "copier affinity: NULL argument");
    if (!fp_same_process(copier->pid))
        return fp_error_set(FP_EINVAL, "copier belongs to process %d; this is process %d",
                            (int)copier->pid, (int)fp_pid());
    size_t ncpu = CPU_SETSIZE;
    cpu_set_t *set;
    if (count == 0) {
        set = fp_affinity_of_caller(&ncpu);
        if (set == NULL)
            return FP_EOS;
    } else {
        for (size_t i = 0; i < count; i++) {
            if (cpus[i] < 0 || cpus[i] >= FP_COPIER_MAX_CPU)
                return fp_error_set(FP_EINVAL, "copier affinity: no CPU %d (0 to %d)",
                                    cpus[i], FP_COPIER_MAX_CPU - 1);
            if ((size_t)cpus[i] >= ncpu)
                ncpu = (size_t)cpus[i] + 1;
        }
        set = CPU_ALLOC(ncpu);
        if (set == NULL)
            return fp_error_set(FP_EOS, "copier: out of memory");
        CPU_ZERO_S(CPU_ALLOC_SIZE(ncpu), set);
        for (size_t i = 0; i < count; i++)
            CPU_SET_S((size_t)cpus[i], CPU_ALLOC_SIZE(ncpu), set);
    }
    /* The worker handles are fixed once create returned; the threads may be
     * copying meanwhile: the kernel moves them at their next schedule. */
    int allowed = CPU_COUNT_S(CPU_ALLOC_SIZE(ncpu), set);
    int status = FP_OK;
    for (int i = 0; i < copier->nworkers && status == FP_OK; i++) {
        int rc = pthread_setaffinity_np(copier->workers[i], CPU_ALLOC_SIZE(ncpu), set);
        if (rc == EINVAL)
            status = fp_error_set(FP_EINVAL, "copier affinity: none of the %zu CPUs listed "
                                             "may be used by this process", count);
        else if (rc != 0)
            status = fp_error_set(FP_EOS, "copier affinity: %s", strerror(rc));
    }
    CPU_FREE(set);
    /* Spinners share the CPUs they are pinned to (a listed CPU this process
     * may not use still counts: the kernel's choice is not known here; the
     * whole machine's cap, from create, still holds). */
    if (status == FP_OK) {
        int cap = fp_copier_spin_cap(copier->nworkers, allowed);
        int whole = fp_copier_spin_cap(copier->nworkers, fp_cpu_count());
        fp_atomic_store_release(&copier->max_spin, cap < whole ? cap : whole);
    }
    return status;
}

int fp_copier_run(fp_copier_t *copier, const fp_copy_t *copies, size_t count)
{
    if (copier == NULL || (copies == NULL && count > 0))
        return fp_error_set(FP_EINVAL, "copier run: NULL argument");
    /* Checked even for runs the caller could do alone, so a forked child
     * learns at its first call, not at its first large one. */
    if (!fp_same_process(copier->pid))
        return fp_error_set(FP_EINVAL,
                            "copier belongs to process %d; this is process "
                            "%d (create a new copier after fork)",
                            (int)copier->pid, (int)fp_pid());

    size_t total = 0;
    for (size_t i = 0; i < count; i++) {
        if (copies[i].size == 0)
            continue;
        if (copies[i].dst == NULL || copies[i].src == NULL)
            return fp_error_set(FP_EINVAL,
                                "copier run: entry %zu has a NULL pointer "
                                "and %zu bytes", i, copies[i].size);
        if (__builtin_add_overflow(total, copies[i].size, &total))
            return fp_error_set(FP_EINVAL, "copier run: sizes overflow");
    }

    fp_copier_tuning_t tune;
    fp_copier_get_tuning(copier, &tune);
    int stream = fp_copier_streams(copier) && total >= tune.stream_min;
    /* Runs above tune.inline_spin up to tune.inline_max are shared only
     * while workers spin (they take a run for the price of a lock; a
     * sleeper's wake costs more than it saves), only with those, and in
     * smaller chunks. The count is a hint, read without the lock: a spinner
     * that has gone to sleep meanwhile leaves its share to the caller. */
    size_t spinning = 0;
    if (fp_atomic_load_relaxed(&copier->spin_ns) > 0)
        spinning = (size_t)fp_atomic_load_relaxed(&copier->spinning);
    int spin_only = total <= tune.inline_max;
    if ((spin_only && (spinning == 0 || total <= tune.inline_spin)) ||
        copier->nworkers == 0 || total == 0) {
        for (size_t i = 0; i < count; i++)
            if (copies[i].size > 0)
                fp_copy_bytes(copies[i].dst, copies[i].src, copies[i].size, stream);
        return FP_OK;
    }

    size_t parts = spin_only ? spinning + 1 : (size_t)copier->threads;
    size_t chunk = total / (parts * FP_COPIER_CHUNKS_PER_THREAD);
    size_t least = spin_only ? tune.chunk_min_spin : tune.chunk_min;
    if (chunk > tune.chunk_max)
        chunk = tune.chunk_max;
    if (chunk < least)
        chunk = least;

    fp_run_t run = {.copies = copies, .count = count, .chunk = chunk, .stream = stream};
    pthread_cond_init(&run.done, NULL);
    fp_run_skip_empty(&run);

    pthread_mutex_lock(&copier->lock);
    fp_queue_push(copier, &run);
#ifdef FP_TEST
    copier->test_spin_runs += (uint64_t)spin_only;
#endif
    fp_chunk_t ch = fp_run_claim(copier, &run);
    if (!fp_run_exhausted(&run))
        fp_atomic_add_acq_rel(&copier->gen, 1); /* spinners: a run to share */
    /* Wake as many workers as there are chunks left, and no more (none for
     * a run only spinners share); spinners count as awake: each takes the
     * lock and looks at the queue before it could sleep. */
    size_t left = fp_run_exhausted(&run) || spin_only
                      ? 0
                      : (total - ch.bytes + chunk - 1) / chunk;
    spinning = (size_t)fp_atomic_load_relaxed(&copier->spinning);
    left = left > spinning ? left - spinning : 0;
    size_t idle = (size_t)copier->idle;
    FP_COPIER_CHECK(copier);
    pthread_mutex_unlock(&copier->lock);

    if (left > 0 && left >= idle)
        pthread_cond_broadcast(&copier->work);
    else
        for (size_t i = 0; i < left; i++)
            pthread_cond_signal(&copier->work);

    for (;;) {
        fp_chunk_copy(copies, ch, run.stream);
        pthread_mutex_lock(&copier->lock);
        if (fp_run_exhausted(&run))
            break;
        ch = fp_run_claim(copier, &run);
        FP_COPIER_CHECK(copier);
        pthread_mutex_unlock(&copier->lock);
    }
    while (run.inflight > 0)
        pthread_cond_wait(&run.done, &copier->lock);
    pthread_mutex_unlock(&copier->lock);
    pthread_cond_destroy(&run.done);
    return FP_OK;
}
