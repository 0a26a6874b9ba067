/*
 * kvd_stats_fields.h — the statistics kvd reports, declared once.
 *
 * Every scalar figure of kvd.proto's Stats (and of its per-worker, per-host
 * and per-tenant rows) is one line of a table below. What reads or writes a
 * figure expands the table with a macro of its own instead of naming fields
 * by hand: the public struct kvd_stats and its rows (kvd_client.h), kvd's
 * reply (daemon/requests.c sets every has_ flag from it), the C client's copy
 * of the reply, the Prometheus text (kvd_stats_prometheus), kvcli's JSON, and
 * the Python client's Stats and its rows (clients/python/setup.py generates
 * their fields from these tables when the package is built, each line's help
 * its doc comment). A new figure is a field in kvd.proto, a line here and the
 * line in kvd that computes it.
 *
 * A line: X(name, type, prom_type, prom_name, help)
 *   name       the field's name in kvd.proto's message, in the C struct and
 *              in kvcli's JSON
 *   type       U64, U32, I32, BOOL, or STR48 / STR64 / STR128: a string of at
 *              most 47, 63 or 127 bytes (char[48], ... in the C struct)
 *   prom_type  COUNTER, GAUGE or NONE (not a Prometheus metric of its own)
 *   prom_name  its Prometheus name (a string; "" with NONE)
 *   help       what it counts (its Prometheus HELP text where it has one)
 *
 * The order of a table is the order of the fields in the C struct, of the
 * Python dataclass, of kvcli's JSON and of the plain Prometheus metrics. The
 * Python build reads the lines with a parser of its own, which stops on what
 * it cannot read: keep each line an X(...) whose last two arguments are
 * string literals. Installed beside kvd_client.h.
 */
#ifndef KVD_STATS_FIELDS_H
#define KVD_STATS_FIELDS_H

/* A field of the C struct: KVD_STATS_DECL(type, name) declares it. */
#define KVD_STATS_DECL(type, name) KVD_STATS_DECL_##type(name)
#define KVD_STATS_DECL_U64(name) uint64_t name;
#define KVD_STATS_DECL_U32(name) uint32_t name;
#define KVD_STATS_DECL_I32(name) int32_t name;
#define KVD_STATS_DECL_BOOL(name) bool name;
#define KVD_STATS_DECL_STR48(name) char name[48];
#define KVD_STATS_DECL_STR64(name) char name[64];
#define KVD_STATS_DECL_STR128(name) char name[128];

/* kvd.proto's Stats, its scalar fields (the rows, histograms, block hashes
 * and pool view are not scalars: kvd_client.h declares them). */
