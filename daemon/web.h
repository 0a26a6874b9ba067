/*
 * web.h - the page kvd --http serves at / (web/: HTML, CSS and JavaScript),
 * carried in the binary: cmake/embed_web.cmake turns each file into an array
 * at build time. index.html is served at "/", every other file at
 * "/web/NAME". No file loads anything from elsewhere.
 */
#ifndef KVD_WEB_H
#define KVD_WEB_H

#include <stddef.h>

struct web_asset {
    const char *path;               /* "/" or "/web/NAME" */
    const char *type;               /* its Content-Type */
    const unsigned char *data;      /* len bytes (and a NUL) */
    size_t len;
};

/* Every file, then an entry whose path is NULL. */
extern const struct web_asset web_assets[];

#endif
