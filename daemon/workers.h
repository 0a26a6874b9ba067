/*
 * workers.h - kvd's worker processes: spawn, register, heartbeats,
 * death, messages (workers.c)
 */
#ifndef KVD_WORKERS_H
#define KVD_WORKERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd.h"

int workers_start(struct kvd *k);
void workers_on_message(struct kvd *k, const uint8_t *rid, size_t rid_len, const void *buf,
                        size_t len);
void workers_tick(struct kvd *k);
void workers_reap(struct kvd *k);
int workers_alive(const struct kvd *k);
bool workers_can_come_back(const struct kvd *k);
void workers_stop(struct kvd *k);
int workers_send(struct kvd *k, int w, Kvdw__ToWorker *m);

#endif
