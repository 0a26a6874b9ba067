/* endpoint.c - the endpoint kvd and its clients meet on by default, and the
 * loopback check of the addresses kvd binds (endpoint.h). */
#include "endpoint.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

char *kvd_default_endpoint(char *buf, size_t len)
{
    if (buf == NULL || len == 0)
        return buf;
    const char *env = getenv("KVD_ENDPOINT");
    if (env != NULL && env[0] != '\0') {
        snprintf(buf, len, "%s", env);
        return buf;
    }
    /* the XDG spec says to ignore a relative XDG_RUNTIME_DIR */
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (xdg != NULL && xdg[0] == '/') {
        size_t n = strlen(xdg);
        while (n > 1 && xdg[n - 1] == '/')
            n--;
        snprintf(buf, len, "ipc://%.*s/kvd/kvd.sock", (int)n, xdg);
    } else {
        snprintf(buf, len, "ipc:///tmp/kvd-%u/kvd.sock", (unsigned)getuid());
    }
    return buf;
}

/* Whether sa is a loopback address (127/8, ::1, or 127/8 mapped into IPv6). */
static bool sockaddr_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a))
            return true;
        return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
    }
    return false;
}

/* An interface's name: 1 when it is the loopback interface, 0 when another,
 * -1 when no interface has that name. */
static int interface_loopback(const char *name)
{
    if (if_nametoindex(name) == 0)
        return -1;
    struct ifaddrs *all;
    if (getifaddrs(&all) != 0)
        return 0;   /* it exists, but cannot be told: not loopback */
    int rc = 0;
    for (const struct ifaddrs *i = all; i != NULL; i = i->ifa_next)
        if (i->ifa_name != NULL && strcmp(i->ifa_name, name) == 0 && (i->ifa_flags & IFF_LOOPBACK))
            rc = 1;
    freeifaddrs(all);
    return rc;
}

int endpoint_loopback(const char *hostport, char *why, size_t whylen)
{
    char host[256];
    const char *hp = strncmp(hostport, "tcp://", 6) == 0 ? hostport + 6 : hostport;
    const char *end;
    if (hp[0] == '[') {             /* [v6]:port */
        end = strchr(hp, ']');
        if (end == NULL || end[1] != ':') {
            snprintf(why, whylen, "%s: want [ADDRESS]:PORT", hostport);
            return -1;
        }
        hp++;
    } else {
        end = strrchr(hp, ':');
        if (end == NULL) {
            snprintf(why, whylen, "%s: want HOST:PORT", hostport);
            return -1;
        }
    }
    const size_t n = (size_t)(end - hp);
    if (n == 0 || n >= sizeof(host)) {
        snprintf(why, whylen, "%s: no host before the port", hostport);
        return -1;
    }
    memcpy(host, hp, n);
    host[n] = '\0';
    if (strcmp(host, "*") == 0) {
        snprintf(why, whylen, "%s binds every interface", hostport);
        return 0;
    }
    const int nic = interface_loopback(host);
    if (nic >= 0) {
        if (nic == 0)
            snprintf(why, whylen, "%s binds interface %s, which is not the loopback one", hostport, host);
        return nic;
    }
    struct addrinfo hints, *res;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const int gai = getaddrinfo(host, NULL, &hints, &res);
    if (gai != 0) {
        snprintf(why, whylen, "%s: cannot resolve %s: %s", hostport, host, gai_strerror(gai));
        return -1;
    }
    int rc = 1;
    for (const struct addrinfo *a = res; a != NULL && rc == 1; a = a->ai_next)
        if (!sockaddr_loopback(a->ai_addr)) {
            char addr[INET6_ADDRSTRLEN] = "?";
            const void *raw = a->ai_family == AF_INET ? (const void *)&((struct sockaddr_in *)a->ai_addr)->sin_addr
                                                      : (const void *)&((struct sockaddr_in6 *)a->ai_addr)->sin6_addr;
            inet_ntop(a->ai_family, raw, addr, sizeof(addr));
            snprintf(why, whylen, "%s binds %s%s", hostport, addr,
                     strcmp(addr, "0.0.0.0") == 0 || strcmp(addr, "::") == 0 ? " (every interface)"
                                                                           : ", not a loopback address");
            rc = 0;
        }
    freeaddrinfo(res);
    return rc;
}
