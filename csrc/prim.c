/* The OS layer (after mimalloc's prim): everything the core asks of the
 * kernel that is not a thread or CUDA. Mappings, memfd and its seals, NUMA
 * binding, random tokens, prefaulting; and which process this is, the one
 * question every object made in one process and inherited across fork asks
 * ("am I still in the process that made me?"). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "arena_internal.h"

/* ---- this process ------------------------------------------------------ */

/* getpid() is a system call (glibc caches nothing since 2.25), and the core
 * asks on every allocation, free and copy. One cached value, set when the
 * library is loaded and again in the child of every fork(); a child made
 * without fork() (vfork, posix_spawn, clone) runs no fastpin code before it
 * execs. */
static pid_t fp_pid_cached; /* relaxed atomic: written at load and in a fork's child */

static void fp_pid_refresh(void) { __atomic_store_n(&fp_pid_cached, getpid(), __ATOMIC_RELAXED); }

__attribute__((constructor)) static void fp_pid_init(void)
{
    fp_pid_refresh();
    /* Should registration fail (ENOMEM), fp_pid falls back to asking. */
    if (pthread_atfork(NULL, NULL, fp_pid_refresh) != 0)
        __atomic_store_n(&fp_pid_cached, 0, __ATOMIC_RELAXED);
}

pid_t fp_pid(void)
{
    pid_t pid = __atomic_load_n(&fp_pid_cached, __ATOMIC_RELAXED);
    return pid ? pid : getpid();
}

int fp_same_process(pid_t pid) { return pid == fp_pid(); }

/* ---- mappings ---------------------------------------------------------- */

uint64_t fp_prim_page_size(void) { return (uint64_t)sysconf(_SC_PAGESIZE); }

int fp_prim_map_new(uint64_t size, int with_fd, int *fd, void **out)
{
    int prot = PROT_READ | PROT_WRITE;
    void *p;
    *fd = -1;
    *out = NULL;
    if (with_fd) {
        *fd = memfd_create("fastpin-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (*fd < 0)
            return fp_error_set(FP_EOS, "memfd_create: %s", strerror(errno));
        if (ftruncate(*fd, (off_t)size) != 0)
            return fp_error_set(FP_EOS, "ftruncate of the shared arena to %llu bytes: %s",
                                (unsigned long long)size, strerror(errno));
        /* A worker that resized the file would make every mapping fault
         * (SIGBUS) past the new end. Old kernels lack seals: no harm. */
        (void)fcntl(*fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
        p = mmap(NULL, size, prot, MAP_SHARED, *fd, 0);
    } else {
        /* Shared, though no other process attaches: fork() copies every
         * page-locked page of a private mapping into the child at once (the
         * pages cannot be copy-on-write while a device may DMA to them),
         * 0.4 s per GiB and per DataLoader worker on the H200 machine. A
         * shared mapping is not copied: the child maps the same pages, and
         * can still read the batches it inherited. */
        p = mmap(NULL, size, prot, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    }
    if (p == MAP_FAILED)
        return fp_error_set(FP_EOS, "mmap of %llu bytes for the arena: %s",
                            (unsigned long long)size, strerror(errno));
    *out = p;
    return FP_OK;
}

void fp_prim_unmap(void *p, uint64_t size) { munmap(p, size); }

int fp_prim_fd_size(int fd, uint64_t at_least, uint64_t *size)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return fp_error_set(FP_EOS, "fstat of arena fd %d: %s", fd, strerror(errno));
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size < at_least)
        return fp_error_set(FP_EINVAL, "fd %d does not hold a fastpin arena (%s of %lld bytes)",
                            fd, S_ISREG(st.st_mode) ? "a file" : "not a file",
                            (long long)st.st_size);
    *size = (uint64_t)st.st_size;
    return FP_OK;
}

int fp_prim_map_fd(int fd, uint64_t size, void **out)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return fp_error_set(FP_EOS, "mmap of the arena in fd %d (%llu bytes): %s", fd,
                            (unsigned long long)size, strerror(errno));
    *out = p;
    return FP_OK;
}

int fp_prim_dup(int fd, int *out)
{
    *out = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (*out < 0)
        return fp_error_set(FP_EOS, "dup of arena fd %d: %s", fd, strerror(errno));
    return FP_OK;
}

/* The kernel's MPOL_PREFERRED (linux/mempolicy.h), spelled out so the build
 * needs no kernel headers. */
#define FP_MPOL_PREFERRED 1

/* Preferred, not bound: a node short of memory spills to another rather than
 * failing registration or waking the OOM killer. cuMemHostRegister populates
 * the pages, the copy threads fault in the rest: the policy must be set
 * before either. */
int fp_prim_bind(void *p, uint64_t size, int node)
{
    if (node < 0 || node >= FP_NUMA_MAX_NODES)
        return 0;
    enum { BITS = 8 * sizeof(unsigned long) };
    unsigned long mask[FP_NUMA_MAX_NODES / BITS] = {0};
    mask[node / BITS] = 1ul << (node % BITS);
    /* maxnode is one more than the bits the kernel reads (it drops one). */
    return syscall(SYS_mbind, p, (unsigned long)size, FP_MPOL_PREFERRED, mask,
                   (unsigned long)FP_NUMA_MAX_NODES + 1, 0u) == 0;
}

int fp_prim_current_node(void)
{
    unsigned cpu = 0, node = 0;
    return syscall(SYS_getcpu, &cpu, &node, NULL) == 0 ? (int)node : -1;
}

/* From the kernel, or, should it refuse, mixed from the clock, the pid and
 * an address. */
uint64_t fp_prim_random(const void *salt)
{
    uint64_t t = 0;
    if (getrandom(&t, sizeof t, GRND_NONBLOCK) != (ssize_t)sizeof t) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        t = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)fp_pid() << 40) ^
            (uint64_t)(uintptr_t)salt;
        t *= 0x9e3779b97f4a7c15ull;
    }
    return t ? t : 1;
}

/* The kernel's MADV_POPULATE_WRITE (Linux 5.14), spelled out for older headers. */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* One pass of the kernel over the page tables instead of a trap per 4 KiB
 * page the first time this process writes each one. Old kernels (EINVAL)
 * keep faulting on demand. */
int fp_prim_populate(void *p, uint64_t size) { return madvise(p, size, MADV_POPULATE_WRITE) == 0; }
