/*
 * Preloaded into the engines areal starts (LD_PRELOAD): a bind() to the
 * wildcard address becomes a bind to loopback.
 *
 * SGLang and vLLM set up torch.distributed even for one process, and torch's
 * TCPStore server listens on every interface whatever host it is given (seen
 * as `*:<port>` from SGLang's scheduler). Neither engine has a flag for it.
 * An engine's only client is the data proxy beside it on the same node, so
 * nothing an engine opens needs to be reachable from elsewhere.
 *
 * IPv4 0.0.0.0 -> 127.0.0.1. IPv6 :: -> ::1 on a v6-only socket, else the
 * v4-mapped ::ffff:127.0.0.1, so the IPv4 clients of a dual-stack listener
 * (TCPStore connects to 127.0.0.1) still reach it. Any other address is left
 * as it was asked.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 &&
               len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            int v6only = 0;
            socklen_t l = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &l) == 0 && v6only) {
                a.sin6_addr = in6addr_loopback;
            } else {
                memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                a.sin6_addr.s6_addr[10] = 0xff;
                a.sin6_addr.s6_addr[11] = 0xff;
                a.sin6_addr.s6_addr[12] = 127;
                a.sin6_addr.s6_addr[15] = 1;
            }
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
