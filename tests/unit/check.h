/*
 * check.h - the assertions of kvd's tests.
 *
 * Each test is a program; a failed CHECK prints where and both values, counts
 * the failure and goes on, and CHECK_DONE() returns the exit status. Tests
 * that cannot run where they are (no GPU) return KVD_TEST_SKIP (ctest's skip).
 */
#ifndef KVD_CHECK_H
#define KVD_CHECK_H

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define KVD_TEST_SKIP 77

static int check_failures;
static int check_count;

#define CHECK(cond) do { check_count++; if (!(cond)) { check_failures++; \
    fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); } } while (0)

#define CHECK_INT(a, b) do { long long va_ = (long long)(a), vb_ = (long long)(b); check_count++; \
    if (va_ != vb_) { check_failures++; fprintf(stderr, "%s:%d: %s == %s failed: %lld != %lld\n", \
        __FILE__, __LINE__, #a, #b, va_, vb_); } } while (0)

#define CHECK_NEAR(a, b, tol) do { double va_ = (double)(a), vb_ = (double)(b); check_count++; \
    if (!(fabs(va_ - vb_) <= (tol))) { check_failures++; fprintf(stderr, \
        "%s:%d: |%s - %s| <= %g failed: %.9g vs %.9g\n", __FILE__, __LINE__, #a, #b, \
        (double)(tol), va_, vb_); } } while (0)

/* Stops the test at once (for conditions later checks depend on). */
#define REQUIRE(cond) do { check_count++; if (!(cond)) { \
    fprintf(stderr, "%s:%d: REQUIRE(%s) failed\n", __FILE__, __LINE__, #cond); exit(1); } } while (0)

#define CHECK_DONE() (fprintf(stderr, "%d checks, %d failed\n", check_count, check_failures), \
    check_failures ? 1 : 0)

#endif
