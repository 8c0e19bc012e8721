/* The `cc-server` command's fast path: hand `run` to the user's CLI daemon without starting
 * Python (src/cc_server/cli_client.py does the same in Python, and is what this program runs for
 * everything else).
 *
 * scripts/bootstrap builds it with the checkout's package directory (CC_PACKAGE) and the venv's
 * interpreter (CC_PYTHON), and installs it as the venv's `cc-server`. For a plain `run` whose
 * daemon already listens, it finds the daemon's socket as cli_socket.daemon_socket_path does
 * (the private runtime directory, the same key over the same facts), sends it the arguments, the
 * working directory and the environment variables `run` reads, with its own stdin, stdout and
 * stderr (SCM_RIGHTS), passes SIGINT, SIGTERM and SIGHUP on, and exits with the code the daemon
 * answers. Anything else (another verb, `--help`, `--events`, `--ask`, CC_SERVER_DAEMON=off, no
 * daemon yet, a runtime directory that is not there or not private, an argument that is not
 * UTF-8, a kernel without SO_PEERPIDFD) execs the Python entry point with the same arguments,
 * which starts the daemon, runs in its own process or says what is wrong. If the interpreter
 * cannot be started, the command does not run: a message and exit code 125.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#if !defined(CC_PACKAGE) || !defined(CC_PYTHON)
#error "build with -DCC_PACKAGE=\"<checkout>/src/cc_server\" -DCC_PYTHON=\"<venv>/bin/python\""
#endif

#define EXIT_REFUSED 125
#define MAX_MESSAGE (1u << 20) /* cli_socket.MAX_MESSAGE_BYTES */
#define SO_PEERPIDFD_ 77

extern char **environ;

/* cli_socket.KEYED_ENV, in its order; cli_client.SENT_ENV (LC_* as well). */
static const char *const KEYED_ENV[] = {"HOME", "PATH", "XDG_RUNTIME_DIR", "TMPDIR",
                                        "XDG_CONFIG_HOME", "XDG_CACHE_HOME",
                                        "CC_SERVER_MICROVM_CACHE"};
static const char *const SENT_ENV[] = {"TERM", "COLORTERM", "NO_COLOR", "LANG", "LANGUAGE", "TZ"};
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static char **saved_argv;

/* The Python entry point, with this program's arguments: the only way out when the fast path
 * does not apply. -P: the working directory is not put on sys.path. */
static _Noreturn void python(void) {
    int argc = 0;
    while (saved_argv[argc]) argc++;
    char **argv = calloc((size_t)argc + 4, sizeof(char *));
    if (argv) {
        argv[0] = CC_PYTHON;
        argv[1] = "-P";
        argv[2] = "-c";
        argv[3] = "import sys; from cc_server.cli_client import main; sys.exit(main())";
        for (int i = 1; i < argc; i++) argv[3 + i] = saved_argv[i];
        execv(CC_PYTHON, argv);
    }
    fprintf(stderr, "cc-server: cannot start %s: %s (run scripts/bootstrap again)\n", CC_PYTHON,
            strerror(errno));
    exit(EXIT_REFUSED);
}

/* A growing buffer; out of memory means the Python path. */
struct buf {
    char *data;
    size_t len, cap;
};

static void put(struct buf *b, const void *data, size_t len) {
    if (b->len + len + 1 > b->cap) {
        size_t cap = (b->len + len + 1) * 2;
        char *grown = realloc(b->data, cap);
        if (!grown) python();
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, data, len);
    b->len += len;
    b->data[b->len] = '\0';
}

static void puts_(struct buf *b, const char *s) { put(b, s, strlen(s)); }

static void putf(struct buf *b, const char *fmt, ...) {
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) python();
    put(b, tmp, (size_t)n);
}

/* --- the daemon's key (cli_socket._key): CRC-32 and Adler-32 of the build and host facts --- */

static uint32_t crc, adler = 1;

