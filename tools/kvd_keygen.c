/*
 * kvd_keygen.c - kvd-keygen: CURVE key pairs for kvd, its clients and its
 * remote workers, in ZeroMQ's certificate format (common/curve.h).
 *
 *     kvd-keygen [--dir DIR] NAME
 *
 * writes DIR/NAME.key (the public certificate: give it to the other side,
 * e.g. into kvd's --clients-allow directory, where NAME becomes the client's
 * tenant) and DIR/NAME.key_secret (the secret one, mode 0600: kvd's
 * --curve-secret, a client's KVD_CURVE_CERT). An existing file is not
 * overwritten unless --force is given.
 */
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "curve.h"
#include "err.h"

static void usage(FILE *f)
{
    fputs("usage: kvd-keygen [--dir DIR] [--force] NAME\n"
          "\n"
          "Writes a CURVE key pair: DIR/NAME.key (public: hand it to the other side; in\n"
          "kvd's --clients-allow directory NAME is the client's tenant) and DIR/NAME.key_secret\n"
          "(secret, 0600: kvd's --curve-secret, or a client's KVD_CURVE_CERT). DIR defaults\n"
          "to the current directory. NAME: 1-64 of [A-Za-z0-9._-].\n",
          f);
}

int main(int argc, char **argv)
{
    static const struct option longs[] = {
        { "dir", required_argument, NULL, 'd' },
        { "force", no_argument, NULL, 'f' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    const char *dir = ".";
    bool force = false;
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":d:fh", longs, NULL)) != -1) {
        switch (c) {
        case 'd': dir = optarg; break;
        case 'f': force = true; break;
        case 'h': usage(stdout); return 0;
        case ':': cli_die("option %s needs a value", argv[optind - 1]);
        default: cli_die("unknown option %s (see --help)", argv[optind - 1]);
        }
    }
    if (optind != argc - 1) {
        usage(stderr);
        return 2;
    }
    const char *name = argv[optind];
    const size_t n = strlen(name);
    if (n == 0 || n > 64 || strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") != n)
        cli_die("NAME must be 1-64 of [A-Za-z0-9._-], got '%s'", name);
    char pub[4200], sec[4200], err[512];
    snprintf(pub, sizeof(pub), "%s/%s.key", dir, name);
    snprintf(sec, sizeof(sec), "%s/%s.key_secret", dir, name);
    if (!force && (access(pub, F_OK) == 0 || access(sec, F_OK) == 0))
        cli_die("%s or %s exists already (--force replaces them)", pub, sec);
    struct curve_cert cert;
    if (curve_keypair(&cert, err, sizeof(err)) != 0 || curve_cert_write(sec, &cert, true, err, sizeof(err)) != 0 ||
        curve_cert_write(pub, &cert, false, err, sizeof(err)) != 0)
        cli_die("%s", err);
    printf("%s\n%s\npublic key %s\n", pub, sec, cert.public_key);
    return 0;
}
