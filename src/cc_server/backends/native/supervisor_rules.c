/*
 * The rules: the create-time name globs (glob_match) and the write policy's path rules judged on
 * a name's path in the task's view (judge_path, path_refused and the git, worktree and carry rules
 * beside it).
 */
#include "supervisor.h"

struct glob_form glob_form_of(const char *glob) {
    struct glob_form f = {.kind = GLOB_FNMATCH, .text = glob, .len = 0};
    const char *lit = glob[0] == '*' ? glob + 1 : glob;
    for (const char *c = lit; *c; c++) {
        if ((unsigned char)*c >= 0x80 || strchr("*?[]\\", *c))
            return f;
    }
    f.kind = lit == glob ? GLOB_LITERAL : GLOB_SUFFIX;
    f.text = lit;
    f.len = strlen(lit);
    return f;
}

static bool ascii_name(const char *name, size_t *len) {
    size_t i = 0;
    for (; name[i]; i++) {
        if ((unsigned char)name[i] >= 0x80)
            return false;
    }
    *len = i;
    return true;
}

static bool ascii_caseeq(const char *a, const char *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char x = (unsigned char)a[i], y = (unsigned char)b[i];
        if (x >= 'A' && x <= 'Z')
            x = (unsigned char)(x - 'A' + 'a');
        if (y >= 'A' && y <= 'Z')
            y = (unsigned char)(y - 'A' + 'a');
        if (x != y)
            return false;
    }
    return true;
}

/* Whether `name` matches a glob, case-insensitively (fnmatch with FNM_CASEFOLD; an ASCII name
 * against a glob of glob_form_of's two simple kinds is compared directly: the same answer, at a
 * tenth of the cost, and ASCII letters fold as ASCII in every locale). */
bool glob_match(struct ccs *s, const char *name, const char **which) {
    size_t len = 0;
    bool ascii = ascii_name(name, &len);
    for (int i = 0; i < s->nglobs; i++) {
        const struct glob_form *f = &s->forms[i];
        bool hit;
        if (ascii && f->kind == GLOB_LITERAL)
            hit = len == f->len && ascii_caseeq(name, f->text, len);
        else if (ascii && f->kind == GLOB_SUFFIX)
            hit = len >= f->len && ascii_caseeq(name + len - f->len, f->text, f->len);
        else
            hit = fnmatch(s->globs[i], name, FNM_CASEFOLD) == 0;
        if (hit) {
            *which = s->globs[i];
            return true;
        }
    }
    return false;
}

bool has_path_rules(const struct ccs *s) { return s->npats > 0 || s->nabsolutes > 0; }

/* `path` is `root` or below it. */
bool path_under(const char *path, const char *root) {
    size_t n = strlen(root);
    while (n > 1 && root[n - 1] == '/')
        n--;
    if (n == 1 && root[0] == '/')
        return true;
    return strncmp(path, root, n) == 0 && (path[n] == '\0' || path[n] == '/');
}

/* This process's /proc/self/fd, opened once (ccs_start): a link read from it skips the lookup
 * of /proc, self and fd that every path through /proc/self/fd/N repeats (4 of a ~10 us readlink
 * here). -1 until then, or when it could not be opened: the full path is used. */
static _Atomic int self_fds = -1;

void open_self_fds(void) {
    if (atomic_load(&self_fds) >= 0)
        return;
    int fd = open("/proc/self/fd", O_PATH | O_DIRECTORY | O_CLOEXEC);
    int none = -1;
    if (fd >= 0 && !atomic_compare_exchange_strong(&self_fds, &none, fd))
        close(fd); /* another supervisor of this process opened it first */
}

/* readlink of /proc/self/fd/<fd>. */
static ssize_t read_fd_link(int fd, char *buf, size_t size) {
    char name[32];
    int dir = atomic_load(&self_fds);
    if (dir >= 0) {
        snprintf(name, sizeof name, "%d", fd);
        return readlinkat(dir, name, buf, size);
    }
    snprintf(name, sizeof name, "/proc/self/fd/%d", fd);
    return readlink(name, buf, size);
}

/* The path of an open file in the task's view (its /proc/self/fd link), in `buf`: false when it
 * is not a path there (a pipe, a socket), too long, or gone (" (deleted)"). */
bool fd_path(int fd, char *buf, size_t size) {
    ssize_t n = read_fd_link(fd, buf, size - 1);
    if (n <= 0 || (size_t)n >= size - 1 || buf[0] != '/' ||
        (n > 10 && memcmp(buf + n - 10, " (deleted)", 10) == 0)) {
        buf[0] = '\0';
        return false;
    }
    buf[n] = '\0';
    return true;
}