static void digest(const char *data, size_t len) {
    const unsigned char *p = (const unsigned char *)data;
    uint32_t c = ~crc, a = adler & 0xffff, s = adler >> 16;
    for (size_t i = 0; i < len; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1)));
        a = (a + p[i]) % 65521;
        s = (s + a) % 65521;
    }
    crc = ~c;
    adler = (s << 16) | a;
}

static void digest_line(struct buf *line) {
    digest(line->data, line->len);
    line->len = 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int counted(const char *name) {
    size_t n = strlen(name);
    static const char *const ends[] = {".py", ".so", ".toml", ".sb"};
    for (size_t i = 0; i < COUNT(ends); i++) {
        size_t e = strlen(ends[i]);
        if (n >= e && strcmp(name + n - e, ends[i]) == 0) return 1;
    }
    return strstr(name, "launcher") != NULL;
}

/* os.walk(root) top-down: this directory's files (sorted), then each subdirectory (sorted,
 * __pycache__ left out, a symlink to a directory not entered). */
static void walk(const char *root, int depth) {
    if (depth > 32) python();
    DIR *dir = opendir(root);
    if (!dir) python();
    char **dirs = NULL, **files = NULL;
    size_t ndirs = 0, nfiles = 0;
    struct dirent *entry;
    while ((entry = readdir(dir))) {
        const char *name = entry->d_name;
        if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0) continue;
        char path[PATH_MAX];
        if ((size_t)snprintf(path, sizeof path, "%s/%s", root, name) >= sizeof path) python();
        struct stat st;
        int is_dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
        char ***list = is_dir ? &dirs : &files;
        size_t *n = is_dir ? &ndirs : &nfiles;
        if (is_dir && strcmp(name, "__pycache__") == 0) continue;
        if (!is_dir && !counted(name)) continue;
        char **grown = realloc(*list, (*n + 1) * sizeof(char *));
        if (!grown || !(grown[*n] = strdup(name))) python();
        *list = grown;
        (*n)++;
    }
    closedir(dir);
    qsort(files, nfiles, sizeof(char *), by_name);
    qsort(dirs, ndirs, sizeof(char *), by_name);
    struct buf line = {0};
    for (size_t i = 0; i < nfiles; i++) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", root, files[i]);
        struct stat st;
        if (stat(path, &st) != 0) python(); /* as os.stat raises there */
        long long ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
        puts_(&line, path);
        putf(&line, ":%lld:%lld\n", ns, (long long)st.st_size);
        digest_line(&line);
        free(files[i]);
    }
    for (size_t i = 0; i < ndirs; i++) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", root, dirs[i]);
        struct stat st;
        if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) walk(path, depth + 1);
        free(dirs[i]);
    }
    free(line.data);
    free(files);
    free(dirs);
}

