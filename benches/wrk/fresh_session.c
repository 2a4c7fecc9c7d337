/* Preloaded into wrk by benches/proxy.sh for the "new TLS connections" row: wrk reconnects with
 * SSL_clear, which keeps the last session, so every reconnection would offer it back and the
 * servers that take it skip the certificate signature. Dropping the session after each
 * SSL_clear makes every connection a full handshake, the same for every server. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

typedef struct ssl_st SSL;
typedef struct ssl_session_st SSL_SESSION;
int SSL_set_session(SSL *s, SSL_SESSION *session);

int SSL_clear(SSL *s) {
    static int (*real)(SSL *);
    if (real == NULL) real = (int (*)(SSL *))dlsym(RTLD_NEXT, "SSL_clear");
    int r = real(s);
    SSL_set_session(s, NULL);
    return r;
}
