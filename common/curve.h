/*
 * curve.h - CurveZMQ keys as kvd keeps them: certificate files in ZeroMQ's
 * text format (what zcert writes), one key pair or one public key per file.
 *
 *     #   kvd-keygen: a CURVE secret certificate (keep it private)
 *     metadata
 *     curve
 *         public-key = "<40 Z85 characters>"
 *         secret-key = "<40 Z85 characters>"
 *
 * A public certificate has no secret-key line. kvd-keygen NAME writes
 * NAME.key (public, to hand to the other side) and NAME.key_secret (0600).
 * An allow directory holds one public certificate per peer; the file's name
 * less ".key" names the peer (a client's tenant).
 */
#ifndef KVD_CURVE_H
#define KVD_CURVE_H

#include <stdbool.h>
#include <stddef.h>

#define CURVE_KEY_Z85 40        /* characters of a key in Z85 */

struct curve_cert {
    char public_key[CURVE_KEY_Z85 + 1];
    char secret_key[CURVE_KEY_Z85 + 1];     /* "" in a public certificate */
};

/* Whether s is a well-formed Z85 key (40 characters of the alphabet). */
bool curve_key_ok(const char *s);

/* Reads a certificate file (or a file holding a bare Z85 public key on one
 * line). 0, or KVD_EIO / KVD_EFORMAT with the reason. need_secret: a file
 * without a secret key is KVD_EFORMAT. */
int curve_cert_read(const char *path, bool need_secret, struct curve_cert *c, char *err, size_t errlen);

/* Writes c to path (its secret key too when with_secret), mode 0600 with a
 * secret and 0644 without, replacing any file there atomically. 0, or
 * KVD_EIO with the reason. */
int curve_cert_write(const char *path, const struct curve_cert *c, bool with_secret, char *err,
                     size_t errlen);

/* A new key pair (zmq_curve_keypair). 0, or KVD_EUNSUPPORTED when this
 * ZeroMQ has no CURVE. */
int curve_keypair(struct curve_cert *c, char *err, size_t errlen);

/* A server key given as a file (a certificate or a bare key) or as the 40
 * characters themselves: its public key into out. 0 or KVD_E* with the reason. */
int curve_public_key_arg(const char *arg, char out[CURVE_KEY_Z85 + 1], char *err, size_t errlen);

#endif