/* Whether the pinned directory `dir_fd` is at or below an exempt root (a runner's own state
 * directory, a mount of its own in the task's view): the create-time globs do not apply there,
 * so Claude Code's own session keys (sessions/N.HASH.key) are made. A name there cannot reach a
 * writable bind by a rename or a link (another mount: EXDEV); a copy creates its names where the
 * globs apply. A directory whose path cannot be read is not exempt. */
static bool dir_exempt(const struct ccs *s, int dir_fd) {
    char full[PATH_MAX];
    if (s->nexempts == 0 || !view_path(dir_fd, full, sizeof full))
        return false;
    for (int i = 0; i < s->nexempts; i++)
        if (path_under(full, s->exempts[i]))
            return true;
    return false;
}

/* Whether a glob refuses `name` in the pinned directory `dir_fd`. */
bool glob_refused(struct ccs *s, int dir_fd, const char *name, const char **which) {
    return glob_match(s, name, which) && !dir_exempt(s, dir_fd);
}

static bool pattern_hits(const struct ccs *s, const char *rel, const char *name,
                         const char **which) {
    size_t nlen = 0;
    bool ascii = ascii_name(name, &nlen); /* a literal is then compared as glob_match does */
    for (int i = 0; i < s->npats; i++) {
        const char *last = s->pat_last[i];
        if (last && (ascii && s->pat_last_literal[i]
                         ? strlen(last) != nlen || !ascii_caseeq(last, name, nlen)
                         : fnmatch(last, name, FNM_CASEFOLD) != 0))
            continue; /* an exact pattern must end in this name */
        if (s->pat_first[i] && !strcasestr(rel, s->pat_first[i]))
            continue; /* a tree pattern's first component must be in the path */
        int flags = FNM_PATHNAME | FNM_CASEFOLD | (s->pat_tree[i] ? FNM_LEADING_DIR : 0);
        for (const char *at = rel; at; at = strchr(at, '/')) {
            if (*at == '/')
                at++;
            if (fnmatch(s->pats[i], at, flags) == 0) {
                *which = s->pats[i];
                return true;
            }
        }
    }
    return false;
}

/* A `HEAD` anywhere but in a repository's own git directory: with `objects/` and `refs/` beside
 * it, host git takes that directory for a bare repository (its default safe.bareRepository=all)
 * and honours its `config` (core.fsmonitor runs at the next `git status` below it). git itself
 * writes a `HEAD` only inside a `.git` directory. */
#define BARE_HEAD "HEAD outside a .git directory: host git would take its directory for a bare " \
                  "repository and run what its config names"
static bool bare_head(const char *rel, const char *name) {
    if (strcmp(name, "HEAD") != 0)
        return false;
    /* In a repository's own git directory, at any depth (logs/HEAD, refs/remotes/x/HEAD,
     * worktrees/<name>/HEAD) it is git's. */
    return !(strncmp(rel, ".git/", 5) == 0 || strstr(rel, "/.git/") != NULL);
}

/* Whether the path rules refuse `full` (an absolute path in the task's view): an absolute
 * path at or below it, else a pattern matching the components below the outermost scope root
 * that holds it, unless an exempt root (a runner's own state directory) holds it. */
/* `full` below the outermost scope root that holds it (NULL: none does, a runner's state
 * directory holds it, or it is that root itself): where the patterns are matched. */
static const char *rel_below_root(const struct ccs *s, const char *full) {
    if (s->npats == 0)
        return NULL;
    const char *root = NULL;
    size_t best = 0;
    for (int i = 0; i < s->nroots; i++) {
        size_t n = strlen(s->roots[i]);
        if (path_under(full, s->roots[i]) && (root == NULL || n < best)) {
            root = s->roots[i];
            best = n;
        }
    }
    if (root == NULL)
        return NULL;
    for (int i = 0; i < s->nexempts; i++)
        if (path_under(full, s->exempts[i]))
            return NULL;
    const char *rel = full + best;
    while (*rel == '/')
        rel++;
    return *rel ? rel : NULL;
}

/* Whether `rel` (below a root) ends in a proper prefix of a pattern of several components
 * (`.config` of the pattern `.config/git` and all below, `.git/worktrees/x` of a worktree's
 * `commondir` pattern):
 * what is renamed, exchanged, linked or symlinked to such a name would bring the protected
 * path in with it, or take it away to be made again. */
#define PATH_UNKNOWN_CARRY "(the directory's path could not be read)"
#define ON_PATTERN_WAY "a directory on the way to a protected path: what is moved or linked " \
                       "there would carry protected files in or out"
