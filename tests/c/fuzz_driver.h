/* What the fuzzers' own drivers (FUZZ_*_MAIN: any compiler, no libFuzzer)
 * share: the random numbers, and the replay of the inputs named on the
 * command line. Each fuzzer keeps its own inputs and how it changes them. */
#ifndef FUZZ_DRIVER_H
#define FUZZ_DRIVER_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static inline uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* file(path) for `path`, or for each file in it if it is a folder. */
static inline void fuzz_replay(const char *path, void (*file)(const char *))
{
    struct stat st;
    if (stat(path, &st) != 0) {
        perror(path);
        exit(2);
    }
    if (!S_ISDIR(st.st_mode)) {
        file(path);
        return;
    }
    DIR *d = opendir(path);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        char full[4096];
        snprintf(full, sizeof full, "%s/%s", path, de->d_name);
        file(full);
    }
    if (d)
        closedir(d);
}

/* Seeds rng() from FUZZ_SEED (default 1), replays the files and folders
 * named, and returns FUZZ_CASES (default 2000): the inputs to run next. */
static inline unsigned long fuzz_start(int argc, char **argv, void (*file)(const char *))
{
    const char *e = getenv("FUZZ_CASES");
    unsigned long n = e ? strtoul(e, NULL, 10) : 2000;
    e = getenv("FUZZ_SEED");
    rng_state ^= e ? strtoull(e, NULL, 10) * 0x2545f4914f6cdd1dull : 0;
    if (!rng_state)
        rng_state = 1;
    for (int i = 1; i < argc; i++)
        fuzz_replay(argv[i], file);
    return n;
}

#endif
