/*
 * cc-identity: starts a sandbox of a root server as an unprivileged host identity.
 *
 *   cc-identity --uid U --gid G --stage DIR [--map SRC]... -- PROGRAM [ARG]...
 *   cc-identity --selftest U G
 *
 * Run by the server (as host root) in place of bubblewrap; it ends by exec'ing PROGRAM
 * (bubblewrap) as uid U and gid G with no supplementary groups, so no process of the sandbox is
 * host uid 0 and none holds a capability on the host. Before that, in a mount namespace of its
 * own (a slave of the host's, so it changes nothing the host sees):
 *
 *   1. DIR (an existing directory, /dev/shm) gets a fresh tmpfs;
 *   2. each SRC, the i-th --map (resolved with no symlink in it, its last component included:
 *      the planner passes real paths, and one that has become a symlink since is refused; a
 *      directory or a regular file), is cloned with every mount below it (open_tree) and
 *      idmapped (mount_setattr MOUNT_ATTR_IDMAP) so that its owner's uid and gid appear as U
 *      and G, then attached at DIR/i. A SRC below an earlier one is idmapped to that one's
 *      owner: what a command can move to a nested root's path keeps its own owner;
 *   3. the tmpfs at DIR is made read-only;
 *   4. stdin, stdout and stderr, where they are pipes, are given to U (give_pipes).
 *
 * Through DIR/i, the sandbox (as U) reads and writes SRC as its owner, and what it creates there
 * belongs on the host to that owner: a root server still writes root-owned checkouts as root, and
 * a checkout of uid 1000 as uid 1000. Files of other owners appear as the overflow uid (nobody).
 * U itself reaches SRC only through DIR/i: no directory above SRC needs to be searchable by U.
 *
 * Every failure exits 125 with one line on stderr, before PROGRAM runs (fail closed).
 * --selftest U G does steps 1-3 on a temporary directory of its own and exits 0 when an idmapped
 * mount works here (the probe runs it once).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/mount.h>
#include <linux/openat2.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXIT_SETUP 125
#define MAX_MAPS 256
#define MAX_OWNERS 16

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("cc-identity: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(EXIT_SETUP);
}

static unsigned long parse_id(const char *s, const char *what) {
    char *end = NULL;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || !end || *end || end == s || v == 0 || v >= 0xFFFFFFFFul)
        die("bad %s %s (a nonzero uid or gid)", what, s);
    return v;
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        die("open %s: %s", path, strerror(errno));
    size_t len = strlen(text);
    if (write(fd, text, len) != (ssize_t)len)
        die("write %s: %s", path, strerror(errno));
    close(fd);
}

/* A user namespace in which `owner` (uid) and `owner_gid` are U and G: an idmapped mount with it
 * shows the owner's files as U's. A child holds the namespace while its maps are written. */
static int make_userns(uid_t owner, gid_t owner_gid, uid_t u, gid_t g) {
    int ready[2], done[2];
    if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(done, O_CLOEXEC) < 0)
        die("pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        char c = 0;
        close(ready[0]);
        close(done[1]);
        if (unshare(CLONE_NEWUSER) < 0)
            _exit(1);
        if (write(ready[1], &c, 1) != 1)
            _exit(1);
        (void)!read(done[0], &c, 1);
        _exit(0);
    }
    close(ready[1]);
    close(done[0]);
    char c;
    if (read(ready[0], &c, 1) != 1)
        die("could not create a user namespace for an idmapped mount");
    char path[64], map[64];
    snprintf(path, sizeof path, "/proc/%d/uid_map", (int)pid);
    snprintf(map, sizeof map, "%u %u 1\n", (unsigned)owner, (unsigned)u);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/setgroups", (int)pid);
    write_file(path, "deny");
    snprintf(path, sizeof path, "/proc/%d/gid_map", (int)pid);
    snprintf(map, sizeof map, "%u %u 1\n", (unsigned)owner_gid, (unsigned)g);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0)
        die("open %s: %s", path, strerror(errno));
    close(done[1]);
    close(ready[0]);
    waitpid(pid, NULL, 0);
    return ns;
}

struct owner {
    uid_t uid;
    gid_t gid;
    int ns;
};
static struct owner owners[MAX_OWNERS];
static int nowners;

static int userns_for(uid_t uid, gid_t gid, uid_t u, gid_t g) {
    for (int i = 0; i < nowners; i++)
        if (owners[i].uid == uid && owners[i].gid == gid)
            return owners[i].ns;
    if (nowners == MAX_OWNERS)
        die("more than %d owners among the binds", MAX_OWNERS);
    owners[nowners] = (struct owner){uid, gid, make_userns(uid, gid, u, g)};
    return owners[nowners++].ns;
}