static bool prefix_hits(const struct ccs *s, const char *rel) {
    for (int i = 0; i < s->nprefixes; i++)
        for (const char *at = rel; at; at = strchr(at, '/')) {
            if (*at == '/')
                at++;
            if (fnmatch(s->prefixes[i], at, FNM_PATHNAME | FNM_CASEFOLD) == 0)
                return true;
        }
    return false;
}

/* A name moved out of a repository's `.git` directory: with a `HEAD`, `objects` and `refs` it
 * would be a bare repository elsewhere, with the config and hooks it brought. */
#define OUT_OF_GIT "moved out of a .git directory: it would be a repository host git honours"
static bool in_git_dir(const char *rel) {
    return strncmp(rel, ".git/", 5) == 0 || strstr(rel, "/.git/") != NULL;
}

static bool full_path_refused(const struct ccs *s, const char *full, const char *name,
                              const char **which) {
    for (int i = 0; i < s->nabsolutes; i++) {
        if (path_under(full, s->absolutes[i])) {
            *which = s->absolutes[i];
            return true;
        }
    }
    const char *rel = rel_below_root(s, full);
    if (rel == NULL)
        return false;
    if (bare_head(rel, name)) {
        *which = BARE_HEAD;
        return true;
    }
    return pattern_hits(s, rel, name, which);
}

#define PATH_UNKNOWN "(the directory's path could not be read)"

/*
 * The path of `fd` in the task's view, into `buf`: its link, where that link is known to name it
 * from the task's root (view_path_check); else false, as for a path that cannot be read (the
 * caller refuses). A directory moved out of the task's bind by someone outside it (a second
 * sandbox whose bind holds this one's, the host) stays reachable through a cwd or a dirfd the
 * task holds; judged by its link it would be below no writable root and nothing would be
 * protected in it. The answer for one fd is kept for the rest of the call (`judging`).
 */
__thread struct req *judging;
static __thread struct { bool known; dev_t dev; ino_t ino; char path[PATH_MAX]; } viewed;

void begin_judging(struct req *q) {
    judging = q;
    viewed.known = false;
}

void end_judging(struct req **q) {
    (void)q;
    judging = NULL;
    viewed.known = false;
}

static bool view_path_check(int fd, char *buf, size_t size);

bool view_path(int fd, char *buf, size_t size) {
    if (view_path_check(fd, buf, size))
        return true;
    buf[0] = '\0'; /* never a path the task's view does not have */
    return false;
}

static int compare_ids(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Read the mount ids of the task's mount namespace (the first field of each mountinfo line)
 * into s->mnt_ids, sorted. Returns 1; 0 when the call's task is gone by the end of the read (its
 * /proc entry may have named another process with its thread id: asked again at the next call);
 * -1 when they cannot be read (then every link is resolved again). */
static int read_mount_ids(struct req *q) {
    struct ccs *s = q->s;
    int proc_fd = q->proc_fd;
    enum { MAX_MOUNTS = 4096, MAX_BYTES = 1 << 20 };
    int fd = proc_fd >= 0 ? openat(proc_fd, "mountinfo", O_RDONLY | O_CLOEXEC) : -1;
    if (fd < 0)
        return -1;
    size_t cap = 16384, len = 0;
    char *text = malloc(cap + 1);
    uint64_t *ids = malloc(MAX_MOUNTS * sizeof *ids);
    int n = 0, state = -1;
    for (ssize_t got = 1; text && ids && got > 0;) {
        if (len == cap) {
            char *more = cap < MAX_BYTES ? realloc(text, cap * 2 + 1) : NULL;
            if (!more)
                goto out;
            text = more;
            cap *= 2;
        }
        got = read(fd, text + len, cap - len);
        if (got < 0)
            goto out;
        len += (size_t)got;
    }
    if (!text || !ids)
        goto out;
    text[len] = '\0';
    for (char *line = text; *line; n++) {
        char *end;
        unsigned long long id = strtoull(line, &end, 10);
        if (end == line || *end != ' ' || n == MAX_MOUNTS)
            goto out;
        ids[n] = id;
        char *nl = strchr(end, '\n');
        if (!nl)
            goto out;
        line = nl + 1;
    }
    if (!id_valid(s, q->n->id)) {
        /* Still waiting in its call, the task kept its thread id all along, so the entry
         * opened by that id was its own; gone, it may not have been. */
        state = 0;
        goto out;
    }
    qsort(ids, (size_t)n, sizeof *ids, compare_ids);
    s->mnt_ids = ids;
    s->nmnt_ids = n;
    ids = NULL;
    state = 1;
out:
    close(fd);
    free(text);
    free(ids);
    return state;
}

