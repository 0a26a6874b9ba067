/*
 * hosts.h - other hosts' pools, which workers started there with
 * kvd-worker --host NAME compute into (hosts.c)
 */
#ifndef KVD_HOSTS_H
#define KVD_HOSTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd.h"

void hosts_init(struct kvd *k);
uint64_t hosts_seq_tokens(const struct pool_layout *lay, uint32_t n_blocks);
/* A remote worker's Ready: the index of its pool's record (made now when new),
 * or -1 with the reason logged. */
int hosts_join(struct kvd *k, const Kvdw__Ready *r);
/* Worker w of host h was lost: hold ps (moved out, leaving it empty with its
 * settings) until the worker has surely stopped writing into its blocks. */
void hosts_fence(struct kvd *k, int h, struct prefix_seq *ps);
/* After a worker was lost: drops host h when no worker of it is alive. */
void hosts_check(struct kvd *k, int h);
/* Fenced blocks whose time has come are released; pings to remote workers. */
void hosts_tick(struct kvd *k);
/* The ping interval for workers of other hosts: at most a quarter of the
 * shortest fence time, and of --worker-timeout, and 1 s. */
double hosts_ping_ms(const struct kvd *k);
uint32_t hosts_workers(const struct kvd *k, int h);
uint32_t hosts_fenced_blocks(const struct kvd_host *h);
void hosts_fini(struct kvd *k);

#endif