static void stage_tmpfs(const char *dir) {
    if (unshare(CLONE_NEWNS) < 0)
        die("unshare(CLONE_NEWNS): %s", strerror(errno));
    if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0)
        die("make / a slave mount: %s", strerror(errno));
    if (mount("cc-stage", dir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755") < 0)
        die("mount a tmpfs at %s: %s", dir, strerror(errno));
}

/* Whether `path` is `root` or below it. */
static int under(const char *path, const char *root) {
    size_t n = strlen(root);
    while (n > 1 && root[n - 1] == '/')
        n--;
    return strncmp(path, root, n) == 0 && (path[n] == '\0' || path[n] == '/');
}

/* Stage `src` idmapped so that `owner_uid`:`owner_gid` appear as U:G. */
static void stage_one(const char *dir, int index, const char *src, const struct stat *st,
                      int fd, uid_t owner_uid, gid_t owner_gid, uid_t u, gid_t g) {
    int tree = (int)syscall(SYS_open_tree, fd, "",
                            AT_EMPTY_PATH | OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
    if (tree < 0)
        die("clone the mounts at %s: %s", src, strerror(errno));
    struct mount_attr attr = {
        .attr_set = MOUNT_ATTR_IDMAP,
        .userns_fd = (unsigned long long)userns_for(owner_uid, owner_gid, u, g),
    };
    if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof attr) <
        0)
        die("idmap %s: %s (its filesystem, or one mounted below it, does not support idmapped "
            "mounts)",
            src, strerror(errno));
    char at[4096];
    snprintf(at, sizeof at, "%s/%d", dir, index);
    if (S_ISDIR(st->st_mode)) {
        if (mkdir(at, 0755) < 0)
            die("mkdir %s: %s", at, strerror(errno));
    } else {
        int f = open(at, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
        if (f < 0)
            die("create %s: %s", at, strerror(errno));
        close(f);
    }
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, at, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        die("attach %s at %s: %s", src, at, strerror(errno));
    close(tree);
}

/* Open a root to stage: no symlink anywhere in its path, the last component included (a
 * command may have left one where a nested bind's root was), and a directory or a file. */
static int open_root(const char *src, struct stat *st) {
    struct open_how how = {
        .flags = O_PATH | O_CLOEXEC | O_NOFOLLOW,
        .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    int fd = (int)syscall(SYS_openat2, AT_FDCWD, src, &how, sizeof how);
    if (fd < 0)
        die("bind %s: %s (a path of real directories, no symlink, is needed)", src,
            strerror(errno));
    if (fstat(fd, st) < 0)
        die("stat %s: %s", src, strerror(errno));
    if (!S_ISDIR(st->st_mode) && !S_ISREG(st->st_mode))
        die("bind %s is not a directory or a regular file (a symlink is never followed)", src);
    return fd;
}

/* Stage every root, shallowest first (the planner's order). A root below an earlier one takes
 * that one's owner for its idmap, not its own: a command can put another owner's directory at a
 * nested root's path between two launches, and it must stay that owner's there. */
static void stage_all(const char *dir, const char **maps, int nmaps, uid_t u, gid_t g) {
    struct stat sts[MAX_MAPS];
    for (int m = 0; m < nmaps; m++) {
        int fd = open_root(maps[m], &sts[m]);
        uid_t ou = sts[m].st_uid;
        gid_t og = sts[m].st_gid;
        size_t best = 0;
        for (int e = 0; e < m; e++) {
            size_t len = strlen(maps[e]);
            if (len > best && strcmp(maps[e], maps[m]) != 0 && under(maps[m], maps[e])) {
                best = len;
                ou = sts[e].st_uid;
                og = sts[e].st_gid;
            }
        }
        stage_one(dir, m, maps[m], &sts[m], fd, ou, og, u, g);
        close(fd);
    }
}

static void seal_stage(const char *dir) {
    if (mount(NULL, dir, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
              NULL) < 0)
        die("make %s read-only: %s", dir, strerror(errno));
}

static void become(uid_t u, gid_t g) {
    if (setgroups(0, NULL) < 0)
        die("setgroups: %s", strerror(errno));
    if (setresgid(g, g, g) < 0)
        die("setresgid(%u): %s", (unsigned)g, strerror(errno));
    if (setresuid(u, u, u) < 0)
        die("setresuid(%u): %s", (unsigned)u, strerror(errno));
    /* Check, do not trust: uid 0 cannot come back and no group is left. */
    if (getuid() != u || geteuid() != u || getgid() != g || getegid() != g ||
        getgroups(0, NULL) != 0 || setresuid(0, 0, 0) == 0)
        die("could not drop to uid %u gid %u", (unsigned)u, (unsigned)g);
}

/* The command's stdin, stdout and stderr, when they are pipes the server made (as root, mode
 * 0600): given to U, so that the command can reopen them by name (`echo > /dev/stderr` opens
 * /proc/self/fd/2, which checks the pipe's owner). Terminals and files are left as they are. */
static void give_pipes(uid_t u, gid_t g) {
    for (int fd = 0; fd <= 2; fd++) {
        char link[32], target[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0)
            continue;
        target[n] = '\0';
        if (strncmp(target, "pipe:[", 6) == 0 && fchown(fd, u, g) < 0)
            die("give stream %d to uid %u: %s", fd, (unsigned)u, strerror(errno));
    }
}

static int selftest(uid_t u, gid_t g) {
    /* Named by pid, so a probe after a killed one removes what it left (identity.py). */
    char tmpl[64];
    snprintf(tmpl, sizeof tmpl, "/tmp/cc-identity-selftest-%d-XXXXXX", (int)getpid());
    char *base = mkdtemp(tmpl);
    if (!base)
        die("mkdtemp: %s", strerror(errno));
    char stage[64], src[64];
    snprintf(stage, sizeof stage, "%s/stage", base);
    snprintf(src, sizeof src, "%s/src", base);
    if (chmod(base, 0711) < 0 || mkdir(stage, 0755) < 0 || mkdir(src, 0700) < 0)
        die("mkdir: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        stage_tmpfs(stage);
        const char *one[] = {src};
        stage_all(stage, one, 1, u, g);
        seal_stage(stage);
        become(u, g);
        char file[96];
        snprintf(file, sizeof file, "%s/0/probe", stage);
        int f = open(file, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
        if (f < 0)
            die("the sandbox identity cannot create a file in an idmapped bind: %s",
                strerror(errno));
        close(f);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    char file[96];
    snprintf(file, sizeof file, "%s/probe", src);
    struct stat st;
    int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 && lstat(file, &st) == 0 &&
             st.st_uid == getuid() && st.st_gid == getgid();
    unlink(file);
    rmdir(src);
    rmdir(stage);
    rmdir(base);
    if (!ok && WIFEXITED(status) && WEXITSTATUS(status) == 0)
        die("a file created through an idmapped bind did not belong to the bind's owner");
    return ok ? 0 : EXIT_SETUP;
}

int main(int argc, char **argv) {
    if (geteuid() != 0)
        die("runs only as host root (it starts a root server's sandboxes as another uid)");
    if (argc == 4 && strcmp(argv[1], "--selftest") == 0)
        return selftest((uid_t)parse_id(argv[2], "uid"), (gid_t)parse_id(argv[3], "gid"));
    uid_t u = 0;
    gid_t g = 0;
    const char *stage = NULL;
    const char *maps[MAX_MAPS];
    int nmaps = 0, i = 1;
    for (; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            i++;
            break;
        }
        if (i + 1 >= argc)
            die("option %s needs a value", argv[i]);
        if (strcmp(argv[i], "--uid") == 0)
            u = (uid_t)parse_id(argv[++i], "uid");
        else if (strcmp(argv[i], "--gid") == 0)
            g = (gid_t)parse_id(argv[++i], "gid");
        else if (strcmp(argv[i], "--stage") == 0)
            stage = argv[++i];
        else if (strcmp(argv[i], "--map") == 0) {
            if (nmaps == MAX_MAPS)
                die("more than %d binds", MAX_MAPS);
            maps[nmaps++] = argv[++i];
        } else
            die("unknown option %s", argv[i]);
    }
    if (u == 0 || g == 0 || stage == NULL || i >= argc || argv[i][0] != '/')
        die("usage: cc-identity --uid U --gid G --stage DIR [--map SRC]... -- /PROGRAM [ARG]...");
    stage_tmpfs(stage);
    stage_all(stage, maps, nmaps, u, g);
    seal_stage(stage);
    for (int o = 0; o < nowners; o++)
        close(owners[o].ns);
    give_pipes(u, g);
    become(u, g);
    execv(argv[i], &argv[i]);
    die("exec %s: %s", argv[i], strerror(errno));
}