/* Whether the object `fd` is on a mount of the sandbox's own mount namespace, as it was when
 * first asked (a mount that appears later is not in the set: its objects take the full check). */
static bool own_mount(struct req *q, int fd) {
    struct ccs *s = q->s;
    if (atomic_load(&s->mnt_state) == 0) {
        pthread_mutex_lock(&s->mnt_lock);
        if (atomic_load(&s->mnt_state) == 0)
            atomic_store(&s->mnt_state, read_mount_ids(q));
        pthread_mutex_unlock(&s->mnt_lock);
    }
    if (atomic_load(&s->mnt_state) != 1)
        return false;
    struct statx sx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_MNT_ID, &sx) < 0 || !(sx.stx_mask & STATX_MNT_ID))
        return false;
    uint64_t id = sx.stx_mnt_id;
    return bsearch(&id, s->mnt_ids, (size_t)s->nmnt_ids, sizeof id, compare_ids) != NULL;
}

/*
 * How a link is known to name its object in the task's view. The kernel builds it by walking the
 * object's dentries up through its mounts to the root of the mount namespace they are in, so
 * for an object on a mount of the sandbox's namespace the link is its path from the task's root
 * (the sandbox's filter refuses chroot, mounts and namespace changes, so that root and those
 * mounts stay what they were). A dentry moved out from under its mount's root (by a second
 * sandbox or the host, through a bind that holds this one's) reads "/" (the kernel's "escaped"
 * case), and an object on a mount of another namespace (an fd passed in by another sandbox) is
 * not on one of the sandbox's mounts: for those two, and for any mount that appeared after the
 * first call, the link is resolved again from the task's root and must name the very inode.
 */
static bool view_path_check(int fd, char *buf, size_t size) {
    struct req *q = judging;
    if (q != NULL && fd >= 0 && fd == q->root_fd && size > 1) {
        strcpy(buf, "/"); /* the task's root itself, where an absolute path starts: "/" by definition */
        return true;
    }
    if (!fd_path(fd, buf, size))
        return false;
    if (q == NULL)
        return false; /* not inside a call: nothing to check it against */
    if (buf[1] != '\0' && own_mount(q, fd))
        return true;
    struct stat a, b;
    if (fstat(fd, &a) != 0)
        return false;
    if (viewed.known && viewed.dev == a.st_dev && viewed.ino == a.st_ino &&
        strcmp(viewed.path, buf) == 0)
        return true;
    if (open_root(q) != 0)
        return false;
    int again = -1;
    if (buf[1] != '\0') {
        struct open_how how = {
            .flags = O_PATH | O_NOFOLLOW | O_CLOEXEC,
            .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH,
        };
        again = (int)syscall(SYS_openat2, q->root_fd, buf + 1, &how, sizeof how);
        if (again < 0)
            return false;
    }
    bool same = fstat(again >= 0 ? again : q->root_fd, &b) == 0 && a.st_dev == b.st_dev &&
                a.st_ino == b.st_ino;
    if (again >= 0)
        close(again);
    /* A kernel filesystem's directory cannot be moved, and procfs and sysfs make a new inode
     * for a name looked up again: its link is its path. (Nothing is created or opened there for
     * a task: kernel_object.) */
    struct statfs sf;
    if (!same && fstatfs(fd, &sf) == 0 && kernel_object(fd))
        return true;
    if (same) {
        viewed.known = true;
        viewed.dev = a.st_dev;
        viewed.ino = a.st_ino;
        snprintf(viewed.path, sizeof viewed.path, "%s", buf);
    }
    return same;
}

/* `name` in the pinned directory `dir_fd` (or the object `dir_fd` itself, for an empty name) as
 * an absolute path in the task's view: the fd's link, never the string the task passed, and
 * only where that link names it in the task's view (view_path). Kept in `judged`. False when the
 * path cannot be read (gone, or not in the task's view). */
bool judge_path(int dir_fd, const char *name) {
    if (!view_path(dir_fd, judged, PATH_MAX))
        return false;
    size_t n = strlen(judged);
    if (name[0]) {
        if (n > 1)
            judged[n++] = '/';
        snprintf(judged + n, sizeof judged - (size_t)n, "%s", name);
    }
    return true;
}

/* A linked worktree's own files (commondir, config.worktree) steer host git in every worktree
 * whose pointer names that directory: protected, except in a directory this sandbox made itself
 * (`git worktree add` to the sandbox's /tmp: no pointer on the host names it, unless a stale one
 * of a pruned worktree of that very name is left). */
