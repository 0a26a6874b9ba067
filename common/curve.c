/* curve.c - CURVE certificate files (curve.h). */
#include "curve.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "err.h"

bool curve_key_ok(const char *s)
{
    static const char alphabet[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
    if (s == NULL || strlen(s) != CURVE_KEY_Z85)
        return false;
    for (size_t i = 0; i < CURVE_KEY_Z85; i++)
        if (strchr(alphabet, s[i]) == NULL)
            return false;
    uint8_t raw[32];
    return zmq_z85_decode(raw, s) != NULL;
}

/* The value of `name = "VALUE"` on line (leading blanks allowed) into out. */
static bool key_line(const char *line, const char *name, char out[CURVE_KEY_Z85 + 1])
{
    while (*line == ' ' || *line == '\t')
        line++;
    const size_t n = strlen(name);
    if (strncmp(line, name, n) != 0)
        return false;
    line += n;
    while (*line == ' ' || *line == '\t')
        line++;
    if (*line++ != '=')
        return false;
    while (*line == ' ' || *line == '\t')
        line++;
    if (*line++ != '"')
        return false;
    const char *end = strchr(line, '"');
    if (end == NULL || end - line != CURVE_KEY_Z85)
        return false;
    memcpy(out, line, CURVE_KEY_Z85);
    out[CURVE_KEY_Z85] = '\0';
    return true;
}

int curve_cert_read(const char *path, bool need_secret, struct curve_cert *c, char *err, size_t errlen)
{
    memset(c, 0, sizeof(*c));
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return kvd_seterr(err, errlen, KVD_EIO, "%s: %s", path, strerror(errno));
    char line[512];
    int n_lines = 0;
    bool bare = false;
    while (fgets(line, sizeof(line), f) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        if (line[0] == '#' || line[0] == '\0')
            continue;
        n_lines++;
        char tmp[CURVE_KEY_Z85 + 1];
        if (key_line(line, "public-key", tmp)) {
            memcpy(c->public_key, tmp, sizeof(tmp));
        } else if (key_line(line, "secret-key", tmp)) {
            memcpy(c->secret_key, tmp, sizeof(tmp));
        } else if (n_lines == 1 && strlen(line) == CURVE_KEY_Z85) {
            memcpy(c->public_key, line, CURVE_KEY_Z85 + 1);     /* a bare key */
            bare = true;
        }
    }
    fclose(f);
    if (!curve_key_ok(c->public_key) || (bare && n_lines != 1))
        return kvd_seterr(err, errlen, KVD_EFORMAT, "%s: no valid public-key (want a certificate from "
                          "kvd-keygen, or a 40-character Z85 key)", path);
    if (c->secret_key[0] != '\0' && !curve_key_ok(c->secret_key))
        return kvd_seterr(err, errlen, KVD_EFORMAT, "%s: the secret-key is not a valid Z85 key", path);
    if (need_secret && c->secret_key[0] == '\0')
        return kvd_seterr(err, errlen, KVD_EFORMAT, "%s: no secret-key (this is a public certificate; "
                          "kvd-keygen writes the secret one as NAME.key_secret)", path);
    if (c->secret_key[0] != '\0') {
        /* the pair must belong together */
        char derived[CURVE_KEY_Z85 + 1];
        if (zmq_curve_public(derived, c->secret_key) != 0 || strcmp(derived, c->public_key) != 0)
            return kvd_seterr(err, errlen, KVD_EFORMAT, "%s: the public-key does not belong to the secret-key",
                              path);
    }
    return 0;
}

int curve_cert_write(const char *path, const struct curve_cert *c, bool with_secret, char *err,
                     size_t errlen)
{
    char tmp[4200];
    if ((size_t)snprintf(tmp, sizeof(tmp), "%s.tmp-%d", path, (int)getpid()) >= sizeof(tmp))
        return kvd_seterr(err, errlen, KVD_EIO, "%s: path too long", path);
    const int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, with_secret ? 0600 : 0644);
    if (fd < 0)
        return kvd_seterr(err, errlen, KVD_EIO, "%s: %s", tmp, strerror(errno));
    FILE *f = fdopen(fd, "w");
    if (f == NULL) {
        close(fd);
        unlink(tmp);
        return kvd_seterr(err, errlen, KVD_EIO, "%s: %s", tmp, strerror(errno));
    }
    fprintf(f, "#   kvd-keygen: a CURVE %s certificate%s\n", with_secret ? "secret" : "public",
            with_secret ? " (keep it private: it is who you are)" : " (give it to the other side)");
    fprintf(f, "metadata\ncurve\n    public-key = \"%s\"\n", c->public_key);
    if (with_secret)
        fprintf(f, "    secret-key = \"%s\"\n", c->secret_key);
    const bool ok = fflush(f) == 0 && fsync(fd) == 0;
    if (fclose(f) != 0 || !ok || rename(tmp, path) != 0) {
        const int e = errno;
        unlink(tmp);
        return kvd_seterr(err, errlen, KVD_EIO, "%s: %s", path, strerror(e));
    }
    return 0;
}

int curve_keypair(struct curve_cert *c, char *err, size_t errlen)
{
    memset(c, 0, sizeof(*c));
    if (!zmq_has("curve") || zmq_curve_keypair(c->public_key, c->secret_key) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "this ZeroMQ was built without CURVE");
    return 0;
}

int curve_public_key_arg(const char *arg, char out[CURVE_KEY_Z85 + 1], char *err, size_t errlen)
{
    if (curve_key_ok(arg) && access(arg, F_OK) != 0) {
        memcpy(out, arg, CURVE_KEY_Z85 + 1);
        return 0;
    }
    struct curve_cert c;
    const int rc = curve_cert_read(arg, false, &c, err, errlen);
    if (rc == 0)
        memcpy(out, c.public_key, CURVE_KEY_Z85 + 1);
    return rc;
}
