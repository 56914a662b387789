/* The thread-local error message behind every non-zero status. */
#include <stdarg.h>
#include <stdio.h>

#include "fastpin.h"

static _Thread_local char fp_errmsg[512];

int fp_error_set(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fp_errmsg, sizeof fp_errmsg, fmt, ap);
    va_end(ap);
    return status;
}

const char *fp_error_message(void)
{
    return fp_errmsg[0] ? fp_errmsg : "unknown error";
}