#define WORKTREE_PATTERNS ".git/worktrees/"
static bool own_worktree(struct ccs *s, int dir_fd) {
    struct stat st;
    if (fstat(dir_fd, &st) != 0)
        return false;
    bool own = false;
    pthread_mutex_lock(&s->wt_lock);
    for (int i = 0; i < s->nown_wt && !own; i++)
        own = s->own_wt[i].dev == st.st_dev && s->own_wt[i].ino == st.st_ino;
    pthread_mutex_unlock(&s->wt_lock);
    return own;
}

/* Whether `dir_fd` is a repository's `.git/worktrees` (the path rules on). */
static bool is_worktrees_dir(const struct ccs *s, int dir_fd) {
    static const char suffix[] = "/.git/worktrees";
    if (s->npats == 0 || !judge_path(dir_fd, ""))
        return false;
    size_t n = strlen(judged), k = sizeof suffix - 1;
    return n >= k && strcmp(judged + n - k, suffix) == 0;
}

/* Whether `name` in `dir_fd` is a linked worktree's directory this sandbox did not make: it may
 * not be removed or moved away (its name could then be made again, as the sandbox's own, with
 * another commondir, which the host's pointer to that name would follow). */
#define WORKTREE_DIR "a linked worktree's directory: a pointer on the host names it"
bool worktree_dir_refused(struct ccs *s, int dir_fd, const char *name, const char **which) {
    if (!is_worktrees_dir(s, dir_fd))
        return false;
    int fd = openat(dir_fd, name, O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return false; /* not a directory (or gone): the other rules decide */
    bool own = own_worktree(s, fd);
    close(fd);
    if (own)
        return false;
    judge_path(dir_fd, name);
    *which = WORKTREE_DIR;
    return true;
}

/* After a mkdir: a new directory directly in a repository's .git/worktrees is this sandbox's. */
void note_worktree_dir(struct ccs *s, int dir_fd, const char *name) {
    if (!is_worktrees_dir(s, dir_fd))
        return;
    struct stat st;
    if (fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode))
        return;
    int fd = openat(dir_fd, name, O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC);
    struct stat pinned;
    if (fd < 0 || fstat(fd, &pinned) != 0 || pinned.st_ino != st.st_ino) {
        close_fd(&fd);
        return; /* not recorded: its commondir stays protected */
    }
    pthread_mutex_lock(&s->wt_lock);
    if (s->nown_wt < MAX_OWN_WORKTREES) {
        s->own_wt[s->nown_wt].dev = st.st_dev;
        s->own_wt[s->nown_wt].ino = st.st_ino;
        s->own_wt[s->nown_wt].fd = fd;
        s->nown_wt++;
        fd = -1;
    }
    pthread_mutex_unlock(&s->wt_lock);
    close_fd(&fd);
}

/* For a rename's sides and a name made as anything but a directory: prefix_hits on its judged
 * path, and (`from_git`: the old side, with the new side's path in `to`) a move out of .git. */
bool carry_refused(const struct ccs *s, int dir_fd, const char *name, const char *to,
                   const char **which) {
    if (s->npats == 0)
        return false;
    if (!judge_path(dir_fd, name)) {
        *which = PATH_UNKNOWN_CARRY;
        return true;
    }
    const char *rel = rel_below_root(s, judged);
    if (rel == NULL)
        return false;
    if (prefix_hits(s, rel)) {
        *which = ON_PATTERN_WAY;
        return true;
    }
    if (to != NULL && in_git_dir(rel)) {
        const char *to_rel = rel_below_root(s, to);
        if (to_rel == NULL || !in_git_dir(to_rel)) {
            *which = OUT_OF_GIT;
            return true;
        }
    }
    return false;
}

/* A repository's git directory by its shape, whatever its name (a `--separate-git-dir` store, a
 * bare repository, a bind whose root is a `.git`): a HEAD (head_file), objects/ and refs/. Its
 * config, commondir, config.worktree, hooks/ and modules/, and a linked worktree's commondir
 * and config.worktree below its worktrees/, are protected as a `.git`'s are. Looked at only
 * when the judged path has one of those names in it, so a create elsewhere pays a string
 * search. */
#define GIT_DIR_SHAPED "a repository's git directory (HEAD, objects, refs): host git honours " \
                       "its config and hooks"
static bool dir_or_link(int fd, const char *name) {
    struct stat st; /* git follows a symlinked objects/ or refs/ (shared object stores) */
    return fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
           (S_ISDIR(st.st_mode) || S_ISLNK(st.st_mode));
}