static void key(char out[17]) {
    char package[PATH_MAX], python_path[PATH_MAX];
    if (!realpath(CC_PACKAGE, package) || !realpath(CC_PYTHON, python_path)) python();
    walk(package, 0);
    struct stat st;
    if (stat(python_path, &st) != 0) python();
    struct buf line = {0};
    puts_(&line, python_path);
    putf(&line, "\n%lld:%lld\n%u\n",
         (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec,
         (long long)st.st_size, (unsigned)geteuid());
    for (size_t i = 0; i < COUNT(KEYED_ENV); i++) {
        const char *value = getenv(KEYED_ENV[i]);
        puts_(&line, KEYED_ENV[i]);
        puts_(&line, "=");
        puts_(&line, value ? value : "");
        puts_(&line, "\n");
    }
    digest_line(&line);
    free(line.data);
    snprintf(out, 17, "%08x%08x", crc, adler);
}

/* --- where the daemon listens (rundir.egress_base_dir, for a directory that exists) --- */

static int private_dir(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() &&
           (st.st_mode & 077) == 0;
}

static void socket_path(char *out, size_t size) {
    char base[PATH_MAX];
    const char *runtime = getenv("XDG_RUNTIME_DIR");
    struct stat st;
    if (runtime && runtime[0] == '/' && stat(runtime, &st) == 0 && S_ISDIR(st.st_mode)) {
        snprintf(base, sizeof base, "%s/cc-server", runtime);
    } else {
        /* tempfile.gettempdir() looks at these first; only the plain /tmp is done here. */
        if (getenv("TMPDIR") || getenv("TEMP") || getenv("TMP")) python();
        snprintf(base, sizeof base, "/tmp/cc-server-%u", (unsigned)geteuid());
    }
    if (!private_dir(base)) python(); /* absent, or not ours: Python makes it or says so */
    char k[17];
    key(k);
    if ((size_t)snprintf(out, size, "%s/cli-%s.sock", base, k) >= size) python();
}

/* --- the request --- */

/* A JSON string; text that is not UTF-8 goes the Python way (it has surrogateescape). */
static void json_string(struct buf *b, const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    puts_(b, "\"");
    while (*p) {
        unsigned char c = *p;
        size_t n = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3
                   : (c & 0xf8) == 0xf0 ? 4 : 0;
        if (n == 0 || (n == 2 && c < 0xc2) || (n == 4 && c > 0xf4)) python();
        for (size_t i = 1; i < n; i++)
            if ((p[i] & 0xc0) != 0x80) python();
        if (n == 3 && ((c == 0xe0 && p[1] < 0xa0) || (c == 0xed && p[1] >= 0xa0))) python();
        if (n == 4 && ((c == 0xf0 && p[1] < 0x90) || (c == 0xf4 && p[1] >= 0x90))) python();
        if (c == '"' || c == '\\') {
            put(b, "\\", 1);
            put(b, p, 1);
        } else if (c < 0x20 || c == 0x7f) {
            putf(b, "\\u%04x", c);
        } else {
            put(b, p, n);
        }
        p += n;
    }
    puts_(b, "\"");
}

static int sent(const char *entry) {
    if (strncmp(entry, "LC_", 3) == 0) return 1;
    for (size_t i = 0; i < COUNT(SENT_ENV); i++) {
        size_t n = strlen(SENT_ENV[i]);
        if (strncmp(entry, SENT_ENV[i], n) == 0 && entry[n] == '=') return 1;
    }
    return 0;
}

static void request(struct buf *b, int argc, char **argv) {
    char cwd[PATH_MAX];
    if (!getcwd(cwd, sizeof cwd)) python();
    puts_(b, "{\"argv\": [");
    for (int i = 1; i < argc; i++) {
        if (i > 1) puts_(b, ", ");
        json_string(b, argv[i]);
    }
    puts_(b, "], \"cwd\": ");
    json_string(b, cwd);
    puts_(b, ", \"env\": {");
    int first = 1;
    for (char **e = environ; *e; e++) {
        char *eq = strchr(*e, '=');
        if (!eq || !sent(*e)) continue;
        char name[256];
        size_t n = (size_t)(eq - *e);
        if (n >= sizeof name) python();
        memcpy(name, *e, n);
        name[n] = '\0';
        if (getenv(name) != eq + 1) continue; /* a duplicate: os.environ keeps the first */
        if (!first) puts_(b, ", ");
        first = 0;
        json_string(b, name);
        puts_(b, ": ");
        json_string(b, eq + 1);
    }
    puts_(b, "}}");
}

/* Whether cli_client._eligible would hand this command line to the daemon. */
static int eligible(int argc, char **argv) {
    const char *daemon = getenv("CC_SERVER_DAEMON");
    if (argc < 2 || strcmp(argv[1], "run") != 0 || (daemon && strcmp(daemon, "off") == 0))
        return 0;
    static const char *const not_served[] = {"--help", "--events", "--ask"};
    for (int i = 2; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--") == 0) break;
        if (strcmp(arg, "-h") == 0) return 0;
        /* argparse takes a long option's unique prefix too ("--ev" for "--events"). */
        size_t name = strcspn(arg, "=");
        for (size_t k = 0; k < COUNT(not_served); k++)
            if (name > 3 && name <= strlen(not_served[k]) &&
                strncmp(not_served[k], arg, name) == 0)
                return 0;
    }
    /* backends/peer.supported: the daemon identifies its peers by pidfd. */
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) return 0;
    int pidfd = -1;
    socklen_t len = sizeof pidfd;
    int ok = getsockopt(pair[0], SOL_SOCKET, SO_PEERPIDFD_, &pidfd, &len) == 0;
    if (ok) close(pidfd);
    close(pair[0]);
    close(pair[1]);
    return ok;
}