#define KVD_STATS_FIELDS(X)                                                                                   \
    X(requests_running, U64, GAUGE, "vllm:num_requests_running", "Requests being computed.")                  \
    X(requests_queued, U64, GAUGE, "vllm:num_requests_waiting", "Requests waiting for a worker.")             \
    X(requests_done, U64, COUNTER, "kvd_requests_done_total", "Requests finished.")                           \
    X(requests_failed, U64, COUNTER, "kvd_requests_failed_total", "Requests failed.")                         \
    X(prompt_tokens, U64, COUNTER, "vllm:prompt_tokens_total", "Prompt tokens.")                              \
    X(cached_prompt_tokens, U64, COUNTER, "vllm:prefix_cache_hits_total",                                     \
      "Prompt tokens found in the prefix cache.")                                                             \
    X(completion_tokens, U64, COUNTER, "vllm:generation_tokens_total", "Generated tokens.")                   \
    X(blocks_total, U32, GAUGE, "kvd_blocks_total", "KV blocks in the pool.")                                 \
    X(blocks_free, U32, GAUGE, "kvd_blocks_free", "KV blocks free.")                                          \
    X(blocks_cached, U32, GAUGE, "kvd_blocks_cached", "KV blocks holding cached prefixes, held by nobody.")   \
    X(blocks_in_use, U32, GAUGE, "kvd_blocks_in_use", "KV blocks held by requests.")                          \
    X(blocks_pending, U32, GAUGE, "kvd_blocks_pending", "KV blocks being written.")                           \
    X(block_tokens, U32, NONE, "", "Tokens a KV block holds.")                                                \
    X(block_bytes, U64, NONE, "", "Bytes of a KV block.")                                                     \
    X(kv_bytes_per_token, U64, GAUGE, "kvd_kv_bytes_per_token", "K and V bytes of one token, all layers.")    \
    X(kv_type, STR48, NONE, "", "The pool's types: \"K q8_0, V q4_0, rotated V\".")                             \
    X(kv_parts, U32, NONE, "",                                                                                \
      "Block tables per sequence: 1, or the parts of a model with sliding-window layers.")                    \
    X(kv_part_layers, U32, NONE, "", "Layers a block holds.")                                                 \
    X(kv_window, U32, NONE, "", "The windowed parts' window in positions; 0: none.")                          \
    X(blocks_in_use_windowed, U32, NONE, "", "Blocks of windowed parts that running sequences hold.")         \
    X(host_cache_max_bytes, U64, NONE, "", "The host tier's budget (--host-cache); 0: none.")                 \
    X(host_cache_bytes, U64, NONE, "", "Bytes the host tier holds.")                                          \
    X(host_cache_blocks, U64, NONE, "", "Blocks the host tier holds.")                                        \
    X(host_cached_prompt_tokens, U64, NONE, "",                                                               \
      "Prompt tokens copied back from the host tier (part of cached_prompt_tokens).")                         \
    X(host_cache_stored, U64, NONE, "", "Blocks stored into the host tier.")                                  \
    X(host_cache_dropped, U64, NONE, "", "Blocks dropped from the host tier for room.")                       \
    X(host_cache_corrupt, U64, NONE, "", "Host tier blocks that failed their checksum: misses.")              \
    X(host_cache_declined, U64, NONE, "", "Blocks left to compute: restoring measured slower.")               \
    X(disk_cache_max_bytes, U64, NONE, "", "The disk tier's budget (--cache-dir); 0: none.")                  \
    X(disk_cache_bytes, U64, NONE, "", "Bytes of the disk tier's files.")                                     \
    X(disk_cache_blocks, U64, NONE, "", "Blocks on disk.")                                                    \
    X(disk_cached_prompt_tokens, U64, NONE, "",                                                               \
      "Prompt tokens read back from the disk tier (part of cached_prompt_tokens).")                           \
    X(disk_cache_written, U64, NONE, "", "Disk tier files written since start.")                              \
    X(disk_cache_pending, U64, NONE, "", "Disk tier writes queued now.")                                      \
    X(disk_cache_dropped_writes, U64, NONE, "", "Disk tier writes dropped (queue full or failed).")           \
    X(disk_cache_corrupt, U64, NONE, "", "Disk tier files that failed a check: removed, misses.")             \
    X(disk_cache_ignored, U64, NONE, "", "Files of another model or layout found at start.")                  \
    X(disk_cache_declined, U64, NONE, "", "Blocks left to compute: reading measured slower.")                 \
    X(auth_clients_admitted, U64, COUNTER, "kvd_auth_clients_admitted_total",                                 \
      "Client connections admitted by CURVE key.")                                                            \
    X(auth_clients_refused, U64, COUNTER, "kvd_auth_clients_refused_total",                                   \
      "Client connections refused: a key not allowed.")                                                       \
    X(auth_workers_refused, U64, COUNTER, "kvd_auth_workers_refused_total",                                   \
      "Worker connections refused: a key not allowed.")                                                       \
    X(auth_handshakes_failed, U64, COUNTER, "kvd_auth_handshakes_failed_total",                               \
      "Handshakes failed before a key was checked (plain text, a wrong server key).")                         \
    X(auth_client_keys, U32, NONE, "", "Client keys allowed now (--clients-allow).")                          \
    X(evictions, U64, COUNTER, "kvd_evictions_total", "Cached blocks evicted.")                               \
    X(preemptions, U64, COUNTER, "vllm:num_preemptions_total", "Requests preempted for KV memory.")           \
    X(bad_messages, U64, COUNTER, "kvd_bad_messages_total", "Malformed messages refused.")                    \
    X(finished_stop, U64, NONE, "", "Requests done: a stop (vllm:request_success_total).")                    \
    X(finished_length, U64, NONE, "", "Requests done: their length (vllm:request_success_total).")            \
    X(finished_abort, U64, NONE, "", "Requests cancelled, past a deadline, or failed.")                       \
    X(hosts_lost, U64, NONE, "", "Other hosts' pools dropped: their last worker was lost.")                   \
    X(blocks_fenced_total, U64, NONE, "", "Blocks held back after other hosts' workers were lost.")           \
    X(cache_creation_tokens, U64, COUNTER, "kvd_cache_creation_tokens_total",                                 \
      "Prompt tokens computed and written to the cache.")                                                     \
    X(pins, U32, GAUGE, "kvd_pins", "Pinned prefixes.")                                                       \
    X(pinned_blocks, U32, GAUGE, "kvd_pinned_blocks", "KV blocks pinned prefixes hold.")                      \
    X(pins_expired, U64, COUNTER, "kvd_pins_expired_total", "Pins that reached their TTL.")                   \
    X(pins_refused, U64, COUNTER, "kvd_pins_refused_total", "Pins refused or not taken.")                     \
    X(kv_event_batches, U64, NONE, "", "--kv-events batches sent.")