/* A HEAD git reads: a regular file, or a symlink (`HEAD -> refs/heads/main`, what
 * core.preferSymlinkRefs makes; git's discovery takes its directory too). */
static bool head_file(int fd) {
    struct stat st;
    return fstatat(fd, "HEAD", &st, AT_SYMLINK_NOFOLLOW) == 0 &&
           (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode));
}

static bool gitdir_shaped(int fd) {
    return head_file(fd) && dir_or_link(fd, "objects") && dir_or_link(fd, "refs");
}

/* HEAD, objects and refs of a git directory: what makes its shape. Removed or moved away (and
 * put back after its config was written), the directory would not be judged a git directory
 * while it was written. Replacing HEAD by a regular file (git's own HEAD.lock) keeps it. */
#define GIT_SHAPE "HEAD, objects or refs of a git directory: without them it would not be " \
                  "judged one while its config is written"
bool shape_refused(const struct ccs *s, int dir_fd, const char *name, bool replacing_by_file,
                   const char **which) {
    if (s->npats == 0 || !(strcmp(name, "HEAD") == 0 || strcmp(name, "objects") == 0 ||
                           strcmp(name, "refs") == 0))
        return false;
    if (!gitdir_shaped(dir_fd))
        return false;
    if (replacing_by_file && strcmp(name, "HEAD") == 0)
        return false;
    judge_path(dir_fd, name);
    *which = GIT_SHAPE;
    return true;
}

/* HEAD, objects or refs made (by mkdir, mknod, symlink, link or a rename onto the name) as the
 * last of the three in a directory outside a `.git` directory: it would become a git directory
 * whose config and hooks were written while it was not one (host git honours them). git makes
 * the three itself only inside a `.git` directory (`git init`, `git clone`, a submodule's
 * modules/<name>); a bare repository's HEAD outside one is refused anyway (bare_head). A
 * directory that is shaped already is shape_refused's. */
#define SHAPE_COMPLETED "the last of HEAD, objects and refs in a directory outside a .git " \
                        "directory: host git would take it for a repository whose config and " \
                        "hooks were written before"
static bool is_shape_name(const char *name) {
    return strcmp(name, "HEAD") == 0 || strcmp(name, "objects") == 0 || strcmp(name, "refs") == 0;
}

bool completes_shape(const struct ccs *s, int dir_fd, const char *name, const char **which) {
    if (s->npats == 0 || !is_shape_name(name) || gitdir_shaped(dir_fd))
        return false;
    bool head = strcmp(name, "HEAD") == 0;
    bool others = head ? dir_or_link(dir_fd, "objects") && dir_or_link(dir_fd, "refs")
                       : head_file(dir_fd) &&
                             dir_or_link(dir_fd, strcmp(name, "refs") == 0 ? "objects" : "refs");
    if (!others)
        return false;
    if (!judge_path(dir_fd, name)) {
        *which = PATH_UNKNOWN_CARRY;
        return true;
    }
    const char *rel = rel_below_root(s, judged);
    if (rel == NULL || in_git_dir(rel))
        return false;
    *which = SHAPE_COMPLETED;
    return true;
}

/* Whether a directory, or one of its nearest ancestors, is a git directory (HEAD is git's
 * there: logs/HEAD, refs/remotes/x/HEAD, a separate gitdir's own HEAD). */
