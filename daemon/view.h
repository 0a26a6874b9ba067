/*
 * view.h - the pools as a picture (Stats.pool_view, the web page's /pool):
 * view.c
 */
#ifndef KVD_VIEW_H
#define KVD_VIEW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd.h"

/* Once a loop pass: closes the second's sample when its time has come. */
void view_tick(struct kvd *k);
/* The picture as tenant sees it ("" or NULL: an anonymous client), or all of
 * it; *out is filled, and freed by view_free whatever this returns (0, or
 * KVD_ENOMEM). It borrows k's strings until then. */
int view_build(const struct kvd *k, const char *tenant, bool all, struct kvd_view *out);
void view_free(struct kvd_view *v);

#endif
