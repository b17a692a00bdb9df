/*
 * The checks shared by the C test programs: CHECK(cond) prints the failed condition with its
 * file, line and belayer_last_error(), counts it in `failures` and jumps to the calling
 * function's `out:` label; OK(call) checks that a libbelayer call returned BELAYER_OK.
 * A program exits with `failures ? 1 : 0`.
 */
#ifndef BELAYER_TESTS_CHECK_H
#define BELAYER_TESTS_CHECK_H

#include <stdio.h>

#include "belayer.h"

static int failures = 0;

#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n",             \
                    __FILE_NAME__, __LINE__, #cond, belayer_last_error());            \
            failures++;                                                               \
            goto out;                                                                 \
        }                                                                             \
    } while (0)

#define OK(call) CHECK((call) == BELAYER_OK)

#endif