/* WorkerStats: a worker process (Prometheus rows labelled worker="id"). */
#define KVD_WORKER_STATS_FIELDS(X)                                                                            \
    X(id, U32, NONE, "", "The worker's number.")                                                              \
    X(pid, I32, NONE, "", "Its process id.")                                                                  \
    X(alive, BOOL, NONE, "", "Whether it runs now.")                                                          \
    X(running, U32, GAUGE, "kvd_worker_running", "Requests running on a worker.")                             \
    X(tokens, U64, NONE, "", "Tokens it computed (prompt and generated).")                                    \
    X(restarts, U32, COUNTER, "kvd_worker_restarts_total", "Restarts of a worker.")                           \
    X(host, STR64, NONE, "", "The host whose pool it computes into (\"\" for kvd's own).")

/* HostStats: a pool kvd dispatches to, its own (name "") or another host's
 * (Prometheus rows labelled host="name", written when there are several). */
#define KVD_HOST_STATS_FIELDS(X)                                                                              \
    X(name, STR64, NONE, "", "The host (kvd-worker --host NAME); \"\" for kvd's own pool.")                   \
    X(workers, U32, GAUGE, "kvd_host_workers", "Workers alive on a host (\"\": kvd's own pool).")             \
    X(blocks_total, U32, NONE, "", "KV blocks of its pool.")                                                  \
    X(blocks_free, U32, GAUGE, "kvd_host_blocks_free", "Free KV blocks of a host's pool.")                    \
    X(blocks_cached, U32, GAUGE, "kvd_host_blocks_cached", "Cached KV blocks of a host's pool.")              \
    X(blocks_in_use, U32, NONE, "", "KV blocks of its pool held by requests.")                                \
    X(requests, U64, COUNTER, "kvd_host_requests_total", "Requests dispatched to a host.")                    \
    X(prompt_tokens, U64, COUNTER, "kvd_host_prompt_tokens_total",                                            \
      "Prompt tokens of the requests dispatched to a host.")                                                  \
    X(cached_prompt_tokens, U64, COUNTER, "kvd_host_cached_prompt_tokens_total",                              \
      "Of them, found in the host's pool.")                                                                   \
    X(blocks_fenced, U32, NONE, "", "Blocks held after a worker there was lost, until it surely stopped.")

/* TenantStats: a tenant, a CURVE client's key name or an HTTP API key's
 * tenant (Prometheus rows labelled tenant="name"). */
#define KVD_TENANT_STATS_FIELDS(X)                                                                            \
    X(name, STR128, NONE, "", "The tenant.")                                                                  \
    X(requests, U64, COUNTER, "kvd_tenant_requests_total", "A tenant's generate requests.")                   \
    X(prompt_tokens, U64, COUNTER, "kvd_tenant_prompt_tokens_total", "A tenant's prompt tokens.")             \
    X(cached_prompt_tokens, U64, COUNTER, "kvd_tenant_cached_prompt_tokens_total",                            \
      "A tenant's prompt tokens found in the cache.")                                                         \
    X(queued, U32, GAUGE, "kvd_tenant_requests_waiting", "A tenant's requests waiting.")                      \
    X(running, U32, GAUGE, "kvd_tenant_requests_running", "A tenant's requests running.")                     \
    X(blocks_held, U64, GAUGE, "kvd_tenant_blocks", "KV blocks a tenant holds (in use, pending and cached).") \
    X(refused, U64, COUNTER, "kvd_tenant_refused_total", "A tenant's requests refused: its queue was full.")  \
    X(cache_creation_tokens, U64, COUNTER, "kvd_tenant_cache_creation_tokens_total",                          \
      "A tenant's prompt tokens written to the cache.")                                                       \
    X(pins, U32, GAUGE, "kvd_tenant_pins", "A tenant's pinned prefixes.")                                     \
    X(pinned_blocks, U32, GAUGE, "kvd_tenant_pinned_blocks", "KV blocks a tenant's pins hold.")

#endif
