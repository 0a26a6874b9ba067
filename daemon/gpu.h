/*
 * gpu.h - --gpu: the pool's device memory and the socket that hands it
 * to workers (gpu.c)
 */
#ifndef KVD_GPU_H
#define KVD_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd.h"

void gpu_probe(struct kvd *k);
uint64_t gpu_default_kv_bytes(const struct kvd *k);
void gpu_setup(struct kvd *k, const char *run_dir);
void gpu_serve(struct kvd *k);
void gpu_fini(struct kvd *k);

#endif
