/* CHECK for the C tests whose checks run on many threads (test_copier.c,
 * test_team.c): a failed condition is reported with its place and a message,
 * and counted in `failures` atomically; the program exits non-zero at the end
 * if any failed. */
#ifndef FASTPIN_TEST_CHECK_H
#define FASTPIN_TEST_CHECK_H

#include <stdio.h>

#include "fastpin.h"

static int failures; /* any thread adds, through fp_atomic_add_acq_rel */

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
            fp_atomic_add_acq_rel(&failures, 1);                           \
        }                                                                  \
    } while (0)

#endif /* FASTPIN_TEST_CHECK_H */