/* --- talking to the daemon --- */

static int sock = -1;

static int send_all(const char *data, size_t len) {
    while (len > 0) {
        ssize_t n = send(sock, data, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* {"signal": N}, framed: sent from the handler (only async-signal-safe calls: send). */
static void forward(int signum) {
    int saved = errno;
    static const char head[] = "{\"signal\": ";
    char msg[32], digits[8];
    size_t n = 0, d = 0;
    unsigned value = (unsigned)signum;
    do digits[d++] = (char)('0' + value % 10);
    while ((value /= 10) && d < sizeof digits);
    memcpy(msg + 4, head, sizeof head - 1);
    n = sizeof head - 1;
    while (d) msg[4 + n++] = digits[--d];
    msg[4 + n++] = '}';
    uint32_t size = htonl((uint32_t)n);
    memcpy(msg, &size, 4);
    (void)send_all(msg, n + 4);
    errno = saved;
}

static int recv_all(char *data, size_t len) {
    while (len > 0) {
        ssize_t n = recv(sock, data, len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

static _Noreturn void gone(void) {
    fprintf(stderr, "cc-server: the CLI daemon went away; the command's fate is unknown "
                    "(set CC_SERVER_DAEMON=off to run without it)\n");
    exit(EXIT_REFUSED);
}

int main(int argc, char **argv) {
    saved_argv = argv;
    if (!eligible(argc, argv)) python();
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    socket_path(path, sizeof path);
    struct buf body = {0};
    request(&body, argc, argv);
    if (body.len > MAX_MESSAGE) python();

    sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, path, strlen(path) + 1);
    if (sock < 0 || connect(sock, (struct sockaddr *)&addr, sizeof addr) != 0) {
        if (sock >= 0) close(sock);
        python(); /* no daemon listens: the Python client starts one */
    }

    /* The request, with fds 0, 1 and 2 on its first byte; signals wait until it is out. */
    sigset_t forwarded, previous;
    sigemptyset(&forwarded);
    sigaddset(&forwarded, SIGINT);
    sigaddset(&forwarded, SIGTERM);
    sigaddset(&forwarded, SIGHUP);
    sigprocmask(SIG_BLOCK, &forwarded, &previous);
    struct buf frame = {0};
    uint32_t size = htonl((uint32_t)body.len);
    put(&frame, &size, 4);
    put(&frame, body.data, body.len);
    int fds[3] = {0, 1, 2};
    char control[CMSG_SPACE(sizeof fds)] = {0};
    struct iovec iov = {.iov_base = frame.data, .iov_len = frame.len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(cmsg), fds, sizeof fds);
    ssize_t n;
    do n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n < 0) gone();
    if ((size_t)n < frame.len && send_all(frame.data + n, frame.len - (size_t)n) != 0) gone();
    struct sigaction action = {.sa_handler = forward};
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, NULL);
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGHUP, &action, NULL);
    sigprocmask(SIG_SETMASK, &previous, NULL);

    /* Replies until {"exit": N}. */
    for (;;) {
        uint32_t header;
        if (recv_all((char *)&header, 4) != 0) gone();
        uint32_t len = ntohl(header);
        if (len > MAX_MESSAGE) gone();
        char *reply = malloc((size_t)len + 1);
        if (!reply || recv_all(reply, len) != 0) gone();
        reply[len] = '\0';
        const char *exit_key = strstr(reply, "\"exit\":");
        if (exit_key) {
            char *end;
            long code = strtol(exit_key + 7, &end, 10);
            if (end == exit_key + 7) gone();
            return (int)(code & 0xff);
        }
        free(reply);
    }
}