static bool in_shaped_gitdir(int dir_fd) {
    int cur = fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
    bool found = false;
    for (int depth = 0; cur >= 0 && depth < 6 && !found; depth++) {
        found = gitdir_shaped(cur);
        int parent = openat(cur, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
        close(cur);
        cur = parent;
    }
    close_fd(&cur);
    return found;
}

static bool git_control_name(const char *name) {
    static const char *const names[] = {"config", "commondir", "config.worktree", "hooks",
                                        "modules", NULL};
    for (int i = 0; names[i]; i++)
        if (strcmp(name, names[i]) == 0)
            return true;
    return false;
}

static bool gitdir_refused(const struct ccs *s, int dir_fd, const char *name, const char **which) {
    if (s->npats == 0 || rel_below_root(s, judged) == NULL)
        return false;
    const char *base = strrchr(judged, '/');
    base = base ? base + 1 : judged;
    bool deep = strstr(judged, "/hooks/") || strstr(judged, "/modules/") ||
                strstr(judged, "/worktrees/");
    if (!name[0]) {
        /* An object (through the task's own procfs link): its directory is not pinned here;
         * a git-control name is refused outright. */
        if (git_control_name(base) || deep) {
            *which = GIT_DIR_SHAPED;
            return true;
        }
        return false;
    }
    if (git_control_name(name) && gitdir_shaped(dir_fd)) {
        *which = GIT_DIR_SHAPED;
        return true;
    }
    if (!deep && !(strcmp(name, "commondir") == 0 || strcmp(name, "config.worktree") == 0 ||
                   strcmp(name, "gitdir") == 0 || strcmp(name, "locked") == 0))
        return false;
    /* Up from the pinned directory: below hooks/ or modules/ of a git directory, or a
     * worktree's own file in <git dir>/worktrees/<name>/. */
    bool refused = false;
    int cur = fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
    for (int depth = 0; cur >= 0 && depth < 16 && !refused; depth++) {
        char path[PATH_MAX];
        if (!fd_path(cur, path, sizeof path) || rel_below_root(s, path) == NULL)
            break; /* at (or above) the writable root: nothing further up is judged */
        const char *cur_name = strrchr(path, '/') + 1;
        int parent = openat(cur, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (parent < 0)
            break;
        if ((strcmp(cur_name, "hooks") == 0 || strcmp(cur_name, "modules") == 0) &&
            gitdir_shaped(parent))
            refused = true;
        if (!refused && depth == 0 &&
            (strcmp(name, "commondir") == 0 || strcmp(name, "config.worktree") == 0 ||
             strcmp(name, "gitdir") == 0 || strcmp(name, "locked") == 0)) {
            char ppath[PATH_MAX];
            bool known = fd_path(parent, ppath, sizeof ppath);
            int grand = known ? openat(parent, "..", O_PATH | O_DIRECTORY | O_CLOEXEC) : -1;
            if (grand >= 0 && strcmp(strrchr(ppath, '/') + 1, "worktrees") == 0 &&
                gitdir_shaped(grand) && !own_worktree((struct ccs *)s, cur))
                refused = true;
            close_fd(&grand);
        }
        close(cur);
        cur = parent;
        if (strcmp(path, "/") == 0)
            break;
    }
    close_fd(&cur);
    if (refused)
        *which = GIT_DIR_SHAPED;
    return refused;
}

/* Whether the object `fd` has no name a rule could protect: a pipe, a socket or another
 * anonymous inode (its link is "pipe:[N]" and the like, reached through /proc/self/fd/N, as
 * `echo > /dev/stderr` does), or a file whose last name is gone. */
static bool not_a_path(int fd) {
    char target[PATH_MAX];
    ssize_t n = read_fd_link(fd, target, sizeof target - 1);
    if (n > 0 && target[0] != '/')
        return true;
    struct stat st;
    return fstat(fd, &st) == 0 && !S_ISDIR(st.st_mode) && st.st_nlink == 0;
}

/* The path rules for `name` in the pinned directory `dir_fd`, on its path in the task's view
 * (judge_path). A directory whose path cannot be read is refused. */
bool path_refused(const struct ccs *s, int dir_fd, const char *name, const char **which) {
    if (!has_path_rules(s))
        return false;
    if (!judge_path(dir_fd, name)) {
        if (name[0] == '\0' && not_a_path(dir_fd))
            return false;
        *which = PATH_UNKNOWN;
        return true;
    }
    const char *base = strrchr(judged, '/');
    if (!full_path_refused(s, judged, base ? base + 1 : judged, which))
        return gitdir_refused(s, dir_fd, name, which);
    if (strcmp(*which, BARE_HEAD) == 0 && name[0] && in_shaped_gitdir(dir_fd))
        /* a HEAD of a git directory that already is one, unless it would make another */
        return completes_shape(s, dir_fd, name, which);
    return !(name[0] && strncmp(*which, WORKTREE_PATTERNS, strlen(WORKTREE_PATTERNS)) == 0 &&
             own_worktree((struct ccs *)s, dir_fd));
}

/* Whether the path rules clear `rel` (names, "." and empty components, never "..") from the
 * directory `start` without pinning its parent: what open_beneath asks before it opens `rel`
 * with one openat2 that follows no symlink and no magic link and stays beneath `start`. Such an
 * openat2 reaches exactly the names in `rel` ("." and an empty component stay where they are), so
 * the path it opens is the start's path (read from its fd, never the task's string) joined with
 * those names, as a pinned parent's path joined with the name would be: the same rules decide it,
 * on the same kind of string. Only what the strings settle is cleared here: a name whose rule
 * looks at the directory it is in (a git control name, HEAD, objects, refs, a worktree's own
 * files) or a path through hooks/, modules/ or worktrees/ (their rules walk up the directories)
 * returns false, and so does a refusal: the caller then takes the pinned parent, which decides
 * (and reports) as before. */
static bool join_names(char *out, size_t n, size_t size, const char *rel) {
    for (const char *at = rel;;) {
        const char *end = strchr(at, '/');
        size_t k = end ? (size_t)(end - at) : strlen(at);
        if (k == 2 && at[0] == '.' && at[1] == '.')
            return false;
        if (k > 0 && !(k == 1 && at[0] == '.')) {
            if (n + 1 + k >= size)
                return false; /* longer than a path can be: the walk answers */
            if (n > 1)
                out[n++] = '/';
            memcpy(out + n, at, k);
            n += k;
            out[n] = '\0';
        }
        if (!end)
            return true;
        at = end + 1;
    }
}

bool lexically_clear(const struct ccs *s, int start, const char *rel, const char *name,
                     bool creating) {
    static const char *const dir_names[] = {"config", "commondir", "config.worktree", "hooks",
                                            "modules", "gitdir", "locked", "HEAD", "objects",
                                            "refs", NULL};
    for (int i = 0; dir_names[i]; i++)
        if (strcasecmp(name, dir_names[i]) == 0)
            return false;
    if (!view_path(start, judged, PATH_MAX) ||
        !join_names(judged, strlen(judged), sizeof judged, rel))
        return false;
    if (strcasestr(judged, "/hooks/") || strcasestr(judged, "/modules/") ||
        strcasestr(judged, "/worktrees/"))
        return false;
    const char *which;
    if (full_path_refused(s, judged, name, &which))
        return false;
    if (creating)
        for (int i = 0; i < s->nabsolutes; i++)
            if (path_under(s->absolutes[i], judged))
                return false; /* on the way to a protected path: ancestor_refused decides */
    return true;
}

/* Whether `name` in `dir_fd` lies on the way to a protected path (an absolute rule below it): such
 * a name may not be removed, renamed or made as anything but a directory, or the protected
 * spelling would lead elsewhere (`rm L && ln -s elsewhere L` re-points L/settings.json). */
#define ON_THE_WAY "on the way to a protected path: removed or replaced, the path would lead elsewhere"
bool ancestor_refused(const struct ccs *s, int dir_fd, const char *name, const char **which) {
    if (s->nabsolutes == 0)
        return false;
    if (!judge_path(dir_fd, name)) {
        *which = PATH_UNKNOWN;
        return true;
    }
    for (int i = 0; i < s->nabsolutes; i++) {
        if (path_under(s->absolutes[i], judged)) {
            *which = ON_THE_WAY;
            return true;
        }
    }
    return false;
}

/* The path rules for an object the task reached with no parent pinned (its own fd, its own
 * procfs link, a directory): the parent is found by the object's path in the task's view, from
 * the task's root with no symlink on the way, and must still hold that very object; then the
 * object is judged as a name in it, as any other. Anything else is refused. */
#define PATH_MOVED "(the object is no longer where its path says)"
bool object_refused(struct req *q, int obj, const char **which) {
    struct ccs *s = q->s;
    if (!has_path_rules(s))
        return false;
    if (!judge_path(obj, "")) {
        if (not_a_path(obj))
            return false;
        *which = PATH_UNKNOWN;
        return true;
    }
    if (strcmp(judged, "/") == 0)
        return full_path_refused(s, judged, "", which);
    char full[PATH_MAX + NAME_MAX + 2];
    snprintf(full, sizeof full, "%s", judged);
    char *slash = strrchr(full, '/');
    *slash = '\0';
    const char *base = slash + 1, *dir = full[0] ? full + 1 : "";
    int root;
    if (get_root(q, &root) != 0) {
        *which = PATH_UNKNOWN;
        return true;
    }
    struct open_how how = {
        .flags = O_PATH | O_DIRECTORY | O_CLOEXEC,
        .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH,
    };
    int parent = dir[0] ? (int)syscall(SYS_openat2, root, dir, &how, sizeof how)
                        : fcntl(root, F_DUPFD_CLOEXEC, 0);
    close(root);
    struct stat a, b;
    bool same = parent >= 0 && fstatat(parent, base, &a, AT_SYMLINK_NOFOLLOW) == 0 &&
                fstat(obj, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
    if (!same) {
        close_fd(&parent);
        judge_path(obj, "");
        *which = PATH_MOVED;
        return true;
    }
    bool refused = path_refused(s, parent, base, which);
    close(parent);
    return refused;
}
