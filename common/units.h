/*
 * units.h - sizes as people write them ("2GiB", "512M", "1.5G") and back.
 */
#ifndef KVD_UNITS_H
#define KVD_UNITS_H

#include <stddef.h>
#include <stdint.h>

/* Parses a byte count: a number (fractions allowed) with an optional suffix
 * K, M, G, T (powers of 1024; "KiB", "MiB", ... and "KB", "MB", ... too, the
 * latter as powers of 1000) or B. 0 and *out, or KVD_EINVAL for anything else,
 * a negative value, or one past 2^63. */
int kvd_parse_size(const char *s, uint64_t *out);

/* Writes bytes as "1.50 GiB" / "23.0 KiB" / "512 B" into buf; returns buf. */
char *kvd_format_bytes(uint64_t bytes, char *buf, size_t len);

#endif
